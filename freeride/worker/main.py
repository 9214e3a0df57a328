"""The process that runs one iterative side task: ``python -m freeride.worker``.

The worker connects to the manager, receives its :class:`~freeride.protocol.Assign`,
pins itself to the cores of its device, builds the task, restores its
checkpoint and then runs the task's coroutine. The task's ``gate.step()`` is
where the worker talks to the manager: it parks until a grant arrives, lets a
step start only if the step's estimated duration fits before the grant's
deadline minus the margin, and gives the grant back (with what it did) when
the next step no longer fits or the bubble ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import sys
import time
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from freeride import protocol as p
from freeride._procutil import bind_to_parent
from freeride.sidetask import IterativeTask, StepEstimates, TaskContext, TaskStopped
from freeride.transport import BadFrame, WorkerLink, new_async_context

__all__ = ["GrantGate", "load_target", "main"]

logger = logging.getLogger(__name__)

_PROGRESS_EVERY_NS = 250_000_000

GiveBackReason = Literal["no_fit", "revoked", "expired", "finished", "stopping"]


def load_target(target: str) -> type[IterativeTask]:
    """Import ``module:Class`` (or a catalog name) and check it is an :class:`IterativeTask`."""
    from sidetasks import resolve

    module_name, _, cls_name = resolve(target).partition(":")
    obj = getattr(importlib.import_module(module_name), cls_name)
    if not (isinstance(obj, type) and issubclass(obj, IterativeTask)):
        raise TypeError(f"{target} is not a subclass of freeride.IterativeTask")
    return obj


def _save_checkpoint(task: IterativeTask, path: Path, steps: int) -> bool:
    state = task.state_dict()
    if not state:
        return False
    import torch  # only tasks with state pay for the import

    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"steps": steps, "state": state}, tmp)
    os.replace(tmp, path)  # atomic: a crash mid-save keeps the previous checkpoint
    return True


def _load_checkpoint(task: IterativeTask, path: Path) -> int:
    if not path.is_file():
        return 0
    import torch

    saved = torch.load(path, weights_only=False)
    task.load_state_dict(saved["state"])
    return int(saved["steps"])


class _RunDelay:
    """How long this thread has waited for a CPU while runnable (Linux schedstat), in ns.

    A side task runs at the lowest priority on its stage's core: when the
    stage wakes up mid-step, the step waits until the stage blocks again.
    That wait says nothing about what the step costs, so it is taken out of
    the step times the estimate learns from (never out of the time reported
    as used).
    """

    def __init__(self) -> None:
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = -1

    def ns(self) -> int:
        if self._fd < 0:
            return 0
        try:
            return int(os.pread(self._fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class GrantGate:
    """The :class:`~freeride.sidetask.StepGate` of a task run by the manager."""

    def __init__(self, link: WorkerLink, assign: p.Assign, task: IterativeTask, steps: int) -> None:
        self._link = link
        self._assign = assign
        self._task = task
        self._steps = steps
        hint = assign.spec.step_time_ns
        if hint < 0 and task.step_time > 0:
            hint = int(task.step_time * 1e9)
        self.estimates = StepEstimates(hint)
        self._run_delay = _RunDelay()
        self._kind = task.step_kind()
        """The kind of the step waiting to start (or of the next one)."""
        self._grant: p.Grant | None = None
        self._revoked = False
        self._stop: str | None = None
        # what the current grant has seen
        self._g_steps = 0
        self._g_busy = 0
        self._g_first = -1
        self._g_overrun = 0
        self._g_last_end = 0
        self._last_progress = 0
        self._last_checkpoint = time.monotonic_ns()
        self._checkpoint_ns = -1

    @property
    def steps(self) -> int:
        return self._steps

    def _handle(self, msg: p.ManagerToWorker | BadFrame) -> None:
        match msg:
            case p.Grant():
                if self._grant is not None:
                    self._give_back("expired")
                self._grant, self._revoked = msg, False
            case p.Revoke(grant_id=gid):
                if self._grant is not None and self._grant.grant_id == gid:
                    self._revoked = True
            case p.Stop(reason=reason):
                self._stop = reason
            case p.Assign():
                logger.warning("[worker] ignoring a second Assign")
            case BadFrame(reason=reason):
                logger.warning("[worker] rejected a frame from the manager: %s", reason)

    def _give_back(self, reason: GiveBackReason) -> None:
        grant = self._grant
        if grant is None:
            return
        self._link.send_nowait(
            p.GrantDone(
                task_id=self._assign.task_id,
                grant_id=grant.grant_id,
                steps=self._g_steps,
                busy_ns=self._g_busy,
                first_step_delay_ns=self._g_first,
                overrun_ns=self._g_overrun,
                reason=reason,
                step_estimate_ns=self.estimate_ns,
                last_step_end_ns=self._g_last_end,
                first_step_ns=grant.bubble_t_ns + self._g_first if self._g_first >= 0 else 0,
                total_steps=self._steps,
            )
        )
        self._grant = None
        self._g_steps = self._g_busy = self._g_overrun = self._g_last_end = 0
        self._g_first = -1

    def _fits(self, now: int, need_ns: int) -> bool:
        grant = self._grant
        if grant is None or self._revoked:
            return False
        if need_ns < 0 or grant.probe:  # unknown or stale: one step, at the start of a grant still open
            return self._g_steps == 0 and now + self._assign.margin_ns < grant.deadline_ns
        return now + need_ns + self._assign.margin_ns <= grant.deadline_ns

    def _progress(self, now: int) -> None:
        if now - self._last_progress >= _PROGRESS_EVERY_NS:
            self._last_progress = now
            self._link.send_nowait(
                p.Progress(task_id=self._assign.task_id, steps=self._steps, metrics=self._task.metrics())
            )

    def checkpoint(self) -> None:
        """Save the task's state now.

        Periodic checkpoints run inside grants, and only when the last one's
        duration fits; this call itself does not check.
        """
        t0 = time.monotonic_ns()
        path = Path(self._assign.checkpoint_path)
        if _save_checkpoint(self._task, path, self._steps):
            self._link.send_nowait(p.Checkpointed(task_id=self._assign.task_id, steps=self._steps, path=str(path)))
        self._last_checkpoint = time.monotonic_ns()
        self._checkpoint_ns = self._last_checkpoint - t0

    async def _wait_for_fit(self) -> None:
        while True:
            while (msg := self._link.recv_nowait()) is not None:
                self._handle(msg)
            if self._stop is not None:
                self._give_back("stopping")
                raise TaskStopped(self._stop)
            now = time.monotonic_ns()
            due = now - self._last_checkpoint >= self._assign.checkpoint_every_ns
            if due and self._checkpoint_ns >= 0 and self._fits(now, self._checkpoint_ns):
                self._g_busy += self._timed(self.checkpoint)
                continue
            if self._fits(now, self.estimate_ns):
                return
            if self._grant is not None:
                self._give_back("revoked" if self._revoked else "no_fit")
            self._progress(now)
            self._handle(await self._link.recv())

    def _timed(self, fn: Any) -> int:
        t0 = time.monotonic_ns()
        fn()
        t1 = time.monotonic_ns()
        self._note_end(t1)
        return t1 - t0

    def _note_end(self, end: int) -> None:
        self._g_last_end = end
        grant = self._grant
        if grant is not None and end > grant.deadline_ns:
            self._g_overrun = end - grant.deadline_ns

    @property
    def estimate_ns(self) -> int:
        """The running estimate of the pending step's kind (what the manager must fit)."""
        return self.estimates.estimate_ns(self._kind)

    @asynccontextmanager
    async def step(self, kind: str = "") -> AsyncIterator[None]:
        self._kind = kind
        while True:
            await self._wait_for_fit()
            delay0 = self._run_delay.ns()
            t0 = time.monotonic_ns()
            # checked again with the step's own start time: the worker runs at the lowest
            # priority and may have been preempted since the fit was decided
            if self._fits(t0, self.estimate_ns):
                break
        if self._g_steps == 0 and self._grant is not None:
            self._g_first = t0 - self._grant.bubble_t_ns
        yield
        t1 = time.monotonic_ns()
        self.estimates.observe(kind, max(1, t1 - t0 - (self._run_delay.ns() - delay0)))
        self._kind = self._task.step_kind()
        self._steps += 1
        self._g_steps += 1
        self._g_busy += t1 - t0
        self._note_end(t1)

    def finish(self, reason: GiveBackReason) -> None:
        self._give_back(reason)
        self._run_delay.close()


