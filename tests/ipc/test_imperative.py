"""ImperativeProcess with real processes and signals."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from freeride.serve.imperative import ImperativeProcess, sync_every_env

HEARTBEAT = struct.Struct("<QQ")

# Busy loop that bumps a counter in a shared 16-byte file: (turns, monotonic_ns).
SPIN = """
import mmap, struct, sys, time
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 16)
pack, now, n = struct.Struct("<QQ").pack_into, time.monotonic_ns, 0
while True:
    n += 1
    pack(m, 0, n, now())
"""

# Starts SPIN in a child (a grandchild of the runner) and spins itself.
PARENT = (
    """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[2]])
print(child.pid, flush=True)
"""
    + SPIN
)

Factory = Callable[..., ImperativeProcess]


def stat_fields(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rfind(")") + 2 :].split()


def state(pid: int) -> str:
    try:
        return stat_fields(pid)[0]
    except FileNotFoundError:
        return "gone"


def cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def group_alive(pgid: int) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = stat_fields(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                alive.append(int(entry.name))
    return alive


async def until(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.001)


class Heartbeat:
    def __init__(self, path: Path) -> None:
        path.write_bytes(bytes(16))
        self.path = path
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 16)

    def read(self) -> tuple[int, int]:
        turns, t_ns = HEARTBEAT.unpack_from(self._map)
        return turns, t_ns

    def close(self) -> None:
        self._map.close()


@pytest.fixture
def heartbeat(tmp_path: Path) -> Iterator[Callable[[str], Heartbeat]]:
    beats: list[Heartbeat] = []

    def make(name: str) -> Heartbeat:
        beats.append(Heartbeat(tmp_path / name))
        return beats[-1]

    yield make
    for beat in beats:
        beat.close()


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[Factory]:
    procs: list[ImperativeProcess] = []

    def make(argv: list[str], **kwargs: object) -> ImperativeProcess:
        kwargs.setdefault("env", dict(os.environ))
        kwargs.setdefault("log_dir", tmp_path / "logs")
        kwargs.setdefault("name", f"p{len(procs)}")
        procs.append(ImperativeProcess(argv, **kwargs))  # type: ignore[arg-type]
        return procs[-1]

    yield make
    for proc in procs:
        if proc.pid > 0:
            await proc.terminate(timeout_s=2.0)


async def warm_up(proc: ImperativeProcess, beat: Heartbeat, bubble_ms: float = 20) -> None:
    """Give the program bubbles until its loop runs (the interpreter starts inside bubbles)."""
    async with asyncio.timeout(30):
        while beat.read()[0] == 0:
            await run_bubbles(proc, 1, bubble_ms)


async def run_bubbles(proc: ImperativeProcess, n: int, bubble_ms: float) -> None:
    for _ in range(n):
        proc.resume(time.monotonic_ns() + int(bubble_ms * 1e6))
        await until(lambda: not proc.running)


async def test_program_runs_only_inside_bubbles(spawn: Factory, heartbeat: Callable[[str], Heartbeat]) -> None:
    beat = heartbeat("hb")
    proc = spawn([sys.executable, "-c", SPIN, str(beat.path)])
    await proc.start()
    # stopped before the program ran: still the launcher, in state T, no heartbeat
    assert state(proc.pid) == "T"
    assert os.readlink(f"/proc/{proc.pid}/exe") == os.path.realpath("/bin/sh")
    assert beat.read() == (0, 0)

    await warm_up(proc, beat)
    await run_bubbles(proc, 20, 5)
    await until(lambda: state(proc.pid) == "T")
    turns, last_ns = beat.read()
    cpu_before = cpu_ns(proc.pid)
    await asyncio.sleep(0.1)  # nothing may happen while stopped: let time pass
    assert beat.read() == (turns, last_ns)
    assert cpu_ns(proc.pid) - cpu_before < 1_000_000
    assert proc.busy_ns >= 20 * 5_000_000
    # every deadline stop was observed
    assert len(proc.stop_latencies_ns) >= 20


async def test_resume_after_deadline_stays_stopped_and_suspend_is_idempotent(
    spawn: Factory, heartbeat: Callable[[str], Heartbeat]
) -> None:
    beat = heartbeat("hb")
    proc = spawn([sys.executable, "-c", SPIN, str(beat.path)], margin_ns=1_000_000)
    await proc.start()
    proc.resume(time.monotonic_ns() + 500_000)  # already inside the margin
    assert not proc.running and state(proc.pid) == "T"

    proc.resume(time.monotonic_ns() + 60_000_000_000)
    assert proc.running
    await until(lambda: beat.read()[0] > 0)
    proc.suspend()
    proc.suspend()
    assert not proc.running
    await until(lambda: state(proc.pid) == "T")
    busy = proc.busy_ns
    proc.suspend()
    assert proc.busy_ns == busy


async def test_deadline_can_be_moved_while_running(spawn: Factory, heartbeat: Callable[[str], Heartbeat]) -> None:
    beat = heartbeat("hb")
    proc = spawn([sys.executable, "-c", SPIN, str(beat.path)])
    await proc.start()
    t0 = time.monotonic_ns()
    proc.resume(t0 + 5_000_000)
    proc.resume(t0 + 200_000_000)  # extends the bubble
    await until(lambda: not proc.running)
    assert time.monotonic_ns() - t0 >= 200_000_000
    proc.resume(time.monotonic_ns() + 60_000_000_000)
    proc.resume(time.monotonic_ns() - 1)  # a deadline in the past stops it now
    assert not proc.running


async def test_grandchildren_are_stopped_and_terminated(
    spawn: Factory, heartbeat: Callable[[str], Heartbeat], tmp_path: Path
) -> None:
    own, child = heartbeat("own"), heartbeat("child")
    proc = spawn([sys.executable, "-c", PARENT, str(own.path), str(child.path), SPIN], name="parent")
    await proc.start()
    proc.resume(time.monotonic_ns() + 60_000_000_000)
    await until(lambda: own.read()[0] > 0 and child.read()[0] > 0)
    proc.suspend()
    members = group_alive(proc.pid)
    assert len(members) == 2
    await until(lambda: all(state(pid) == "T" for pid in members))
    child_turns = child.read()
    await asyncio.sleep(0.05)  # the grandchild must not advance while stopped
    assert child.read() == child_turns

    info = await proc.terminate()
    assert info.signal is not None or info.returncode != 0
    assert group_alive(proc.pid) == []
    assert await proc.terminate() == info  # idempotent


async def test_terminate_kills_a_group_that_ignores_sigterm(spawn: Factory, tmp_path: Path) -> None:
    stubborn = (
        "import signal, subprocess, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', "
        "'import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\nwhile True: time.sleep(1)'])\n"
        "print('ready', flush=True)\n"
        "while True: pass\n"
    )
    proc = spawn([sys.executable, "-c", stubborn], name="stubborn")
    await proc.start()
    proc.resume(time.monotonic_ns() + 60_000_000_000)
    out = tmp_path / "logs" / "stubborn.out"
    await until(lambda: out.exists() and b"ready" in out.read_bytes())
    await until(lambda: len(group_alive(proc.pid)) == 2)
    t0 = time.monotonic()
    info = await proc.terminate(timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.3
    assert info.signal == 9 and info.returncode == -9
    assert group_alive(proc.pid) == []


async def test_leftover_children_are_terminated_after_the_program_exits(spawn: Factory, tmp_path: Path) -> None:
    leaver = (
        "import subprocess, sys\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(1)'])\n"
        "print(c.pid, flush=True)\n"
    )
    proc = spawn([sys.executable, "-c", leaver], name="leaver")
    await proc.start()
    proc.resume(time.monotonic_ns() + 60_000_000_000)
    info = await proc.wait()
    assert info.returncode == 0 and not proc.running
    orphan = int((tmp_path / "logs" / "leaver.out").read_text())
    assert state(orphan) not in ("Z", "gone")
    assert await proc.terminate() == info
    assert state(orphan) in ("Z", "gone")


@pytest.mark.parametrize(
    ("code", "returncode", "sig"),
    [("import sys; sys.exit(3)", 3, None), ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", -11, 11)],
)
async def test_exit_and_crash_are_reported(spawn: Factory, code: str, returncode: int, sig: int | None) -> None:
    proc = spawn([sys.executable, "-c", code])
    await proc.start()
    proc.resume(time.monotonic_ns() + 60_000_000_000)
    info = await proc.wait()
    assert (info.returncode, info.signal) == (returncode, sig)
    assert info.max_rss_kb > 0 and not proc.running and proc.exited
    proc.resume(time.monotonic_ns() + 1_000_000_000)  # a no-op once exited
    assert not proc.running


async def test_missing_command_fails_at_start(spawn: Factory) -> None:
    proc = spawn(["freeride-no-such-command"])
    with pytest.raises(FileNotFoundError, match="freeride-no-such-command"):
        await proc.start()


async def test_memory_cap_fails_only_the_capped_program(
    spawn: Factory, heartbeat: Callable[[str], Heartbeat], tmp_path: Path
) -> None:
    beat = heartbeat("hb")
    hog = spawn(
        [sys.executable, "-c", "x = bytearray(1 << 30)"],
        name="hog",
        memory_limit=256 << 20,
    )
    neighbour = spawn([sys.executable, "-c", "x = bytearray(64 << 20)\n" + SPIN, str(beat.path)], name="nb")
    await hog.start()
    await neighbour.start()
    assert state(hog.pid) == "T"
    hog.resume(time.monotonic_ns() + 60_000_000_000)
    neighbour.resume(time.monotonic_ns() + 60_000_000_000)
    info = await hog.wait()
    assert info.returncode == 1
    assert "MemoryError" in (tmp_path / "logs" / "hog.err").read_text()
    await until(lambda: beat.read()[0] > 0)
    assert neighbour.running and not neighbour.exited


async def test_cpu_affinity_and_log_files(spawn: Factory, tmp_path: Path) -> None:
    code = "import os, sys; print(sorted(os.sched_getaffinity(0))); print('err', file=sys.stderr)"
    proc = spawn([sys.executable, "-c", code], name="aff", cpu_affinity=[0])
    await proc.start()
    proc.resume(time.monotonic_ns() + 60_000_000_000)
    assert (await proc.wait()).returncode == 0
    assert (tmp_path / "logs" / "aff.out").read_text() == "[0]\n"
    assert (tmp_path / "logs" / "aff.err").read_text() == "err\n"


async def test_stop_latency_is_recorded_with_generous_bounds(
    spawn: Factory, heartbeat: Callable[[str], Heartbeat]
) -> None:
    beat = heartbeat("hb")
    proc = spawn([sys.executable, "-c", SPIN, str(beat.path)])
    await proc.start()
    await warm_up(proc, beat)
    proc.stop_latencies_ns.clear()
    await run_bubbles(proc, 40, 2)
    samples = sorted(proc.stop_latencies_ns)
    assert len(samples) >= 38
    # real figures come from tools/bench/stop_latency.py; this only catches gross breakage
    assert samples[len(samples) // 2] < 20_000_000


def test_works_under_uvloop(tmp_path: Path) -> None:
    uvloop = pytest.importorskip("uvloop")
    beat = Heartbeat(tmp_path / "hb")

    async def scenario() -> tuple[int, int]:
        proc = ImperativeProcess(
            [sys.executable, "-c", SPIN, str(beat.path)], env=dict(os.environ), log_dir=tmp_path, name="uv"
        )
        await proc.start()
        try:
            await warm_up(proc, beat, 5)
            stops = len(proc.stop_latencies_ns)
        finally:
            info = await proc.terminate()
        return stops, info.returncode

    stops, returncode = uvloop.run(scenario())
    beat.close()
    assert stops >= 1 and returncode == -15


def test_sync_every_env_validates_and_leaves_env_alone_at_zero() -> None:
    env = {"PYTHONPATH": "/x"}
    assert sync_every_env(env, 0) == env
    out = sync_every_env(env, 4)
    assert out["FREERIDE_SYNC_EVERY"] == "4"
    assert out["PYTHONPATH"].endswith(os.pathsep + "/x") and out["PYTHONPATH"] != "/x"
    with pytest.raises(ValueError, match="sync_every"):
        sync_every_env(env, -1)


def test_sync_shim_chains_other_sitecustomize_without_importing_torch(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE'] = 'ran'\n")
    env = sync_every_env({**os.environ, "PYTHONPATH": str(other)}, 2)
    code = "import os, sys; print(os.environ.get('OTHER_SITECUSTOMIZE'), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ran", "False"]


def test_sync_shim_synchronizes_every_k_steps_and_is_inert_on_cpu() -> None:
    code = """
