"""Remote control over tcp with CURVE, and metrics on loopback, against a real manager.

A client without keys, one with a key the manager never authorized and one
that does not know the server's key are each refused (their request gets no
answer within a second), and the manager keeps serving its authorized client
afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
from pathlib import Path

import msgspec
import pytest
import zmq
from conftest import freeride_cmd, poll, running_manager

from freeride import protocol as p
from freeride.auth import CurveClientKeys, create_keys, load_client_keys
from freeride.serve.config import ServeConfig
from freeride.transport import ControlClient, Endpoints, ManagerUnreachable, curve_keypair


def _free_port_pair() -> int:
    """A port P with P and P+1 free now (events and control)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise AssertionError("no two consecutive free ports")


def _keyless_request(endpoint: str, timeout_s: float) -> bytes | None:
    """A plain (NULL mechanism) DEALER's status request: the reply, or None if none came."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(msgspec.msgpack.encode(p.StatusRequest()))
        return sock.recv() if sock.poll(int(timeout_s * 1000), zmq.POLLIN) else None
    finally:
        sock.close(linger=0)
        ctx.term()


def _ask(endpoint: str, keys: CurveClientKeys, req: p.ControlRequest, timeout_s: float) -> p.ControlReply:
    with ControlClient(endpoint, timeout_s=timeout_s, curve=keys) as client:
        return client.request(req)


async def test_refused_clients_get_nothing_and_the_manager_keeps_serving(runtime_dir: Path) -> None:
    keys, stranger = runtime_dir / "keys", runtime_dir / "stranger"
    create_keys(keys, keypair=curve_keypair)
    create_keys(stranger, keypair=curve_keypair)  # a pair the manager never authorized
    good, unknown = load_client_keys(keys), load_client_keys(stranger)
    blind = CurveClientKeys(public=good.public, secret=good.secret, server=unknown.server)  # wrong server key
    endpoints = Endpoints.tcp("127.0.0.1", _free_port_pair(), runtime_dir)
    config = ServeConfig(endpoints=endpoints, state_dir=runtime_dir / "state", keys_dir=keys, stop_timeout_s=5)
    async with running_manager(config) as manager:
        first = await asyncio.to_thread(_ask, endpoints.control, good, p.StatusRequest(), 10)
        assert isinstance(first, p.StatusReply)

        assert await asyncio.to_thread(_keyless_request, endpoints.control, 1.0) is None
        for wrong in (unknown, blind):
            with pytest.raises(ManagerUnreachable):
                await asyncio.to_thread(_ask, endpoints.control, wrong, p.StatusRequest(), 1.0)
        spec = p.IterativeSpec(target="_tasks:SpinSteps", device="cpu:9")
        with pytest.raises(ManagerUnreachable):
            await asyncio.to_thread(_ask, endpoints.control, unknown, p.Submit(spec=spec), 1.0)
        assert manager.tasks == {}  # nothing a refused client sent got through

        # the authorized client, after every refusal: still served, and heard
        submitted = await asyncio.to_thread(_ask, endpoints.control, good, p.Submit(spec=spec), 10)
        assert isinstance(submitted, p.Submitted)
        reply = await asyncio.to_thread(_ask, endpoints.control, good, p.StatusRequest(), 10)
        assert isinstance(reply, p.StatusReply) and [t.task_id for t in reply.tasks] == [submitted.task_id]


def test_cli_with_a_stranger_key_is_refused_while_the_manager_serves(runtime_dir: Path) -> None:
    keys, stranger = runtime_dir / "keys", runtime_dir / "stranger"
    create_keys(keys, keypair=curve_keypair)
    create_keys(stranger, keypair=curve_keypair)
    tcp = ["--tcp", f"127.0.0.1:{_free_port_pair()}"]

    def cli_status(keys_dir: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
        cmd = freeride_cmd("status", "--runtime-dir", str(runtime_dir), *tcp, "--keys-dir", str(keys_dir))
        return subprocess.run(
            [*cmd, "--timeout", str(timeout_s)], capture_output=True, text=True, timeout=60, check=False
        )

    proc = subprocess.Popen(freeride_cmd("serve", "--runtime-dir", str(runtime_dir), *tcp, "--keys-dir", str(keys)))
    try:
        poll(lambda: (runtime_dir / "workers").exists(), 30, "the manager's sockets")
        assert cli_status(keys, 30).returncode == 0
        refused = cli_status(stranger, 1)
        assert refused.returncode == 3 and "no FreeRide manager answered" in refused.stderr, refused.stderr
        again = cli_status(keys, 30)
        assert again.returncode == 0 and "bubble start" in again.stdout, again.stderr
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, _, hexport = local.partition(":")
        if int(hexport, 16) == port and state == "0A":
            found.append(addr)
    return found


@pytest.mark.parametrize(("host", "addr"), [(None, "0100007F"), ("0.0.0.0", "00000000")])
async def test_metrics_bind_loopback_unless_told(
    runtime_dir: Path, host: str | None, addr: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = _free_port_pair()
    where = {"metrics_host": host} if host else {}
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", metrics_port=port, **where
    )
    with caplog.at_level(logging.WARNING, logger="freeride.serve.manager"):
        async with running_manager(config):
            assert _listening(port) == [addr]
    warned = [r.getMessage() for r in caplog.records if "[metrics]" in r.getMessage()]
    assert warned == (
        [f"[metrics] bound to {host}: other hosts can read them (no authentication; counters only)"] if host else []
    )
