"""Imperative programs: setsid children in the program's cgroup, watchdogs reaped, a tight memory cap.

Where this process cannot make cgroups (an unprivileged container, a non-root
user without delegation) a ``setsid`` child escapes its program's SIGSTOP and
SIGKILL and the memory cap falls back to ``RLIMIT_AS`` (loose): those tests are
skipped, saying so.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_until

from freeride import protocol as p
from freeride.host.cgroup import TaskCgroup, cgroups_available
from freeride.serve.config import ServeConfig
from freeride.serve.imperative import ImperativeProcess
from freeride.serve.manager import Manager
from freeride.transport import Endpoints


def _state(pid: int) -> str:
    """The process's state letter; "gone" once it is reaped (a zombie, Z, is dead too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def _memory_cgroups() -> bool:
    group = TaskCgroup.create(f"probe-{os.getpid()}", memory_max=1 << 30)
    if group is None:
        return False
    try:
        return bool(group.memory_by)
    finally:
        group.remove()


needs_cgroups = pytest.mark.skipif(
    not cgroups_available(), reason="no writable cgroup here: a setsid child escapes (documented limit)"
)


@needs_cgroups
async def test_a_setsid_child_is_stopped_and_killed_with_its_program(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    group = TaskCgroup.create(f"setsid-{os.getpid()}")
    script = f"setsid sh -c 'echo $$ > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; while :; do :; done' & wait"
    program = ImperativeProcess(["sh", "-c", script], env=dict(os.environ), log_dir=tmp_path, name="p", cgroup=group)
    await program.start()
    try:
        program.resume(time.monotonic_ns() + 60 * 10**9)
        await wait_until(pid_file.exists, 10, "the setsid child")
        child = int(pid_file.read_text())
        assert os.getpgid(child) != program.pid  # out of the program's process group
        program.suspend()
        await wait_until(lambda: _state(child) == "T", 5, "the child to stop with its program")
        program.resume(time.monotonic_ns() + 60 * 10**9)
        await wait_until(lambda: _state(child) in "RS", 5, "the child to run again")
    finally:
        await program.terminate(timeout_s=1.0)
    await wait_until(lambda: _state(child) in ("Z", "gone"), 5, "the child to be killed with its program")


async def test_no_watchdog_is_left_once_a_program_has_finished(tmp_path: Path) -> None:
    program = ImperativeProcess(["true"], env=dict(os.environ), log_dir=tmp_path, name="t")
    await program.start()
    assert program._watchdog is not None
    watchdog = program._watchdog[0]
    program.resume(time.monotonic_ns() + 60 * 10**9)
    async with asyncio.timeout(10):
        info = await program.wait()
    assert info.returncode == 0
    assert _state(watchdog) == "gone"  # killed and reaped when the program was


@pytest.mark.skipif(not _memory_cgroups(), reason="no memory cgroup here: RLIMIT_AS caps address space, loosely")
async def test_a_program_over_its_declared_peak_fails_near_it(runtime_dir: Path, tmp_path: Path) -> None:
    peak = 200 << 20
    # grows 10 MiB at a time, printing its resident size after each step
    grow = (
        "import sys\nchunks = []\nwhile True:\n    chunks.append(bytearray(10 << 20))\n"
        "    rss = int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "    print(rss, flush=True)\n"
    )
    config = ServeConfig(endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state")
    stop = asyncio.Event()
    async with Manager(config) as manager:
        runner = asyncio.create_task(manager.run(stop), name="test-manager")
        try:
            manager.declare_device("cpu:0", stage=0, spare_memory=4 << 30, cpu_affinity=[0])
            reply = manager.submit(
                p.ProgramSpec(
                    argv=[sys.executable, "-c", grow],
                    device="cpu:0",
                    peak_memory=peak,
                    max_restarts=0,
                )
            )
            assert isinstance(reply, p.Submitted)
            task = manager.tasks[reply.task_id]
            await wait_until(lambda: task.state == "running", 30, "the program to start (stopped)")
            runner_ = task.runner
            assert runner_ is not None
            # one long grant stands in for bubbles: the program runs until the cap ends it
            runner_.grant(
                p.Grant(grant_id=1, bubble_t_ns=time.monotonic_ns(), deadline_ns=time.monotonic_ns() + 60 * 10**9)
            )
            await wait_until(lambda: task.terminal, 60, "the program to be stopped by its cap")
            assert task.state == "failed" and "memory cap" in task.error, task.error
            out = next(config.log_dir.glob(f"task-{reply.task_id}-*.out")).read_text().split()
            assert out and int(out[-1]) <= peak * 1.1, int(out[-1]) >> 20  # stopped near 200 MiB, not 1.2 GiB
        finally:
            stop.set()
            await runner
