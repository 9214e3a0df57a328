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
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol, TypeVar, assert_never

from freeride import protocol as p
from freeride.admission import fits, room_ns
from freeride.clock import MONOTONIC, Clock
from freeride.host.schedstat import ThreadRunDelay
from freeride.sidetask import IterativeTask, StepEstimates, TaskStopped
from freeride.transport import BadFrame
from freeride.worker.armed import Arming, BubbleFeed
from freeride.worker.checkpoint import state_bytes as state_bytes_of
from freeride.worker.courtesy import Courtesy
from freeride.worker.waiting import race_link

__all__ = ["GateLink", "GrantGate", "RunDelay", "SaveCheckpoint", "ThreadRunDelay"]

logger = logging.getLogger(__name__)

_PROGRESS_EVERY_NS = 250_000_000
_RETRY_MAX_NS = 5_000_000_000
"""A failed checkpoint is tried again after the checkpoint period, or this, whichever is shorter."""
_OVERRUN_LOG_NS = 2_000_000
"""A step that ends this far past its bubble's end is logged with its kind, time and estimate."""

_T = TypeVar("_T")

SaveCheckpoint = Callable[[IterativeTask, Path, int], int]
"""Saves a task's state with its step count to a path; returns the bytes of tensor data it held
(:func:`~freeride.worker.checkpoint.state_bytes`), or -1 if the task has no state (nothing saved)."""


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
        feed: The rank's bubble starts, for armed grants (see :mod:`freeride.worker.armed`);
            without one, an :class:`~freeride.protocol.Arm` is ignored and Grants alone start steps.
        idle: Called each time the gate parks the task between grants, for
            housekeeping that must not run inside a bubble (keeping estimates).
        courtesy: Lets the rank's thread block before a grant's first step takes the
            core it shares (see :mod:`freeride.worker.courtesy`); None: no such wait.
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
        feed: BubbleFeed | None = None,
        idle: Callable[[], None] | None = None,
        courtesy: Courtesy | None = None,
    ) -> None:
        self._link = link
        self._courtesy = courtesy
        self._idle = idle
        self._feed = feed
        self._arming = Arming()
        self._g_armed = False
        self._g_cpu_start = -1
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
        self._run_delay: RunDelay = ThreadRunDelay() if run_delay is None else run_delay
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
        self._sized = -1
        """The state's size, read once after the last checkpoint when the next one is due (-1: not yet)."""
        self._saved_steps = steps
        self._unsaved_ns = 0
        """Step time since the last checkpoint: what a crash now would lose."""
        self._failed_ns = -1
        """When the last checkpoint failed (-1: it did not)."""
        self._resumed = False
        """``on_resume`` ran for the grant held: ``on_pause`` is owed when it goes."""
        self._reported: dict[str, float] = {}
        """Metrics the task published with :meth:`report`, sent with every progress report."""
        self._waiting = False
        self._said_waiting = False
        """The last progress report said the task waits for input."""

    @property
    def steps(self) -> int:
        return self._steps

    def _handle(self, msg: p.ManagerToWorker | BadFrame) -> None:
        match msg:
            case p.Grant():
                self._take_armed()  # the rank's event, if it is here, came first
                if self._arming.manager_grant(msg):
                    return  # the armed grant, already taken from the rank's event
                if self._grant is not None and self._grant.grant_id == msg.grant_id:
                    self._grant = msg  # the armed grant, taken on another bubble than the manager's
                    return
                if self._grant is not None:
                    self._give_back("expired")
                self._grant, self._revoked = msg, False
            case p.Revoke(grant_id=gid):
                if self._grant is not None and self._grant.grant_id == gid:
                    self._revoked = True
                elif self._arming.disarmed(gid):  # its bubble passed unseen (and no Grant came): give it back
                    self._link.send_nowait(
                        p.GrantDone(
                            task_id=self._assign.task_id,
                            grant_id=gid,
                            steps=0,
                            busy_ns=0,
                            first_step_delay_ns=-1,
                            overrun_ns=0,
                            reason="revoked",
                            step_estimate_ns=self.estimate_ns,
                            total_steps=self._steps,
                        )
                    )
            case p.Arm(endpoint=endpoint):
                if self._feed is not None:
                    self._feed.follow(endpoint)
                    self._arming.armed(msg)
            case p.Disarm(grant_id=gid):
                self._arming.disarmed(gid)
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
        if self._resumed:
            self._resumed = False
            self._task.on_pause()
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
                armed=self._g_armed,
                cpu_at_start_ns=self._g_cpu_start,
            )
        )
        self._grant = None
        self._g_steps = self._g_busy = self._g_overrun = self._g_last_end = 0
        self._g_cpu = self._g_cpu_start = -1
        self._g_first = -1
        self._g_armed = False

    def _read_feed(self) -> None:
        """Note the rank's latest bubble start."""
        feed = self._feed
        if feed is None:
            return
        while (event := feed.recv_nowait()) is not None:
            if isinstance(event, BadFrame):
                logger.warning("[worker] rejected a bubble event: %s", event.reason)
            else:
                self._arming.seen(event)

    def _take_armed(self) -> None:
        """Take the armed grant if its bubble has started."""
        grant = self._arming.take()
        if grant is None:
            return
        if self._grant is not None:
            self._give_back("revoked" if self._revoked else "expired")
        self._grant, self._revoked = grant, False
        self._g_armed, self._g_cpu_start = True, self._cpu_clock()

    def _fits(self, now: int, need_ns: int) -> bool:
        grant = self._grant
        if grant is None or self._revoked:
            return False
        margin = self._margin(grant)
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
            and room_ns(now, grant.deadline_ns, self._margin(grant)) > 0
        )

    def _margin(self, grant: p.Grant) -> int:
        """The grant's margin (its device's guard adapts it), else the one assigned at the start."""
        return grant.margin_ns if grant.margin_ns >= 0 else self._assign.margin_ns

    def _progress(self, now: int, *, force: bool = False) -> None:
        if force or now - self._last_progress >= _PROGRESS_EVERY_NS:
            self._last_progress = now
            self._said_waiting = self._waiting
            self._link.send_nowait(self.progress())

    def progress(self) -> p.Progress:
        """What the task has done so far: steps, metrics and the estimate of each step kind."""
        kinds = self.estimates.kinds()[-p.MAX_ESTIMATE_KINDS :]  # the newest kinds, when there are many
        return p.Progress(
            task_id=self._assign.task_id,
            steps=self._steps,
            metrics={**self._task.metrics(), **self._reported},
            estimates={kind: self.estimates.estimate_ns(kind) for kind in kinds},
            waiting=self._waiting,
        )

    def remaining(self) -> float | None:
        """Seconds left in the current grant minus the margin; ``None`` outside a grant."""
        grant = self._grant
        if grant is None or self._revoked:
            return None
        return max(0, room_ns(self._clock.now_ns(), grant.deadline_ns, self._margin(grant))) / 1e9

    def report(self, **metrics: float) -> None:
        """Publish ``metrics`` (sent at once, or with the next progress report if one went out lately)."""
        self._reported.update(metrics)
        self._progress(self._clock.now_ns())

    def _idle_message(self, msg: p.ManagerToWorker | BadFrame) -> None:
        self._handle(msg)
        if self._grant is not None:  # nothing to run: the scheduler passes the bubble on
            self._give_back("idle")
        if self._stop is not None:
            raise TaskStopped(self._stop)

    async def wait_for(self, awaitable: Awaitable[_T]) -> _T:
        """Await the task's own I/O between steps, giving every grant back meanwhile.

        Raises:
            TaskStopped: The manager asked the task to stop while it waited.
        """
        while (msg := self._link.recv_nowait()) is not None:
            self._idle_message(msg)
        self._give_back("idle")
        self._waiting = True
        # the start of a wait is news once per report period at most: a task that waits
        # for every item must not send a report per item
        self._progress(self._clock.now_ns(), force=not self._said_waiting)
        try:
            return await race_link(
                awaitable,
                self._link.recv,
                self._idle_message,
                tick=lambda: self._progress(self._clock.now_ns()),
                period_s=_PROGRESS_EVERY_NS / 1e9,
            )
        finally:
            self._waiting = False

    async def idle_until(self, source: AsyncIterable[_T]) -> AsyncIterator[_T]:
        """Iterate ``source``, waiting for each item as :meth:`wait_for` does."""
        items = aiter(source)
        while True:
            try:
                item = await self.wait_for(anext(items))
            except StopAsyncIteration:
                return
            yield item

    def checkpoint(self) -> bool:
        """Save the task's state now; False if the write failed (reported, and retried later).

        Periodic checkpoints run inside grants, and only when the last one's
        duration fits, unless the loss bound forces one; this call itself does
        not check. A failure (a full disk: ``torch.save`` raises
        ``RuntimeError: basic_ios::clear``) must not end the task: it keeps its
        previous checkpoint and tries again.
        """
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
        if saved >= 0:
            self._link.send_nowait(p.Checkpointed(task_id=self._assign.task_id, steps=self._steps, path=str(path)))
        self._last_checkpoint = self._clock.now_ns()
        self._checkpoint_ns = self._last_checkpoint - t0
        self._checkpoint_bytes, self._sized = max(0, saved), -1
        self._saved_steps, self._unsaved_ns, self._failed_ns = self._steps, 0, -1
        return True

    def _size_now(self) -> int:
        """The task's state size, read once between two checkpoints (0 if it cannot be read).

        Once: ``state_dict()`` may cost (a copy to the host), and a state grows
        at a task's first steps (an optimizer's buffers), not step by step.
        """
        if self._sized < 0:
            try:
                self._sized = self._state_bytes(self._task)
            except Exception as exc:  # a task's state_dict failing here shows up at the save itself
                logger.debug("[worker] state size unreadable: %s", exc)
                self._sized = 0
        return self._sized

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
            self._read_feed()  # before the manager's messages: its Grant may repeat this event
            while (msg := self._link.recv_nowait()) is not None:
                self._handle(msg)
            self._read_feed()
            self._take_armed()
            now = self._clock.now_ns()
            if self._stop is not None:
                # a task between consistent points runs on to the next one, but only in the grant it holds
                if self._task.can_checkpoint() or not self._fits(now, self.estimate_ns):
                    self._give_back("stopping")
                    raise TaskStopped(self._stop)
                return
            consistent = self._task.can_checkpoint()
            retry = consistent and self._retry_allowed(now)
            due = retry and now - self._last_checkpoint >= self._assign.checkpoint_every_ns
            bound = retry and self._loss_bound_reached()
            need = self.checkpoint_estimate_ns() if due or bound else -1
            if need >= 0 and self._fits(now, need):
                self._g_busy += self._timed_checkpoint(need)
                continue
            if bound and self._at_grant_start(now):
                # No bubble fits the checkpoint: take it at the start of one, overrunning
                # its end once, rather than let a crash lose more than the bound.
                logger.info("[worker] checkpoint forced at step %d (loss bound reached)", self._steps)
                self._g_busy += self._timed_checkpoint(need)
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
            if self._feed is not None and self._arming.arm is not None:
                await self._feed.wait()  # a Grant or the armed bubble's start, whichever comes first
            else:
                self._handle(await self._link.recv())

    def _pack(self, now: int) -> None:
        """Let a packing task choose its next piece for the room left (see ``IterativeTask.fit_piece``).

        It only changes which kind is pending; whether that fits is then
        checked as for any step.
        """
        grant = self._grant
        if not self._packs or grant is None or self._revoked or grant.probe:
            return
        room = room_ns(now, grant.deadline_ns, self._margin(grant))
        if room > 0:
            kind = self._task.fit_piece(room, self.estimates.estimate_ns)
            if kind is not None:
                self._kind = kind

    def _timed_checkpoint(self, expected: int) -> int:
        delay0 = self._run_delay.ns()
        t0 = self._clock.now_ns()
        self.checkpoint()
        t1 = self._clock.now_ns()
        self._note_end(t1)
        self._log_overrun("checkpoint", t0, t1, self._run_delay.ns() - delay0, expected)
        return t1 - t0

    def _note_end(self, end: int) -> None:
        self._g_last_end = end
        self._g_cpu = self._cpu_clock()
        grant = self._grant
        if grant is not None and end > grant.deadline_ns:
            self._g_overrun = end - grant.deadline_ns

    @property
    def packs(self) -> bool:
        """The task chooses its pieces by the room left (``IterativeTask.fit_piece``)."""
        return self._packs

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
            if self._g_steps == 0 and self._courtesy is not None:
                self._courtesy.follow(self._arming.rank_thread)
                self._courtesy.defer()
            delay0 = self._run_delay.ns()
            t0 = self._clock.now_ns()
            # checked again with the step's own start time: the worker runs at the lowest
            # priority and may have been preempted since the fit was decided
            if self._step_fits(t0):
                break
        if self._g_steps == 0 and self._grant is not None:
            self._g_first = t0 - self._grant.bubble_t_ns
        if not self._resumed:
            self._resumed = True
            self._task.on_resume()
        yield
        if self._device_sync is not None:
            self._device_sync()  # the step's kernels, not just their launches
        t1 = self._clock.now_ns()
        # the kind that ran: a packing task may have chosen another piece than the one asked for
        waited = self._run_delay.ns() - delay0
        if self._grant is not None and t1 - self._grant.deadline_ns > _OVERRUN_LOG_NS:  # rare: not on every step
            self._log_overrun(self._kind, t0, t1, waited, self.estimates.estimate_ns(self._kind))
        self.estimates.observe(self._kind, max(1, t1 - t0 - waited))
        self._kind = self._task.step_kind()
        self._steps += 1
        self._g_steps += 1
        self._g_busy += t1 - t0
        self._unsaved_ns += t1 - t0
        self._note_end(t1)

    def _log_overrun(self, kind: str, t0: int, t1: int, waited: int, expected: int) -> None:
        """Name a step that ran well past its bubble's end: which kind, for how long, against what estimate."""
        grant = self._grant
        if grant is None or t1 - grant.deadline_ns <= _OVERRUN_LOG_NS:
            return
        logger.info(
            "[worker] %r ran %.1f ms past its bubble's end: it took %.1f ms (%.1f ms of it waiting for the CPU) "
            "against %s, and started %.1f ms before the deadline",
            kind,
            (t1 - grant.deadline_ns) / 1e6,
            (t1 - t0) / 1e6,
            waited / 1e6,
            f"an estimate of {expected / 1e6:.1f} ms" if expected >= 0 else "no estimate yet",
            (grant.deadline_ns - t0) / 1e6,
        )

    def checkpoint_at_stop(self) -> bool:
        """The checkpoint of a stopped task, if its state is consistent; else the last one is kept, and said so."""
        if self._task.can_checkpoint():
            return self.checkpoint()
        note = (
            f"stopped between consistent points (can_checkpoint() is False): kept the checkpoint of step "
            f"{self._saved_steps}; {self.unsaved_steps} later steps will run again"
        )
        logger.warning("[worker] %s", note)
        self._link.send_nowait(p.CheckpointFailed(task_id=self._assign.task_id, steps=self._steps, error=note))
        return False

    def finish(self, reason: p.GrantDoneReason) -> None:
        """Give back the grant held (if any) for ``reason`` and release the CPU wait counter."""
        self._give_back(reason)
        self._run_delay.close()
        if self._courtesy is not None:
            self._courtesy.close()
