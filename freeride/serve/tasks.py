"""Side-task records and the worker processes behind them."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from freeride import protocol as p
from freeride.serve.imperative import ImperativeProcess
from freeride.transport import worker_identity

__all__ = ["TaskRecord", "spawn_worker", "stop_process", "task_name"]

logger = logging.getLogger(__name__)


def task_name(spec: p.TaskSpec) -> str:
    """Stable name of a task: the user's, else class or program plus an options digest.

    Checkpoints are kept under this name, so submitting the same task again
    resumes it.
    """
    if spec.name:
        base = spec.name
    else:
        head = spec.target.rpartition(":")[2] if spec.kind == "iterative" else Path(spec.argv[0]).name
        digest = hashlib.sha1(repr((spec.target, spec.argv, sorted(spec.options.items()))).encode()).hexdigest()
        base = f"{head}-{digest[:8]}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", base)[:80]


@dataclass(slots=True, eq=False)
class TaskRecord:
    """What the manager knows about one submitted side task."""

    task_id: int
    spec: p.TaskSpec
    name: str
    checkpoint_path: Path
    state: p.TaskState = "pending"
    device: str = ""
    process: asyncio.subprocess.Process | None = None
    """Worker process of an iterative task."""
    imperative: ImperativeProcess | None = None
    """The program of an imperative task, while it exists."""
    runnable: bool = False
    """Set up and parked, ready for a grant."""
    estimate_ns: int = -1
    steps: int = 0
    busy_ns: int = 0
    restarts: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""
    stopping: bool = False
    """A stop was requested; the coming exit is not a crash."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the task reaches a final state."""
    device_memory: int = -1
    """What NVML last saw the task's process use."""

    @property
    def ident(self) -> bytes:
        return worker_identity(self.task_id)

    @property
    def pid(self) -> int:
        if self.imperative is not None:
            return max(self.imperative.pid, 0)
        return self.process.pid if self.process is not None else 0

    @property
    def alive(self) -> bool:
        """Whether a worker process or program exists for the task."""
        if self.imperative is not None:
            return not self.imperative.exited
        return self.process is not None and self.process.returncode is None

    def status(self) -> p.TaskStatus:
        return p.TaskStatus(
            task_id=self.task_id,
            name=self.name,
            kind=self.spec.kind,
            state=self.state,
            device=self.device,
            steps=self.steps,
            busy_ns=self.busy_ns,
            restarts=self.restarts,
            metrics=dict(self.metrics),
            error=self.error,
            pid=self.pid,
            device_memory=self.device_memory,
        )


def _worker_env(base: Mapping[str, str], device: str, cpu_affinity: list[int]) -> dict[str, str]:
    env = dict(base)
    threads = str(max(1, len(cpu_affinity) or 1))
    env["OMP_NUM_THREADS"] = threads
    env["MKL_NUM_THREADS"] = threads
    kind, _, index = device.partition(":")
    if kind == "cuda" and index.isdigit():
        env["CUDA_VISIBLE_DEVICES"] = index
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


async def spawn_worker(
    record: TaskRecord,
    *,
    python: str,
    endpoint: str,
    log_dir: Path,
    cpu_affinity: list[int],
    extra_env: Mapping[str, str] | None = None,
) -> asyncio.subprocess.Process:
    """Start the worker process of an iterative task, in its own session."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = _worker_env(os.environ, record.device, cpu_affinity)
    if extra_env:
        env.update(extra_env)
    log = open(log_dir / f"task-{record.task_id}-{record.name}.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        return await asyncio.create_subprocess_exec(
            python,
            "-m",
            "freeride.worker",
            "--endpoint",
            endpoint,
            "--task-id",
            str(record.task_id),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()


async def stop_process(proc: asyncio.subprocess.Process, *, timeout_s: float) -> int:
    """Wait ``timeout_s`` for ``proc`` to exit, then terminate, then kill its group.

    Returns:
        The exit code (negative: killed by that signal).
    """
    if proc.returncode is not None:
        return proc.returncode
    try:
        async with asyncio.timeout(timeout_s):
            return await proc.wait()
    except TimeoutError:
        pass
    for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        logger.warning("[shutdown] worker pid %d did not exit; sending %s", proc.pid, sig.name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            async with asyncio.timeout(grace):
                return await proc.wait()
        except TimeoutError:
            continue
    print(f"freeride: worker pid {proc.pid} survived SIGKILL", file=sys.stderr)
    return proc.returncode if proc.returncode is not None else -9
