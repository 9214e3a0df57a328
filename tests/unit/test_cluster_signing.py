"""Cluster jobs signed with a shared secret: what a node holding it runs, and what it refuses.

The queue here is the ledger itself (the Ray actor's state, without Ray); the
end-to-end case, an unsigned job failed by a real node on a real Ray cluster,
is in tests/ipc/test_cluster_ray.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from freeride import protocol as p
from freeride.auth import KeysMissing, UnsafeDirectory
from freeride.cli.main import main
from freeride.cluster import messages as m
from freeride.cluster.ledger import Ledger
from freeride.cluster.signing import SECRET_FILE, create_secret, load_secret, sign, verify

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")

PROGRAM = p.ProgramSpec(argv=["python", "job.py"], env={"TOKEN": "t"}, name="job")


def _secret(tmp_path: Path) -> bytes:
    create_secret(tmp_path / "keys")
    secret = load_secret(tmp_path / "keys")
    assert secret is not None
    return secret


def test_a_signed_spec_verifies_and_any_change_to_it_does_not(tmp_path: Path) -> None:
    secret = _secret(tmp_path)
    signature = sign(PROGRAM, secret)
    assert verify(PROGRAM, signature, secret)
    for changed in (
        msgspec.structs.replace(PROGRAM, argv=["sh", "-c", "id"]),
        msgspec.structs.replace(PROGRAM, env={"TOKEN": "t", "LD_PRELOAD": "/tmp/x.so"}),
        msgspec.structs.replace(PROGRAM, name="job2"),
    ):
        assert not verify(changed, signature, secret)
    assert not verify(PROGRAM, "", secret)
    assert not verify(PROGRAM, sign(PROGRAM, b"another secret of 32 bytes......"), secret)


def test_the_secret_is_made_private_and_kept(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    path = create_secret(keys)
    assert path == keys / SECRET_FILE and oct(os.stat(path).st_mode & 0o777) == "0o600"
    first = load_secret(keys)
    with pytest.raises(FileExistsError):
        create_secret(keys)
    assert load_secret(keys) == first
    create_secret(keys, force=True)
    assert load_secret(keys) != first
    assert load_secret(tmp_path / "none") is None


def test_a_secret_others_may_read_or_that_holds_nothing_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    path = create_secret(keys)
    os.chmod(path, 0o644)
    with pytest.raises(UnsafeDirectory, match=r"must be yours and private .*chmod 600"):
        load_secret(keys)
    os.chmod(path, 0o600)
    path.write_text("not hex\n")
    with pytest.raises(KeysMissing, match="holds no secret"):
        load_secret(keys)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")  # a link is followed by no one, and refused in one line
    with pytest.raises(UnsafeDirectory, match="cannot be read as a file of yours"):
        load_secret(keys)


@as_root
def test_a_secret_file_another_user_owns_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    path = create_secret(keys)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory, match=f"is uid {NOBODY}"):
        load_secret(keys)


def test_the_queue_carries_each_jobs_signature_to_its_lease(tmp_path: Path) -> None:
    secret = _secret(tmp_path)
    ledger = Ledger(clock=lambda: 0.0)
    specs = [msgspec.structs.replace(PROGRAM, name=f"job-{i}") for i in range(2)]
    signed = m.SubmitJobs(specs=specs, signatures=[sign(s, secret) for s in specs])
    assert isinstance(ledger.submit(signed), m.Submitted)
    unsigned = msgspec.structs.replace(PROGRAM, name="unsigned")
    assert isinstance(ledger.submit(m.SubmitJobs(specs=[unsigned])), m.Submitted)
    slots = [m.Slot(device="cpu:0", spare_memory=1 << 30) for _ in range(3)]
    leases = ledger.lease(m.LeaseJobs(node="a", slots=slots, lease_s=30.0, kinds=["iterative", "imperative"]))
    got = {lease.spec.name: verify(lease.spec, lease.signature, secret) for lease in leases.leases}
    assert got == {"job-0": True, "job-1": True, "unsigned": False}


def test_signatures_that_do_not_match_the_jobs_are_refused() -> None:
    reply = Ledger(clock=lambda: 0.0).submit(m.SubmitJobs(specs=[PROGRAM], signatures=["a", "b"]))
    assert isinstance(reply, m.Refused) and "2 signatures for 1 jobs" in reply.reason


def test_freeride_keys_cluster_writes_the_secret_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys"
    assert main(["keys", "--cluster", "--keys-dir", str(keys)]) == 0
    assert "cluster secret written to" in capsys.readouterr().out and load_secret(keys) is not None
    with pytest.raises(SystemExit, match="exists; --force replaces it"):
        main(["keys", "--cluster", "--keys-dir", str(keys)])