import torch
calls = []
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(7):  # CPU only: the hook must do nothing
    model(torch.randn(1, 2)).sum().backward()
    opt.step()
torch.cuda.is_initialized = lambda: True
torch.cuda.synchronize = lambda *a, **k: calls.append(1)
for _ in range(6):  # steps 8..13: multiples of 3 are 9 and 12
    opt.step()
print(len(calls))
"""
    env = sync_every_env(dict(os.environ), 3)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"


# The runtime can die without calling terminate() (SIGKILL, OOM killer). Its
# programs are in their own sessions, so the kernel's orphaned-group rule does
# not continue or hang them up: without the watchdog a stopped group would stay
# stopped forever, holding its memory.
RUNTIME = """
import asyncio, os, signal, sys, time
from pathlib import Path
from freeride.serve.imperative import ImperativeProcess
own, child, spin, parent, logs = sys.argv[1:]

async def main():
    proc = ImperativeProcess([sys.executable, "-c", parent, own, child, spin], env=dict(os.environ),
                             log_dir=Path(logs), name="orphaned")
    await proc.start()
    proc.resume(time.monotonic_ns() + 60 * 10**9)
    fds = [os.open(p, os.O_RDONLY) for p in (own, child)]
    while any(os.pread(fd, 8, 0) == bytes(8) for fd in fds):
        await asyncio.sleep(0.001)
    proc.suspend()
    print(proc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_programs_do_not_outlive_a_killed_runtime(tmp_path: Path, heartbeat: Callable[[str], Heartbeat]) -> None:
    own, child = heartbeat("own"), heartbeat("child")
    argv = [sys.executable, "-c", RUNTIME, str(own.path), str(child.path), SPIN, PARENT, str(tmp_path)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == -9, out.stderr
    pgid = int(out.stdout)
    try:
        deadline = time.monotonic() + 10
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.005)  # polling with a deadline: the watchdog acts asynchronously
        assert group_alive(pgid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
