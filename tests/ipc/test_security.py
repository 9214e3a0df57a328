"""Fault-and-attack tests of the security model (docs/security.md), with real sockets and processes.

Another local user is played by uid 65534 (``nobody``): tests that need to
become it, or to hand it a directory, run only as root and are skipped
otherwise. No test waits on time: each awaits a state or a reply under a
bounded timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
from conftest import freeride_cmd, poll, running_manager, serving, status, wait_until

from freeride import protocol as p
from freeride.auth import create_keys, load_client_keys
from freeride.serve.config import ServeConfig
from freeride.transport import (
    BubblePublisher,
    ControlClient,
    ControlServer,
    Endpoints,
    EventEmitter,
    ManagerUnreachable,
    ZapHandler,
    curve_keypair,
    new_async_context,
)

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="playing another user needs root")


def _others_can_run_python() -> bool:
    real = Path(os.path.realpath(sys.executable))
    return all(os.stat(d).st_mode & 0o001 for d in [real, *real.parents])


def _config(runtime_dir: Path, **kw: object) -> ServeConfig:
    return ServeConfig(
        endpoints=kw.pop("endpoints", Endpoints.ipc(runtime_dir)),  # type: ignore[arg-type]
        state_dir=runtime_dir / "state",
        checkpoint_every_s=0.2,
        stop_timeout_s=5,
        **kw,  # type: ignore[arg-type]
    )


def _serve_fails(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(freeride_cmd("serve", *args), capture_output=True, text=True, timeout=60, check=False)


# -- (a) the runtime directory ---------------------------------------------------------


def test_a_runtime_dir_open_to_others_is_refused(runtime_dir: Path) -> None:
    os.chmod(runtime_dir, 0o755)
    done = _serve_fails("--runtime-dir", str(runtime_dir))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"freeride: runtime dir {runtime_dir} has mode 0755")
    assert not (runtime_dir / "control").exists()


@as_root
def test_a_runtime_dir_planted_by_another_user_is_refused(runtime_dir: Path) -> None:
    planted = runtime_dir / "planted"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    done = _serve_fails("--runtime-dir", str(planted))
    assert done.returncode == 2
    assert f"is owned by uid {NOBODY}, not you" in done.stderr and "remove it or choose another" in done.stderr
    assert not (planted / "control").exists()


def test_a_new_runtime_dir_is_private_even_under_umask_022(runtime_dir: Path) -> None:
    fresh = runtime_dir / "fresh"
    old = os.umask(0o022)  # inherited by the manager
    try:
        with serving(fresh):
            assert (os.stat(fresh).st_mode & 0o777) == 0o700
    finally:
        os.umask(old)


# -- second serve ------------------------------------------------------------------------


def test_a_second_serve_on_the_same_runtime_dir_is_refused(runtime_dir: Path) -> None:
    with serving(runtime_dir) as first:
        done = _serve_fails("--runtime-dir", str(runtime_dir))
        assert done.returncode == 2
        assert f"a manager (pid {first.pid}) already serves {runtime_dir}" in done.stderr
        assert status(runtime_dir).uptime_ns > 0  # the first one keeps its sockets


# -- (a) planted checkpoint ----------------------------------------------------------------


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


async def test_a_planted_checkpoint_fails_its_task_alone_and_runs_nothing(runtime_dir: Path) -> None:
    marker = runtime_dir / "pwned"
    config = _config(runtime_dir)
    async with running_manager(config) as manager:
        config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"steps": 1, "state": {"x": _Planted(marker)}}, config.checkpoint_dir / "victim.pt")
        manager.declare_device("cpu:0", stage=0, spare_memory=1 << 30, cpu_affinity=[0])
        victim = manager.submit(p.IterativeSpec(target="_tasks:SpinSteps", name="victim", max_restarts=0))
        other = manager.submit(p.IterativeSpec(target="_tasks:SpinSteps", name="bystander"))
        assert isinstance(victim, p.Submitted) and isinstance(other, p.Submitted)
        await wait_until(lambda: manager.tasks[victim.task_id].terminal, 60, "the victim task to end")
        record = manager.tasks[victim.task_id]
        assert record.state == "failed" and "UnsafeCheckpoint" in record.error, record.error
        await wait_until(lambda: manager.tasks[other.task_id].state == "running", 60, "the bystander to run")
    assert not marker.exists()


# -- (d) planted modules in the manager's working directory ----------------------------------


async def test_a_planted_uvloop_in_the_managers_cwd_is_not_imported(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = runtime_dir / "cwd"
    cwd.mkdir()
    marker = runtime_dir / "pwned"
    (cwd / "uvloop.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(99)\n")
    monkeypatch.chdir(cwd)
    async with running_manager(_config(runtime_dir)) as manager:
        manager.declare_device("cpu:0", stage=0, spare_memory=1 << 30, cpu_affinity=[0])
        sub = manager.submit(p.IterativeSpec(target="_tasks:SpinSteps"))
        assert isinstance(sub, p.Submitted)
        await wait_until(lambda: manager.tasks[sub.task_id].state == "running", 60, "the worker to set up")
    assert not marker.exists()


# -- (b) tcp -------------------------------------------------------------------------------


def _free_port_pair() -> int:
    """A port P with P and P+1 free now (events and control)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return int(port)
    raise AssertionError("no two consecutive free ports")


