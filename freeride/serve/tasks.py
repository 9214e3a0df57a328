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
from typing import TYPE_CHECKING

from freeride import protocol as p
from freeride.transport import worker_identity

if TYPE_CHECKING:
    from freeride.host.cgroup import TaskCgroup
    from freeride.serve.runners import Runner

__all__ = ["BadTransition", "TaskRecord", "restart_delay_s", "spawn_worker", "stop_process", "task_name"]

logger = logging.getLogger(__name__)


def task_name(spec: p.TaskSpec) -> str:
    """Stable name of a task: the user's, else class or program plus an options digest.

    Checkpoints are kept under this name, so submitting the same task again
    resumes it.
    """
    if spec.name:
        base = spec.name
    else:
        what: tuple[str, list[str], list[tuple[str, object]]]
        if isinstance(spec, p.IterativeSpec):
            head, what = spec.target.rpartition(":")[2], (spec.target, [], sorted(spec.options.items()))
        else:
            head, what = Path(spec.argv[0]).name, ("", spec.argv, [])
        digest = hashlib.sha1(repr(what).encode()).hexdigest()
        base = f"{head}-{digest[:8]}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", base)[:80]


_TRANSITIONS: dict[p.TaskState, frozenset[p.TaskState]] = {
    "pending": frozenset({"starting", "failed", "cancelled"}),
    "starting": frozenset({"starting", "running", "finished", "failed", "cancelled"}),
    "running": frozenset({"starting", "finished", "failed", "cancelled"}),
    "finished": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
}
"""Every state change a task may make; anything else is a bug (:class:`BadTransition`)."""


class BadTransition(RuntimeError):
    """A task was asked to make a state change the table does not allow."""


