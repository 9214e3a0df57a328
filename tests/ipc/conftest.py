"""Fixtures for tests with real processes and sockets.

Every fixture that starts a process also reaps it. Runtime directories are
short (ipc:// socket paths must stay under ~100 bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from freeride import protocol as p
from freeride.serve.config import ServeConfig
from freeride.serve.manager import Manager
from freeride.serve.tasks import TaskRecord
from freeride.transport import ControlClient, Endpoints

HERE = Path(__file__).resolve().parent


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _tasks_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes import the test tasks in _tasks.py, and this checkout's code (not an installed one's)."""
    inherited = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(HERE), str(HERE.parents[1]), inherited))))
    monkeypatch.syspath_prepend(str(HERE))


@pytest.fixture
def resumed_steps(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[int]]:
    """The step each worker of a task (by id) said, when ready, it resumes from, in order (in-process managers).

    A restarted worker's is its checkpoint's. Not the record's step count when next polled: the restarted
    worker may have stepped since.
    """
    resumed: dict[int, list[int]] = {}
    ready = TaskRecord.ready

    def said_ready(record: TaskRecord, **said: Any) -> None:
        ready(record, **said)
        resumed.setdefault(record.task_id, []).append(record.steps)  # an iterative task's is set to it

    monkeypatch.setattr(TaskRecord, "ready", said_ready)
    return resumed


async def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` on the event loop until it holds (the state lives in this process)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}") from None


@contextlib.asynccontextmanager
async def running_manager(config: ServeConfig) -> AsyncIterator[Manager]:
    """A manager in this process, serving until the block ends."""
    stop = asyncio.Event()
    async with Manager(config) as mgr:
        runner = asyncio.create_task(mgr.run(stop), name="test-manager")
        await asyncio.sleep(0)
        try:
            yield mgr
        finally:
            stop.set()
            await runner


NO_BUDGET = 0.0
"""``ServeConfig.slowdown_budget`` for tests of what runs in the bubbles: off. The budget backs
harvesting off while the job's measured cost may exceed it; on two shared cores the upper bound
of a simulated pipeline's cost read +0.6 to +1.6 %, and within three minutes a quarter of the
bubbles were granted, so what such a test waits for came late or not at all. The budget has tests of its own
(tests/unit/test_training_cost.py)."""


@pytest.fixture
async def manager(runtime_dir: Path) -> AsyncIterator[Manager]:
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir),
        state_dir=runtime_dir / "state",
        checkpoint_every_s=0.2,
        stop_timeout_s=5,
        slowdown_budget=NO_BUDGET,
    )
    async with running_manager(config) as mgr:
        yield mgr


def freeride_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "freeride.cli", *args]


def as_from_a_terminal(cmd: Sequence[str]) -> list[str]:
    """``cmd`` started with SIGINT at its default, as from a terminal, so that SIGINT stops it.

    Where the suite runs with SIGINT ignored (started in the background by a shell without
    job control), every child inherits that, and Python then raises no KeyboardInterrupt.
    """
    restore = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", restore, *cmd]


def status(runtime_dir: Path, timeout_s: float = 5.0) -> p.StatusReply:
    with ControlClient(Endpoints.ipc(runtime_dir).control, timeout_s=timeout_s) as client:
        reply = client.request(p.StatusRequest())
    assert isinstance(reply, p.StatusReply), reply
    return reply


def poll(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Synchronous twin of :func:`wait_until`, for state in another process."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def submit_spin_steps(runtime_dir: Path, devices: Sequence[str], step_ms: float) -> None:
    """Pin one ``_tasks:SpinSteps`` side task to each device with `freeride submit`, and wait until all run.

    Through the CLI, as a user would, so that the tests using it cover the submit path too.
    """
    for device in devices:
        submitted = subprocess.run(
            freeride_cmd(
                "submit",
                "--runtime-dir",
                str(runtime_dir),
                "_tasks:SpinSteps",
                "--opt",
                f"step_ms={step_ms}",
                "--step-time",
                f"{step_ms}ms",
                "--device",
                device,
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert submitted.returncode == 0, submitted.stderr
    poll(
        lambda: sum(t.state == "running" for t in status(runtime_dir).tasks) == len(devices),
        90,
        f"side tasks set up on all {len(devices)} devices",
    )


@contextlib.contextmanager
def serving(runtime_dir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`freeride serve --runtime-dir DIR ARGS` as a real subprocess, answering; reaped (group killed) afterwards."""
    proc = subprocess.Popen(
        freeride_cmd("serve", "--runtime-dir", str(runtime_dir), *args), start_new_session=True, env=env
    )
    try:
        poll(lambda: (runtime_dir / "control").exists(), 30, "the manager's control socket")
        status(runtime_dir, timeout_s=30)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def served(runtime_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`freeride serve` with fast checkpoints, as a real subprocess."""
    with serving(runtime_dir, "--checkpoint-every", "0.2s") as proc:
        yield proc