def test_tcp_on_all_interfaces_without_keys_is_refused(runtime_dir: Path) -> None:
    done = _serve_fails(
        "--runtime-dir", str(runtime_dir), "--tcp", f"0.0.0.0:{_free_port_pair()}", "--keys-dir", str(runtime_dir / "k")
    )
    assert done.returncode == 2
    assert "freeride keys" in done.stderr.strip().splitlines()[-1]


async def test_curve_tcp_answers_its_clients_and_nobody_else(runtime_dir: Path) -> None:
    keys = runtime_dir / "keys"
    create_keys(keys, keypair=curve_keypair)
    stranger = runtime_dir / "stranger"  # a pair the manager never authorized
    create_keys(stranger, keypair=curve_keypair)
    endpoints = Endpoints.tcp("127.0.0.1", _free_port_pair(), runtime_dir)
    async with running_manager(_config(runtime_dir, endpoints=endpoints, keys_dir=keys)) as manager:
        manager.declare_device("cpu:0", stage=0, spare_memory=1 << 30, cpu_affinity=[0])

        def ask(keys_dir: Path, req: p.ControlRequest, timeout_s: float) -> p.ControlReply:
            with ControlClient(endpoints.control, timeout_s=timeout_s, curve=load_client_keys(keys_dir)) as client:
                return client.request(req)

        spec = p.IterativeSpec(target="_tasks:SpinSteps")
        submitted = await asyncio.to_thread(ask, keys, p.Submit(spec=spec), 10)
        assert isinstance(submitted, p.Submitted)
        reply = await asyncio.to_thread(ask, keys, p.StatusRequest(), 10)
        assert isinstance(reply, p.StatusReply) and [t.task_id for t in reply.tasks] == [submitted.task_id]

        with pytest.raises(ManagerUnreachable):  # unknown client key: the handshake is refused
            await asyncio.to_thread(ask, stranger, p.Submit(spec=spec), 1.0)
        wrong_server = load_client_keys(keys)
        wrong_server = type(wrong_server)(
            public=wrong_server.public, secret=wrong_server.secret, server=load_client_keys(stranger).server
        )

        def ask_wrong_server() -> p.ControlReply:
            with ControlClient(endpoints.control, timeout_s=1.0, curve=wrong_server) as client:
                return client.request(p.StatusRequest())

        with pytest.raises(ManagerUnreachable):  # a client that does not know the server's key
            await asyncio.to_thread(ask_wrong_server)
        assert len(manager.tasks) == 1