@dataclass(slots=True, eq=False)
class TaskRecord:
    """What the manager knows about one submitted side task.

    Written only by the :class:`~freeride.serve.supervisor.Supervisor`, and its
    state only through the transition methods below (checked against
    :data:`_TRANSITIONS`). The scheduler reads it.
    """

    task_id: int
    spec: p.TaskSpec
    name: str
    checkpoint_path: Path
    state: p.TaskState = "pending"
    device: str = ""
    runner: Runner | None = None
    """How grants reach the task's worker or program, while one exists."""
    runnable: bool = False
    """Set up and parked, ready for a grant."""
    estimate_ns: int = -1
    steps: int = 0
    busy_ns: int = 0
    restarts: int = 0
    restart_reason: str = ""
    """Why the task last restarted (its error then)."""
    lost_steps: int = 0
    """Steps done after the checkpoint a restart resumed from: lost, and done again."""
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""
    stopping: bool = False
    """A stop was requested; the coming exit is not a crash."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the task reaches a final state."""
    device_memory: int = -1
    """What NVML last saw the task's process use."""
    hangs: int = 0
    """Steps found hung (each killed the worker; the task restarted from its checkpoint)."""
    hang_checkpoint: int = -2
    """``checkpointed_steps`` when a step of it was last found hung (-2: never)."""
    slow: bool = False
    """A step of it was found too slow for its bubble: its overruns are frozen at once (see
    :mod:`freeride.serve.slowsteps`)."""
    backoff_s: float = 0.0
    """Delay before the latest restart."""
    checkpointed_steps: int = -1
    checkpoint_error: str = ""
    max_loss_steps: int = 0
    max_loss_ns: int = 0
    memory_cap: int = -1
    memory_cap_by: str = ""
    cgroup: TaskCgroup | None = None
    """The cgroup of the task's worker, while it runs (None where cgroups are not to be had)."""
    sm_share: int = -1
    """Percent of the GPU's SMs the task's process may occupy under MPS (-1: not capped)."""
    moving_to: str = ""
    """The device the task is moving to: its worker was asked to checkpoint and stop ("" otherwise)."""
    moves: int = 0
    moved_ns: int = 0
    """When the task last began a move (monotonic ns; 0 never)."""
    traceback: str = ""
    """The last lines of the traceback behind ``error``."""
    final: bool = False
    """The task failed where a restart cannot help (its ``__init__`` or ``setup`` raised)."""
    waiting: bool = False
    """The worker awaits the task's own input (it gives bubbles back meanwhile)."""
    estimates: dict[str, int] = field(default_factory=dict)
    """The worker's step-time estimate per step kind, as last reported."""
    packs: bool = False
    """The task picks a piece that fits what is left of a bubble: its whole step's estimate need not fit."""
    pending_reason: str = ""
    """Why a pending task has no device yet."""

    # -- views ------------------------------------------------------------------

    @property
    def ident(self) -> bytes:
        return worker_identity(self.task_id)

    @property
    def pid(self) -> int:
        return self.runner.pid if self.runner is not None else 0

    @property
    def alive(self) -> bool:
        """Whether a worker process or program exists for the task."""
        return self.runner is not None and self.runner.alive

    @property
    def terminal(self) -> bool:
        return self.state in p.TERMINAL_STATES

    @property
    def active(self) -> bool:
        """Placed and holding (or about to hold) memory on its device."""
        return self.state in ("starting", "running")

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
            restart_reason=self.restart_reason,
            lost_steps=self.lost_steps,
            metrics=dict(self.metrics),
            error=self.error,
            pid=self.pid,
            device_memory=self.device_memory,
            hangs=self.hangs,
            backoff_s=self.backoff_s,
            checkpointed_steps=self.checkpointed_steps,
            checkpoint_error=self.checkpoint_error,
            max_loss_steps=self.max_loss_steps,
            max_loss_ns=self.max_loss_ns,
            memory_cap=self.memory_cap,
            memory_cap_by=self.memory_cap_by,
            sm_share=self.sm_share,
            fill=self.fill,
            moves=self.moves,
            traceback=self.traceback,
            estimates=dict(self.estimates),
            pending_reason=self.pending_reason if self.state == "pending" else "",
            waiting=self.waiting and self.state == "running",
        )

    # -- transitions (the supervisor's) -------------------------------------------

    def _go(self, state: p.TaskState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise BadTransition(f"task {self.task_id} ({self.name}): {self.state} -> {state}")
        self.state = state
        if state != "running":
            self.runnable = False
        if state in p.TERMINAL_STATES:
            self.done.set()

    def place(self, device: str) -> None:
        """Placed on ``device``; its worker or program is about to start."""
        self.device, self.pending_reason = device, ""
        self._go("starting")

    def move(self, device: str, now_ns: int) -> None:
        """To move to ``device``: its worker checkpoints and stops, then resumes there (see :meth:`exited`)."""
        self.moving_to, self.moved_ns = device, now_ns
        self.runnable = False

    @property
    def fill(self) -> bool:
        """A filler: it takes a bubble only once the device's other tasks gave it back (iterative tasks only)."""
        return isinstance(self.spec, p.IterativeSpec) and self.spec.fill

    def ready(self, *, estimate_ns: int = -1, steps: int = 0, packs: bool = False) -> None:
        """Set up and parked: grants may come (``packs``: the task fits smaller pieces into what is left).

        An iterative task's worker says which step it resumes from (its checkpoint's): what was
        done after that checkpoint, before a crash, is counted as lost and done again.
        """
        self._go("running")
        self.runnable = True
        if isinstance(self.spec, p.IterativeSpec):
            self.lost_steps += max(0, self.steps - steps)
            self.steps = steps
        else:
            self.steps = max(self.steps, steps)
        self.estimate_ns, self.packs = estimate_ns, packs

    def park(self) -> None:
        """No more grants for now (the process is gone or going)."""
        self.runnable = False

    def no_restart(self) -> None:
        """The task failed where a restart cannot help: its exit fails it for good."""
        self.final = True

    def request_stop(self) -> None:
        """A stop was asked for: the coming exit is not a crash."""
        self.stopping = True
        self.runnable = False

    def finish(self) -> None:
        self._go("finished")

    def cancel(self) -> None:
        self._go("cancelled")

    def fail(self, error: str) -> None:
        self.error = error
        self._go("failed")

    def exited(self, code: int) -> bool:
        """The worker or program exited with ``code``; returns whether to restart it.

        A stop that was asked for ends as cancelled, a finish reported by the task
        (or a program's exit 0) as finished, and a crash restarts the task from its
        checkpoint until ``max_restarts`` is spent.
        """
        self.runner = None
        self.runnable = False
        if self.state in p.TERMINAL_STATES:
            return False
        if code == 0 and isinstance(self.spec, p.ProgramSpec) and not self.stopping:
            self.finish()
            return False
        if self.stopping:
            self.cancel()
            return False
        if self.moving_to:  # resumes from its checkpoint on the new device: not a crash
            self.device, self.moving_to = self.moving_to, ""
            self.moves += 1
            self._go("starting")
            return True
        self.error = self.error or f"worker exited with code {code}"
        if self.final or self.restarts >= self.spec.max_restarts:
            self.fail(self.error)
            return False
        self.restarts += 1
        # why it restarts, not an error of the task that runs from now on (nor of its next exit)
        self.restart_reason, self.error = self.error, ""
        self._go("starting")
        return True

    def account(self, done: p.GrantDone) -> None:
        """What a grant's report says of the task: steps, busy time, the next step's estimate."""
        self.estimate_ns = done.step_estimate_ns
        # absolute when the worker counts (a Progress may have overtaken this report)
        steps = max(self.steps, done.total_steps) if done.total_steps >= 0 else self.steps + done.steps
        # sums of what workers report stop at the wire's bound (a hostile worker could overflow them)
        self.steps = min(steps, p.I64_MAX)
        self.busy_ns = min(self.busy_ns + done.busy_ns, p.I64_MAX)


def restart_delay_s(restarts: int, *, base_s: float, max_s: float) -> float:
    """Delay before restart number ``restarts`` (1-based): ``base_s`` doubling per restart, at most ``max_s``.

    A task that crashes at once must not spin: each restart costs a process
    start (and for a GPU task, a CUDA context) on a node that trains.
    """
    if restarts <= 0:
        return 0.0
    return min(max_s, base_s * 2.0 ** min(restarts - 1, 62))


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
    workdir: Path | None = None,
) -> asyncio.subprocess.Process:
    """Start the worker process of an iterative task, in its own session.

    The worker runs in ``workdir`` (default ``STATE_DIR/tasks/NAME``, beside
    ``log_dir``) under ``python -P``: nothing is imported from the manager's
    working directory or the worker's own, only from ``PYTHONPATH`` and the
    installed packages (a ``uvloop.py`` planted where ``serve`` was started
    never runs).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    cwd = workdir if workdir is not None else log_dir.parent / "tasks" / record.name
    cwd.mkdir(parents=True, exist_ok=True)
    env = _worker_env(os.environ, record.device, cpu_affinity)
    if extra_env:
        env.update(extra_env)
    log = open(log_dir / f"task-{record.task_id}-{record.name}.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        return await asyncio.create_subprocess_exec(
            python,
            "-P",  # no working directory on sys.path (Python >= 3.11)
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
            cwd=cwd,
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
