"""The worker's :class:`~freeride.sidetask.StepGate`: when a step of a managed task may start.

The task's ``gate.step()`` is where the worker talks to the manager: it parks
until a grant arrives, lets a step start only if the step's estimated duration
fits before the grant's deadline minus the margin (:mod:`freeride.admission`),
and gives the grant back (with what it did) when the next step no longer fits
or the bubble ends.

Every time reading goes through an injected :class:`~freeride.clock.Clock` and
every message through a :class:`GateLink`, so the rule can be driven step by
step in tests without sockets or sleeps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol, assert_never

from freeride import protocol as p
from freeride.admission import fits, room_ns
from freeride.clock import MONOTONIC, Clock
from freeride.sidetask import IterativeTask, StepEstimates, TaskStopped
from freeride.transport import BadFrame
from freeride.worker.checkpoint import state_bytes as state_bytes_of

__all__ = ["GateLink", "GrantGate", "RunDelay", "SaveCheckpoint"]

logger = logging.getLogger(__name__)

_PROGRESS_EVERY_NS = 250_000_000
_RETRY_MAX_NS = 5_000_000_000
"""A failed checkpoint is tried again after the checkpoint period, or this, whichever is shorter."""

SaveCheckpoint = Callable[[IterativeTask, Path, int], bool]
"""Saves a task's state with its step count to a path; False if the task has no state."""


class GateLink(Protocol):
    """What the gate needs of its link to the manager (a :class:`~freeride.transport.WorkerLink`)."""

    def recv_nowait(self) -> p.ManagerToWorker | BadFrame | None:
        """The next message if one has arrived, else ``None``."""
        ...

    async def recv(self) -> p.ManagerToWorker | BadFrame:
        """Wait for the next message."""
        ...

    def send_nowait(self, msg: p.WorkerToManager) -> None:
        """Send a message without waiting."""
        ...


class RunDelay(Protocol):
    """How long this thread has waited for a CPU while runnable, in ns (a counter)."""

    def ns(self) -> int:
        """The counter's current value (0 where it cannot be read)."""
        ...

    def close(self) -> None:
        """Release what the counter holds; later reads return 0."""
        ...


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


def _process_cpu_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_PROCESS_CPUTIME_ID)