def test_cli_submit_and_status_over_curve_tcp(runtime_dir: Path) -> None:
    keys = runtime_dir / "keys"
    assert subprocess.run(freeride_cmd("keys", "--keys-dir", str(keys)), check=False, timeout=60).returncode == 0
    tcp = f"127.0.0.1:{_free_port_pair()}"
    common = ["--runtime-dir", str(runtime_dir), "--tcp", tcp, "--keys-dir", str(keys)]
    proc = subprocess.Popen(freeride_cmd("serve", *common), start_new_session=True)
    try:
        poll(lambda: (runtime_dir / "workers").exists(), 30, "the manager's sockets")
        sub = subprocess.run(
            freeride_cmd("submit", *common, "_tasks:SpinSteps"), capture_output=True, text=True, timeout=60, check=False
        )
        assert sub.returncode == 0 and "task 1 submitted" in sub.stdout, sub.stderr
        st = subprocess.run(
            freeride_cmd("status", *common, "--json"), capture_output=True, text=True, timeout=60, check=False
        )
        assert st.returncode == 0 and '"task_id":1' in st.stdout, st.stderr
        without = subprocess.run(
            freeride_cmd("status", *common[:4], "--keys-dir", str(runtime_dir / "none")),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert without.returncode == 2 and "freeride keys" in without.stderr
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- peer credentials on ipc -------------------------------------------------------------------


@as_root
@pytest.mark.skipif(not _others_can_run_python(), reason="uid 65534 cannot run this interpreter")
def test_another_uid_gets_no_answer_on_ipc_even_through_an_open_dir(runtime_dir: Path) -> None:
    with serving(runtime_dir):
        # as if the user had opened the directory and the socket to everyone
        os.chmod(runtime_dir, 0o711)
        os.chmod(runtime_dir / "control", 0o777)
        done = subprocess.run(
            freeride_cmd("status", "--runtime-dir", str(runtime_dir), "--timeout", "1"),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            user=NOBODY,
            cwd="/",
        )
        assert done.returncode == 3, done.stderr  # ManagerUnreachable: the ZAP handler refused uid 65534
        assert status(runtime_dir).uptime_ns > 0  # the manager's own user still gets in


async def test_the_peer_uid_check_is_consulted_on_ipc(runtime_dir: Path) -> None:
    """A handler that expects another uid never lets this process's own client in; one that expects ours does."""
    for expected, answered in ((os.getuid(), True), (os.getuid() + 1, False)):
        endpoint = f"ipc://{runtime_dir}/control-{expected}"
        ctx = new_async_context()
        zap = ZapHandler(ctx, uid=expected)
        server = ControlServer(ctx, endpoint)

        async def answer(server: ControlServer = server) -> None:
            ident, _ = await server.recv()
            server.reply_nowait(ident, p.Rejected(reason="hello"))

        def ask(timeout_s: float, endpoint: str = endpoint) -> p.ControlReply:
            with ControlClient(endpoint, timeout_s=timeout_s) as client:
                return client.request(p.StatusRequest())

        try:
            async with asyncio.TaskGroup() as tg:
                served = tg.create_task(zap.serve(), name="test-zap")
                answering = tg.create_task(answer(), name="test-answer")
                if answered:
                    assert isinstance(await asyncio.to_thread(ask, 10.0), p.Rejected)
                else:
                    with pytest.raises(ManagerUnreachable):
                        await asyncio.to_thread(ask, 1.0)
                    assert zap.refused >= 1
                served.cancel()
                answering.cancel()
        finally:
            server.close()
            zap.close()
            ctx.term()


def test_a_request_that_cannot_be_sent_gives_up_at_its_deadline(runtime_dir: Path) -> None:
    """A send has the request's deadline too (SNDTIMEO) and ends as ManagerUnreachable.

    After a refused handshake libzmq may hold no pipe to queue a request on: the suite once hung for
    good in ``send`` in the peer-uid test above. When that happens is a matter of timing, so the
    refusal is stood in for here by a socket whose send times out.
    """
    endpoint = f"ipc://{runtime_dir}/control-unsent"
    with _trap(runtime_dir / "control-unsent"), ControlClient(endpoint, timeout_s=1.5) as client:
        sock = client._sock
        assert sock is not None and sock.getsockopt(zmq.SNDTIMEO) == 1500

        class Refusing:
            def send(self, frame: bytes) -> None:
                raise zmq.Again()

            def __getattr__(self, name: str) -> object:
                return getattr(sock, name)

        client._sock = Refusing()  # type: ignore[assignment]
        try:
            with pytest.raises(ManagerUnreachable, match=r"took a request .* within 1\.5s"):
                client.request(p.StatusRequest())
        finally:
            client._sock = sock


# -- (a') what clients connect to ---------------------------------------------------------


@contextlib.contextmanager
def _trap(path: Path, kind: int = zmq.ROUTER) -> Iterator[zmq.Socket[bytes]]:
    """A socket bound at ``path`` as a planter would bind it, to see whether a client talks to it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    trap = ctx.socket(kind)
    trap.bind(f"ipc://{path}")
    try:
        yield trap
    finally:
        trap.close(0)
        ctx.term()


_CLIENT_COMMANDS = [
    pytest.param(["submit", "--imperative", "--", "true"], id="submit"),
    pytest.param(["status"], id="status"),
    pytest.param(["cancel", "1"], id="cancel"),
]
"""Each client command, as a user types it: ``submit --imperative`` carries the caller's environment."""


@as_root
@pytest.mark.parametrize("command", _CLIENT_COMMANDS)
def test_a_client_tells_a_socket_planted_in_another_users_dir_nothing(runtime_dir: Path, command: list[str]) -> None:
    planted = runtime_dir / "planted"
    planted.mkdir(mode=0o700)
    with _trap(planted / "control") as trap:
        os.chown(planted, NOBODY, NOBODY)
        env = {**os.environ, "SECRET_FOR_THE_TRAP": "s3cr3t"}
        cmd = freeride_cmd(command[0], "--runtime-dir", str(planted), *command[1:])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 2, done
        assert f"is owned by uid {NOBODY}, not you" in done.stderr, done.stderr
        assert not trap.poll(500), "the planted socket received a request"


@as_root
@pytest.mark.parametrize("command", _CLIENT_COMMANDS)
def test_a_client_tells_a_socket_another_user_planted_in_its_own_dir_nothing(
    runtime_dir: Path, command: list[str]
) -> None:
    # the directory is ours and private; the socket in it was bound (or chowned) by someone else
    ours = runtime_dir / "ours"
    ours.mkdir(mode=0o700)
    with _trap(ours / "control") as trap:
        os.chown(ours / "control", NOBODY, NOBODY)
        cmd = freeride_cmd(command[0], "--runtime-dir", str(ours), *command[1:])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done
        assert f"socket {ours / 'control'} is owned by uid {NOBODY}, not you" in done.stderr, done.stderr
        assert not trap.poll(500), "the planted socket received a request"


def test_a_runtime_dir_whose_parent_others_may_write_is_refused(runtime_dir: Path) -> None:
    shared = runtime_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: anyone may rename what is in it
    inner = shared / "rt"
    inner.mkdir(mode=0o700)
    (inner / "control").touch()
    done = subprocess.run(freeride_cmd("status", "--runtime-dir", str(inner)), capture_output=True, text=True)
    assert done.returncode == 2, done
    assert f"its parent {shared} is writable by others (mode 0777, no sticky bit)" in done.stderr, done.stderr
    assert _serve_fails("--runtime-dir", str(inner)).returncode == 2


@as_root
def test_launch_beside_a_planted_runtime_dir_trains_without_freeride(runtime_dir: Path) -> None:
    planted = runtime_dir / "planted"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    job = [
        sys.executable,
        "-c",
        "import os; print('trained', sorted(k for k in os.environ if k.startswith('FREERIDE_')))",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_")}
    cmd = freeride_cmd("launch", "--runtime-dir", str(planted), "--", *job)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trained []"  # no hooks pointed at the planted dir
    assert "freeride: no manager:" in done.stderr and "training runs without FreeRide" in done.stderr
    assert not (planted / "serve.lock").exists()


@as_root
def test_cluster_join_tells_a_socket_planted_in_another_users_dir_nothing(runtime_dir: Path) -> None:
    planted = runtime_dir / "planted"
    planted.mkdir(mode=0o700)
    with _trap(planted / "control") as trap:
        os.chown(planted, NOBODY, NOBODY)
        cmd = freeride_cmd("cluster", "join", "--address", "127.0.0.1:1", "--runtime-dir", str(planted))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done
        assert f"is owned by uid {NOBODY}, not you" in done.stderr, done.stderr
        assert not trap.poll(500), "the planted socket received a request"


@as_root
def test_a_ranks_emitter_tells_a_dir_planted_after_it_started_nothing(runtime_dir: Path) -> None:
    """The rank starts before any manager (no runtime dir yet); another user then makes the dir and listens."""
    planted = runtime_dir / "later"
    emitter = EventEmitter(f"ipc://{planted}/events")
    hello = p.Hello(protocol_version=p.PROTOCOL_VERSION, rank=0, stage=0, num_stages=2, device="cpu:0",
                    framework="sim", pid=os.getpid())  # fmt: skip
    try:
        assert not emitter.emit(hello)
        planted.mkdir(mode=0o700)
        with _trap(planted / "events", zmq.PULL) as trap:
            os.chown(planted, NOBODY, NOBODY)
            # libzmq retries a refused ipc connect every 100 ms: give it many chances to reach the trap
            for _ in range(30):
                emitter.emit(hello)
                if trap.poll(50):
                    break
            assert not trap.poll(200), "the planted socket received the rank's events"
    finally:
        emitter.close()


@as_root
def test_a_rank_publishes_no_bubbles_in_a_dir_another_user_owns(runtime_dir: Path) -> None:
    planted = runtime_dir / "planted"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    publisher = BubblePublisher(f"ipc://{planted}/bubbles-0")
    assert not publisher.bound
    assert not (planted / "bubbles-0").exists()
    publisher.close()