def _lower_cpu_priority() -> None:
    """Side tasks yield the CPU to everything else: training ranks, their data loaders, the manager.

    The lowest nice level is the host-side twin of a low MPS client priority:
    a training thread (or the manager) that wakes up preempts the side task at
    once instead of after the scheduler's wake-up granularity. (SCHED_IDLE
    would go further but lets any unrelated busy process starve a side task
    even inside its bubbles.)
    """
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 19)


def _cap_torch_cuda_memory() -> None:
    """Keep PyTorch's caching allocator just under the MPS cap (set by the manager)."""
    fraction = os.environ.get("FREERIDE_TORCH_MEMORY_FRACTION")
    if not fraction:
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(fraction), 0)


def _vm_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _cap_address_space(limit_bytes: int) -> None:
    """On a CPU device, cap what the task can still allocate to its declared peak.

    Set after setup, relative to what is mapped then: interpreter and library
    mappings (a large share of a torch process's address space) are not the
    task's memory. An allocation past the cap raises ``MemoryError``, which is
    reported as the task's failure. Never used on CUDA devices, where the
    driver reserves a huge virtual range.
    """
    import resource

    size, rss = _vm_kb("VmSize") * 1024, _vm_kb("VmRSS") * 1024
    cap = size + max(0, limit_bytes - rss) + (64 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    logger.info("[worker] address space capped at %d MiB (peak %d MiB declared)", cap >> 20, limit_bytes >> 20)


def _torch_device(device: str) -> str:
    kind, _, _ = device.partition(":")
    return "cuda:0" if kind == "cuda" else "cpu"  # CUDA_VISIBLE_DEVICES leaves one GPU


async def _run(endpoint: str, task_id: int) -> int:
    ctx = new_async_context()
    link = WorkerLink(ctx, endpoint, task_id)
    try:
        link.send_nowait(p.WorkerReady(protocol_version=p.PROTOCOL_VERSION, task_id=task_id, pid=os.getpid()))
        async with asyncio.timeout(60):
            msg = await link.recv()
            while not isinstance(msg, p.Assign):
                if isinstance(msg, p.Stop):
                    return 0
                msg = await link.recv()
        return await _serve(link, msg)
    finally:
        link.close()
        ctx.term()


async def _serve(link: WorkerLink, assign: p.Assign) -> int:
    if assign.cpu_affinity:
        os.sched_setaffinity(0, assign.cpu_affinity)
    _lower_cpu_priority()
    _cap_torch_cuda_memory()
    task: IterativeTask | None = None
    try:
        cls = load_target(assign.spec.target)
        task = cls(**assign.spec.options)
        steps = _load_checkpoint(task, Path(assign.checkpoint_path))
        workdir = Path(assign.workdir or ".")
        tctx = TaskContext(
            task_id=assign.task_id,
            device=assign.device,
            torch_device=_torch_device(assign.device),
            workdir=workdir,
        )
        await task.setup(tctx)
        if assign.memory_limit > 0 and assign.device.startswith("cpu"):
            _cap_address_space(assign.memory_limit)
        gate = GrantGate(link, assign, task, steps)
        if task.state_dict():
            import torch  # noqa: F401 - load the serializer before timing a checkpoint
        gate.checkpoint()  # before any bubble: measures what a checkpoint costs
        link.send_nowait(
            p.WorkerReady(
                protocol_version=p.PROTOCOL_VERSION,
                task_id=assign.task_id,
                pid=os.getpid(),
                set_up=True,
                step_estimate_ns=gate.estimate_ns,
                steps=steps,
            )
        )
        try:
            await task.run(gate)
        except TaskStopped as stop:
            gate.checkpoint()
            link.send_nowait(p.Progress(task_id=assign.task_id, steps=gate.steps, metrics=task.metrics()))
            logger.info("[worker] task %d stopped (%s) at step %d", assign.task_id, stop, gate.steps)
            return 0
        gate.finish("finished")
        gate.checkpoint()
        link.send_nowait(p.TaskFinished(task_id=assign.task_id, steps=gate.steps, metrics=task.metrics()))
        return 0
    except Exception as exc:
        link.send_nowait(
            p.TaskFailed(task_id=assign.task_id, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        )
        return 1
    finally:
        if task is not None:
            await task.teardown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freeride.worker", description="FreeRide side-task worker")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--task-id", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    bind_to_parent(f"freeride-task{args.task_id}")  # never outlive the manager
    import uvloop

    return uvloop.run(_run(args.endpoint, args.task_id))


if __name__ == "__main__":
    sys.exit(main())