class GrantGate:
    """The :class:`~freeride.sidetask.StepGate` of a task run by the manager.

    Args:
        link: The worker's link to the manager.
        assign: What the manager assigned (margin, checkpoint path and period).
        task: The task whose steps pass through the gate.
        steps: Steps already done (restored from a checkpoint).
        save: Writes the task's checkpoint (see :data:`SaveCheckpoint`).
        clock: Where every time reading comes from.
        cpu_clock: The process's CPU clock, all threads (reported with each grant
            so that the manager can tell the compute that ran after a bubble ended).
        run_delay: This thread's CPU wait counter, taken out of learned step
            times; defaults to the thread's schedstat.
        device_sync: Called at the end of each step before its end time is read:
            on a GPU it waits for an event recorded on the task's stream, so step
            times (and so the estimates that must fit a bubble) are the device's.
        idle: Called each time the gate parks the task between grants, for
            housekeeping that must not run inside a bubble (keeping estimates).
    """

    def __init__(
        self,
        link: GateLink,
        assign: p.Assign,
        task: IterativeTask,
        steps: int,
        *,
        save: SaveCheckpoint,
        clock: Clock = MONOTONIC,
        cpu_clock: Callable[[], int] = _process_cpu_ns,
        run_delay: RunDelay | None = None,
        device_sync: Callable[[], None] | None = None,
        state_bytes: Callable[[IterativeTask], int] = lambda task: state_bytes_of(task.state_dict()),
        idle: Callable[[], None] | None = None,
    ) -> None:
        self._link = link
        self._idle = idle
        self._device_sync = device_sync
        self._assign = assign
        self._task = task
        self._steps = steps
        self._save = save
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._g_cpu = -1
        hint = assign.spec.step_time_ns
        if hint < 0 and task.step_time > 0:
            hint = int(task.step_time * 1e9)
        self.estimates = StepEstimates(hint, cost=task.step_cost)
        self._run_delay: RunDelay = _RunDelay() if run_delay is None else run_delay
        self._kind = task.step_kind()
        """The kind of the step waiting to start (or of the next one)."""
        self._packs = type(task).fit_piece is not IterativeTask.fit_piece
        """The task chooses its pieces by the room left (packing)."""
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
        self._last_checkpoint = clock.now_ns()
        self._checkpoint_ns = -1
        self._state_bytes = state_bytes
        self._checkpoint_bytes = 0
        """Size of the state the last checkpoint saved (0: unknown)."""
        self._sized = (-1, 0)
        """(steps, bytes): the state's size when last read, at that step count."""
        self._saved_steps = steps
        self._unsaved_ns = 0
        """Step time since the last checkpoint: what a crash now would lose."""
        self._failed_ns = -1
        """When the last checkpoint failed (-1: it did not)."""

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
            case _:
                assert_never(msg)

    def _give_back(self, reason: p.GrantDoneReason) -> None:
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
                cpu_ns=self._g_cpu,
            )
        )
        self._grant = None
        self._g_steps = self._g_busy = self._g_overrun = self._g_last_end = 0
        self._g_cpu = -1
        self._g_first = -1

    def _fits(self, now: int, need_ns: int) -> bool:
        grant = self._grant
        if grant is None or self._revoked:
            return False
        margin = self._assign.margin_ns
        if need_ns < 0 or grant.probe:  # unknown or stale: one step, at the start of a grant still open
            return self._g_steps == 0 and room_ns(now, grant.deadline_ns, margin) > 0
        return fits(now, need_ns, grant.deadline_ns, margin)

    def _step_fits(self, now: int) -> bool:
        """Whether the pending step may start now.

        A kind not measured yet starts mid-grant where its cost-scaled estimate
        fits, and at a grant's start in any case (a probe: its estimate errs
        high, and one long enough to fit no bubble would keep it out of all).
        A kind measured only in an earlier run pays its warm-up again in this
        process: where that first step's time there does not fit, it starts only
        at the start of a grant, as an unmeasured kind would, rather than wait
        for a bubble that long.
        """
        need = self.estimates.estimate_ns(self._kind)
        if self.estimate_ns < 0 and self._at_grant_start(now):
            return True  # unmeasured: a probe, as ever, however long its cost makes it look
        if not self._fits(now, need):
            return False
        cold = self.estimates.cold_ns(self._kind)
        return cold <= need or self._fits(now, cold) or self._at_grant_start(now)

    def _at_grant_start(self, now: int) -> bool:
        grant = self._grant
        return (
            grant is not None
            and not self._revoked
            and self._g_steps == 0
            and room_ns(now, grant.deadline_ns, self._assign.margin_ns) > 0
        )

    def _progress(self, now: int) -> None:
        if now - self._last_progress >= _PROGRESS_EVERY_NS:
            self._last_progress = now
            self._link.send_nowait(
                p.Progress(task_id=self._assign.task_id, steps=self._steps, metrics=self._task.metrics())
            )

    def checkpoint(self) -> bool:
        """Save the task's state now; False if the write failed (reported, and retried later).

        Periodic checkpoints run inside grants, and only when the last one's
        duration fits, unless the loss bound forces one; this call itself does
        not check. A failure (a full disk: ``torch.save`` raises
        ``RuntimeError: basic_ios::clear``) must not end the task: it keeps its
        previous checkpoint and tries again.
        """
        size = self._size_now()
        t0 = self._clock.now_ns()
        path = Path(self._assign.checkpoint_path)
        try:
            saved = self._save(self._task, path, self._steps)
        except Exception as exc:
            now = self._clock.now_ns()
            self._failed_ns = now
            self._checkpoint_ns = max(self._checkpoint_ns, now - t0)
            error = f"{type(exc).__name__}: {exc}"
            logger.warning("[worker] checkpoint at step %d to %s failed: %s", self._steps, path, error)
            self._link.send_nowait(p.CheckpointFailed(task_id=self._assign.task_id, steps=self._steps, error=error))
            return False
        if saved:
            self._link.send_nowait(p.Checkpointed(task_id=self._assign.task_id, steps=self._steps, path=str(path)))
        self._last_checkpoint = self._clock.now_ns()
        self._checkpoint_ns = self._last_checkpoint - t0
        self._checkpoint_bytes = size
        self._saved_steps, self._unsaved_ns, self._failed_ns = self._steps, 0, -1
        return True

    def _size_now(self) -> int:
        """The task's state size now (read at most once per step; 0 if it cannot be read)."""
        if self._sized[0] != self._steps:
            try:
                size = self._state_bytes(self._task)
            except Exception as exc:  # a task's state_dict failing here shows up at the save itself
                logger.debug("[worker] state size unreadable: %s", exc)
                size = 0
            self._sized = (self._steps, size)
        return self._sized[1]

    def checkpoint_estimate_ns(self) -> int:
        """What the next checkpoint is expected to take: the last one's time, scaled by how the state grew.

        -1 before the first checkpoint. A state that grew since (say from a
        model alone to a model with its optimizer's buffers) would otherwise be
        fitted into a bubble on the smaller state's time and overrun its end.
        """
        if self._checkpoint_ns < 0:
            return -1
        if self._checkpoint_bytes <= 0:
            return self._checkpoint_ns
        return max(self._checkpoint_ns, self._checkpoint_ns * self._size_now() // self._checkpoint_bytes)

    def _retry_allowed(self, now: int) -> bool:
        if self._failed_ns < 0:
            return True
        return now - self._failed_ns >= min(self._assign.checkpoint_every_ns, _RETRY_MAX_NS)

    def _loss_bound_reached(self) -> bool:
        """Whether one more step would leave more unsaved than the assigned bound."""
        a = self._assign
        if a.max_loss_steps and self._steps - self._saved_steps + 1 > a.max_loss_steps:
            return True
        # nothing unsaved: a step longer than the whole bound still runs (after a checkpoint)
        unsaved = self._steps > self._saved_steps
        return bool(a.max_loss_ns) and unsaved and self._unsaved_ns + max(0, self.estimate_ns) > a.max_loss_ns

    @property
    def unsaved_steps(self) -> int:
        """Steps a crash now would lose."""
        return self._steps - self._saved_steps

    async def _wait_for_fit(self) -> None:
        while True:
            while (msg := self._link.recv_nowait()) is not None:
                self._handle(msg)
            if self._stop is not None:
                self._give_back("stopping")
                raise TaskStopped(self._stop)
            now = self._clock.now_ns()
            retry = self._retry_allowed(now)
            due = retry and now - self._last_checkpoint >= self._assign.checkpoint_every_ns
            bound = retry and self._loss_bound_reached()
            need = self.checkpoint_estimate_ns() if due or bound else -1
            if need >= 0 and self._fits(now, need):
                self._g_busy += self._timed(self.checkpoint)
                continue
            if bound and self._at_grant_start(now):
                # No bubble fits the checkpoint: take it at the start of one, overrunning
                # its end once, rather than let a crash lose more than the bound.
                logger.info("[worker] checkpoint forced at step %d (loss bound reached)", self._steps)
                self._g_busy += self._timed(self.checkpoint)
                continue
            if not bound:
                self._pack(now)
                if self._step_fits(now):
                    return
            if self._grant is not None:
                self._give_back("revoked" if self._revoked else "no_fit")
            self._progress(now)
            if self._idle is not None and self._grant is None:
                self._idle()
            self._handle(await self._link.recv())

    def _pack(self, now: int) -> None:
        """Let a packing task choose its next piece for the room left (see ``IterativeTask.fit_piece``).

        It only changes which kind is pending; whether that fits is then
        checked as for any step.
        """
        grant = self._grant
        if not self._packs or grant is None or self._revoked or grant.probe:
            return
        room = room_ns(now, grant.deadline_ns, self._assign.margin_ns)
        if room > 0:
            kind = self._task.fit_piece(room, self.estimates.estimate_ns)
            if kind is not None:
                self._kind = kind

    def _timed(self, fn: Callable[[], object]) -> int:
        t0 = self._clock.now_ns()
        fn()
        t1 = self._clock.now_ns()
        self._note_end(t1)
        return t1 - t0

    def _note_end(self, end: int) -> None:
        self._g_last_end = end
        self._g_cpu = self._cpu_clock()
        grant = self._grant
        if grant is not None and end > grant.deadline_ns:
            self._g_overrun = end - grant.deadline_ns

    @property
    def estimate_ns(self) -> int:
        """The running estimate of the pending step's kind (what the manager must fit).

        -1 for a kind not measured yet even where its cost gives an estimate: the
        manager then grants it a bubble's start, where it runs as a probe.
        """
        return self.estimates.known_ns(self._kind)

    @asynccontextmanager
    async def step(self, kind: str = "") -> AsyncIterator[None]:
        """Park until a step of ``kind`` fits in a grant, then time it.

        Raises:
            TaskStopped: The manager asked the task to stop.
        """
        self._kind = kind
        while True:
            await self._wait_for_fit()
            delay0 = self._run_delay.ns()
            t0 = self._clock.now_ns()
            # checked again with the step's own start time: the worker runs at the lowest
            # priority and may have been preempted since the fit was decided
            if self._step_fits(t0):
                break
        if self._g_steps == 0 and self._grant is not None:
            self._g_first = t0 - self._grant.bubble_t_ns
        yield
        if self._device_sync is not None:
            self._device_sync()  # the step's kernels, not just their launches
        t1 = self._clock.now_ns()
        # the kind that ran: a packing task may have chosen another piece than the one asked for
        self.estimates.observe(self._kind, max(1, t1 - t0 - (self._run_delay.ns() - delay0)))
        self._kind = self._task.step_kind()
        self._steps += 1
        self._g_steps += 1
        self._g_busy += t1 - t0
        self._unsaved_ns += t1 - t0
        self._note_end(t1)

    def finish(self, reason: p.GrantDoneReason) -> None:
        """Give back the grant held (if any) for ``reason`` and release the CPU wait counter."""
        self._give_back(reason)
        self._run_delay.close()
