"""The security model's pure parts (docs/security.md): private directories, the serve lock, keys, ZAP verdicts.

Tests here run as root in CI, so a directory "of another user" is made with
os.chown; elsewhere those tests are skipped.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from freeride.auth import (
    KeysMissing,
    ManagerRunning,
    Refused,
    ServeLock,
    UnsafeDirectory,
    create_keys,
    ensure_private_dir,
    is_loopback_endpoint,
    load_client_keys,
    load_server_keys,
)
from freeride.serve.config import ServeConfig
from freeride.transport import Endpoints, curve_keypair, zap_verdict

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- runtime and state directories --------------------------------------------------


def test_a_new_runtime_dir_is_0700_whatever_the_umask(tmp_path: Path, umask_022: None) -> None:
    made = ensure_private_dir(tmp_path / "a" / "rt")
    assert _mode(made) == 0o700


def test_an_existing_private_dir_of_ours_is_accepted(tmp_path: Path) -> None:
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    assert ensure_private_dir(d) == d


def test_a_runtime_dir_open_to_others_is_refused_with_what_to_do(tmp_path: Path) -> None:
    d = tmp_path / "rt"
    d.mkdir()
    os.chmod(d, 0o755)
    with pytest.raises(UnsafeDirectory, match=r"mode 0755 .*chmod 700") as err:
        ensure_private_dir(d)
    assert "\n" not in str(err.value)


@as_root
def test_a_runtime_dir_planted_by_another_user_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory, match=rf"owned by uid {NOBODY}, not you .*remove it or choose another"):
        ensure_private_dir(d)


@as_root
def test_a_symlink_planted_by_another_user_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "mine"
    target.mkdir(mode=0o700)
    link = tmp_path / "rt"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory, match="symlink owned by uid"):
        ensure_private_dir(link)


def test_a_file_in_place_of_the_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "rt").write_text("")
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        ensure_private_dir(tmp_path / "rt")


def test_a_state_dir_may_be_readable_but_not_writable_by_others(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir()
    os.chmod(d, 0o755)
    ensure_private_dir(d, what="state dir", strict=False)
    os.chmod(d, 0o777)
    with pytest.raises(UnsafeDirectory, match="state dir"):
        ensure_private_dir(d, what="state dir", strict=False)


# -- one manager per runtime directory --------------------------------------------------


def test_a_second_serve_lock_is_refused_naming_the_holder(tmp_path: Path) -> None:
    held = ServeLock(tmp_path)
    held.acquire()
    with pytest.raises(ManagerRunning, match=rf"a manager \(pid {os.getpid()}\) already serves {tmp_path}"):
        ServeLock(tmp_path).acquire()
    held.release()
    with ServeLock(tmp_path):  # released: the next one may take it
        pass


def test_socket_dirs_start_with_the_runtime_dir(tmp_path: Path) -> None:
    assert Endpoints.ipc(tmp_path).socket_dirs() == [tmp_path]
    assert Endpoints.tcp("127.0.0.1", 5555, tmp_path).socket_dirs() == [tmp_path]


# -- CURVE keys --------------------------------------------------------------------------


def test_keys_are_made_private_and_load_as_a_matching_pair(tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    files = create_keys(keys_dir, keypair=curve_keypair)
    assert _mode(keys_dir) == 0o700 and all(_mode(f) == 0o600 for f in files)
    server, client = load_server_keys(keys_dir), load_client_keys(keys_dir)
    assert client.server == server.public and client.public in server.clients
    assert len(server.secret) == 40 and len(client.secret) == 40
    with pytest.raises(Refused, match="--force"):
        create_keys(keys_dir, keypair=curve_keypair)
    create_keys(keys_dir, keypair=curve_keypair, force=True)
    assert load_server_keys(keys_dir).public != server.public


def test_missing_keys_say_to_run_freeride_keys(tmp_path: Path) -> None:
    with pytest.raises(KeysMissing, match="freeride keys"):
        load_server_keys(tmp_path / "none")
    with pytest.raises(KeysMissing, match="freeride keys"):
        load_client_keys(tmp_path / "none")


def test_keys_in_a_dir_open_to_others_are_refused(tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    create_keys(keys_dir, keypair=curve_keypair)
    os.chmod(keys_dir, 0o755)
    with pytest.raises(KeysMissing, match="chmod 700"):
        load_server_keys(keys_dir)


def test_tcp_endpoints_without_keys_are_refused_loopback_or_not(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "127.0.0.1"):
        with pytest.raises(ValueError, match=r"keys_dir: .* need CURVE keys"):
            ServeConfig(endpoints=Endpoints.tcp(host, 5555, tmp_path), state_dir=tmp_path)
    ServeConfig(endpoints=Endpoints.tcp("0.0.0.0", 5555, tmp_path), state_dir=tmp_path, keys_dir=tmp_path)


def test_loopback_endpoints() -> None:
    assert is_loopback_endpoint("tcp://127.0.0.1:5") and is_loopback_endpoint("tcp://[::1]:5")
    assert is_loopback_endpoint("ipc:///tmp/x")
    assert not is_loopback_endpoint("tcp://0.0.0.0:5") and not is_loopback_endpoint("tcp://*:5")


# -- ZAP verdicts -------------------------------------------------------------------------


def test_ipc_peers_of_the_managers_uid_only() -> None:
    me = os.getuid()
    assert zap_verdict(b"NULL", f"localhost:{me}:0:123".encode(), [], uid=me, curve_clients=frozenset()) is None
    refused = zap_verdict(b"NULL", b"localhost:1000:1000:123", [], uid=me, curve_clients=frozenset())
    assert refused is not None and "peer uid 1000" in refused
    assert zap_verdict(b"NULL", b"127.0.0.1", [], uid=me, curve_clients=frozenset()) is not None
    assert zap_verdict(b"PLAIN", b"localhost:0:0:1", [b"u", b"p"], uid=0, curve_clients=frozenset()) is not None


def test_curve_clients_by_public_key_only() -> None:
    import zmq.utils.z85

    public, _ = curve_keypair()
    raw = zmq.utils.z85.decode(public)
    assert zap_verdict(b"CURVE", b"10.0.0.2", [raw], uid=0, curve_clients=frozenset({public})) is None
    other, _ = curve_keypair()
    assert zap_verdict(b"CURVE", b"10.0.0.2", [raw], uid=0, curve_clients=frozenset({other})) is not None
    assert zap_verdict(b"CURVE", b"10.0.0.2", [], uid=0, curve_clients=frozenset({public})) is not None
