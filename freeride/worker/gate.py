"""The worker's :class:`~freeride.sidetask.StepGate`: when a step of a managed task may start.

The task's ``gate.step()`` is where the worker talks to the manager: it parks
until a grant arrives, lets a step start only if the step's estimated duration
fits before the grant's deadline minus the margin (:mod:`freeride.admission`),
and gives the grant back (with what it did) when the next step no longer fits
or the bubble ends.

Every time reading goes through an injected :class:`~freeride.clock.Clock` and
every message through a :class:`GateLink`, so the rule can be driven step by
step in tests without sockets or sleeps.

The gate runs the loop and answers the manager's messages; each of its other
concerns is a part with one job: the grant held and what was done in it
(:mod:`~freeride.worker.ledger`), the pending step and whether it fits
(:mod:`~freeride.worker.pending`), checkpoints (:mod:`~freeride.worker.checkpointing`)
and progress reports (:mod:`~freeride.worker.reports`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar, assert_never

from freeride import protocol as p
from freeride.clock import MONOTONIC, Clock
from freeride.host.schedstat import RunDelay, ThreadRunDelay
from freeride.sidetask import IterativeTask, StepEstimates, TaskStopped
from freeride.transport import BadFrame
from freeride.worker.armed import Arming, BubbleFeed
from freeride.worker.checkpoint import state_bytes as state_bytes_of
from freeride.worker.checkpoint import write_checkpoint
from freeride.worker.checkpointing import Checkpointer, SaveCheckpoint
from freeride.worker.courtesy import Courtesy
from freeride.worker.gated import GatedSteps, Queued, fits_gate, hear_grant
from freeride.worker.ledger import GrantLedger
from freeride.worker.pending import PendingStep
from freeride.worker.reports import PROGRESS_EVERY_NS, ProgressReports
from freeride.worker.snapshot import WriteState
from freeride.worker.waiting import GateLink, IdleWaits

__all__ = ["GateLink", "GrantGate", "RunDelay", "SaveCheckpoint", "ThreadRunDelay"]

logger = logging.getLogger(__name__)

_OVERRUN_LOG_NS = 2_000_000
"""A step that ends this far past its bubble's end is logged with its kind, time and estimate."""

_T = TypeVar("_T")


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
        write: Writes a staged checkpoint's copy of the state, on a thread of its own
            (see :mod:`~freeride.worker.checkpointing`).
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
        gated: Queues an armed step ahead behind the worker's slot of the device's bubble gate
            (see :mod:`freeride.worker.gated`); None: every step waits on the host for its bubble.
    """

    def __init__(
        self,
        link: GateLink,
        assign: p.Assign,
        task: IterativeTask,
        steps: int,
        *,
        save: SaveCheckpoint,
        write: WriteState = write_checkpoint,
        clock: Clock = MONOTONIC,
        cpu_clock: Callable[[], int] = _process_cpu_ns,
        run_delay: RunDelay | None = None,
        device_sync: Callable[[], None] | None = None,
        state_bytes: Callable[[IterativeTask], int] = lambda task: state_bytes_of(task.state_dict()),
        feed: BubbleFeed | None = None,
        idle: Callable[[], None] | None = None,
        courtesy: Courtesy | None = None,
        gated: GatedSteps | None = None,
    ) -> None:
        self._link = link
        self._gated = gated
        self._queued: Queued | None = None
        """The step queued behind the gate and not yet run (between its fit and its body)."""
        self._courtesy = courtesy
        self._idle = idle
        self._feed = feed
        self._arming = Arming()
        self._device_sync = device_sync
        self._task = task
        self._steps = steps
        self._clock = clock
        self._cpu_clock = cpu_clock
        hint = assign.spec.step_time_ns
        if hint < 0 and task.step_time > 0:
            hint = int(task.step_time * 1e9)
        estimates = StepEstimates(hint, cost=task.step_cost)
        self._run_delay: RunDelay = ThreadRunDelay() if run_delay is None else run_delay
        self._ledger = GrantLedger(assign)
        self._pending = PendingStep(task, estimates, self._ledger)
        self._stop: str | None = None
        self._checkpoints = Checkpointer(
            assign,
            task,
            steps,
            save=save,
            write=write,
            state_bytes=state_bytes,
            clock=clock,
            send=self._send,
            log=logger,
        )
        self._reports = ProgressReports(assign, task, estimates, self._send)
        self._waits = IdleWaits(
            link,
            on_message=self._idle_message,
            waiting=self._waiting,
            tick=lambda: self._reports.send(self._clock.now_ns(), self._steps),
            period_s=PROGRESS_EVERY_NS / 1e9,
        )
        self._resumed = False
        """``on_resume`` ran for the grant held: ``on_pause`` is owed when it goes."""

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def estimates(self) -> StepEstimates:
        """What each kind of step is expected to take, learned from the steps that ran."""
        return self._pending.estimates

    @property
    def _assign(self) -> p.Assign:
        """What the manager assigned; a replacement reaches every part that reads it."""
        return self._ledger.assign

    @_assign.setter
    def _assign(self, assign: p.Assign) -> None:
        self._ledger.assign = self._checkpoints.assign = self._reports.assign = assign

    def _send(self, msg: p.WorkerToManager) -> None:
        self._link.send_nowait(msg)

    def _handle(self, msg: p.ManagerToWorker | BadFrame) -> None:
        ledger = self._ledger
        match msg:
            case p.Grant():
                self._take_armed()  # the rank's event, if it is here, came first
                if self._arming.manager_grant(msg):
                    return  # the armed grant, already taken from the rank's event
                if ledger.holds(msg.grant_id):
                    ledger.grant = msg  # the armed grant, taken on another bubble than the manager's
                    return
                if ledger.grant is not None:
                    self._give_back("expired")
                ledger.take(msg)
            case p.Revoke(grant_id=gid):
                if ledger.holds(gid):
                    ledger.revoked = True
                elif self._arming.disarmed(gid):  # its bubble passed unseen (and no Grant came): give it back
                    self._send(
                        ledger.unheld_done(gid, "revoked", estimate_ns=self.estimate_ns, total_steps=self._steps)
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
        if self._ledger.grant is None:
            return
        if self._resumed:
            self._resumed = False
            self._task.on_pause()
        done = self._ledger.hand_back(reason, estimate_ns=self.estimate_ns, total_steps=self._steps)
        if done is not None:
            self._send(done)

    def _read_feed(self) -> None:
        """Note the rank's latest bubble start and end; a grant whose bubble ended is over, as if revoked.

        The rank's own end reaches the worker before the manager's Revoke
        could, and whether the manager reads the rank's events at once or not
        (it reads them in batches while no decision waits on them).
        """
        feed = self._feed
        if feed is None:
            return
        while (event := feed.recv_nowait()) is not None:
            if isinstance(event, BadFrame):
                logger.warning("[worker] rejected a bubble event: %s", event.reason)
            else:
                self._arming.seen(event)
        while (end := feed.recv_end_nowait()) is not None:
            if isinstance(end, BadFrame):
                logger.warning("[worker] rejected a bubble event: %s", end.reason)
            else:
                self._arming.ended(end)
        grant = self._ledger.grant
        if grant is not None and self._arming.over(grant):
            self._ledger.revoked = True

    def _take_armed(self) -> None:
        """Take the armed grant if its bubble has started."""
        grant = self._arming.take()
        if grant is None:
            return
        if self._ledger.grant is not None:
            self._give_back("revoked" if self._ledger.revoked else "expired")
        self._ledger.take_armed(grant, self._cpu_clock())

    def progress(self) -> p.Progress:
        """What the task has done so far: steps, metrics and the estimate of each step kind."""
        return self._reports.progress(self._steps)

    def remaining(self) -> float | None:
        """Seconds left in the current grant minus the margin; ``None`` outside a grant."""
        grant = self._ledger.open
        if grant is None:
            return None
        return max(0, self._ledger.room_ns(grant, self._clock.now_ns())) / 1e9

    def report(self, **metrics: float) -> None:
        """Publish ``metrics`` (sent at once, or with the next progress report if one went out lately)."""
        self._reports.report(self._clock.now_ns(), self._steps, metrics)

    def _idle_message(self, msg: p.ManagerToWorker | BadFrame) -> None:
        self._handle(msg)
        if self._ledger.grant is not None:  # nothing to run: the scheduler passes the bubble on
            self._give_back("idle")
        if self._stop is not None:
            raise TaskStopped(self._stop)

    async def wait_for(self, awaitable: Awaitable[_T]) -> _T:
        """Await the task's own I/O between steps, giving every grant back meanwhile.

        What is there already (an item queued, a directory listed without
        waiting) is taken in one pass of the event loop, with the grant kept:
        only a real wait gives the bubble away.

        Raises:
            TaskStopped: The manager asked the task to stop while it waited.
        """
        return await self._waits.wait_for(awaitable)

    def idle_until(self, source: AsyncIterable[_T]) -> AsyncIterator[_T]:
        """Iterate ``source``, waiting for each item as :meth:`wait_for` does."""
        return self._waits.idle_until(source)

    def _waiting(self, waiting: bool) -> None:
        if waiting:
            self._give_back("idle")
            self._reports.wait_started(self._clock.now_ns(), self._steps)
        else:
            self._reports.waiting = False

    def checkpoint(self) -> bool:
        """Save the task's state now; False if the write failed (reported, and retried later).

        Periodic checkpoints run inside grants, and only when the last one's
        duration fits, unless the loss bound forces one; this call itself does
        not check. A failure (a full disk: ``torch.save`` raises
        ``RuntimeError: basic_ios::clear``) must not end the task: it keeps its
        previous checkpoint and tries again.
        """
        return self._checkpoints.write(self._steps)

    def checkpoint_first(self) -> None:
        """The checkpoint before any bubble: it measures what one costs (none for a staged state)."""
        self._checkpoints.first(self._steps)

    def checkpoint_estimate_ns(self) -> int:
        """What the next checkpoint is expected to take: the last one's time, scaled by how the state grew.

        -1 before the first checkpoint.
        """
        return self._checkpoints.estimate_ns()

    @property
    def unsaved_steps(self) -> int:
        """Steps a crash now would lose."""
        return self._steps - self._checkpoints.saved_steps

    async def _wait_for_fit(self) -> None:
        ledger, pending = self._ledger, self._pending
        while True:
            self._read_feed()  # before the manager's messages: its Grant may repeat this event
            while (msg := self._link.recv_nowait()) is not None:
                self._handle(msg)
            self._read_feed()
            self._take_armed()
            now = self._clock.now_ns()
            if self._stop is not None:
                # a task between consistent points runs on to the next one, but only in the grant it holds
                if self._task.can_checkpoint() or not ledger.fits(now, self.estimate_ns):
                    self._give_back("stopping")
                    raise TaskStopped(self._stop)
                return
            due = self._checkpoints.due(now, self._steps, lambda: pending.estimate_ns)
            if due.copying:
                if self._copy_slice(now):
                    continue
            elif due.need_ns >= 0 and ledger.fits(now, due.need_ns):
                self._timed_checkpoint(due.need_ns)
                continue
            elif (due.bound or due.overdue) and not due.writing and ledger.at_start(now):
                # No bubble fits the checkpoint: take it at the start of one, overrunning
                # its end once, rather than let a crash lose more than the bound, or
                # than a few periods on the time of one slow save
                why = "loss bound reached" if due.bound else "overdue: its time measured again"
                logger.info("[worker] checkpoint forced at step %d (%s)", self._steps, why)
                self._timed_checkpoint(due.need_ns)
                continue
            if not (due.bound or due.copying):
                pending.pack(now)
                if pending.fits(now):
                    return
            if ledger.grant is not None:
                self._give_back("revoked" if ledger.revoked else "no_fit")
            self._reports.send(now, self._steps)
            if self._idle is not None and ledger.grant is None:
                self._idle()
            if self._feed is not None and self._arming.arm is not None:
                if not (due.bound or due.copying) and self._queue_gated(now):
                    return  # the step goes ahead of its bubble, behind the gate the rank's stream opens
                await self._feed.wait()  # a Grant or the armed bubble's start, whichever comes first
            else:
                self._handle(await self._link.recv())

    def _queue_gated(self, now: int) -> bool:
        """Queue the pending step behind the armed gate slot, where :func:`~freeride.worker.gated.fits_gate` lets it."""
        arm, gated = self._arming.arm, self._gated
        if gated is None or arm is None or self._ledger.grant is not None or self.packs:
            return False  # a packing task sizes its piece by the room left, which is not known ahead
        margin = arm.margin_ns if arm.margin_ns >= 0 else self._assign.margin_ns
        if not fits_gate(arm, self._pending.estimate_ns, margin):
            return False
        self._queued = gated.queue(arm.gate_slot, now)
        return True

    def _heard(self) -> bool:
        """Read the rank's events and the manager's messages; whether the grant a gated step ran in is settled."""
        self._read_feed()
        self._take_armed()
        while (msg := self._link.recv_nowait()) is not None:
            self._handle(msg)  # a Grant: the manager released the step from the host in a bubble of its own
        return self._ledger.grant is not None or self._arming.arm is None or self._feed is None

    async def _ran_gated(self, queued: Queued) -> None:
        """Account the step queued behind the gate, once the device has run it, in the grant it ran in."""
        assert self._gated is not None
        device_ns = self._gated.finish(queued)  # the thread sleeps until the device has run the step
        await hear_grant(self._heard, self._feed.wait if self._feed is not None else None)
        grant = self._ledger.grant
        if grant is not None:
            t0 = max(grant.bubble_t_ns, queued.queued_ns)
            self._ledger.started(t0)
            self._ledger.stepped(t0, t0 + device_ns, self._cpu_clock())
        else:
            logger.info("[worker] a step queued behind the device gate ran with no grant (a stop, or the rank left)")
        self._pending.ran(device_ns)
        self._steps += 1
        self._checkpoints.stepped(device_ns)

    def _copy_slice(self, now: int) -> bool:
        """Copy the slice of a staged checkpoint that fits the open grant's room; False if none fits."""
        grant = self._ledger.open
        if grant is None:
            return False
        size = self._checkpoints.slice_bytes(self._ledger.room_ns(grant, now))
        if size <= 0:
            return False
        cpu0 = self._cpu_clock()
        self._checkpoints.copy_slice(self._steps, size)
        self._ledger.checkpointed(now, self._clock.now_ns(), self._cpu_clock(), cpu_at_start_ns=cpu0)
        return True

    def _timed_checkpoint(self, expected: int) -> None:
        delay0 = self._run_delay.ns()
        t0, cpu0 = self._clock.now_ns(), self._cpu_clock()
        self.checkpoint()
        t1 = self._clock.now_ns()
        self._ledger.checkpointed(t0, t1, self._cpu_clock(), cpu_at_start_ns=cpu0)
        self._log_overrun("checkpoint", t0, t1, self._run_delay.ns() - delay0, expected)

    @property
    def packs(self) -> bool:
        """The task chooses its pieces by the room left (``IterativeTask.fit_piece``)."""
        return self._pending.packs

    @property
    def estimate_ns(self) -> int:
        """The running estimate of the pending step's kind (what the manager must fit).

        -1 for a kind not measured yet even where its cost gives an estimate: the
        manager then grants it a bubble's start, where it runs as a probe.
        """
        return self._pending.estimate_ns

    @asynccontextmanager
    async def step(self, kind: str = "") -> AsyncIterator[None]:
        """Park until a step of ``kind`` fits in a grant, then time it.

        Raises:
            TaskStopped: The manager asked the task to stop.
        """
        pending = self._pending
        pending.kind = kind
        while True:
            await self._wait_for_fit()
            if self._queued is not None:
                break
            if self._ledger.steps == 0 and self._courtesy is not None:
                self._courtesy.follow(self._arming.rank_thread)
                self._courtesy.defer()
            delay0 = self._run_delay.ns()
            t0 = self._clock.now_ns()
            # checked again with the step's own start time: the worker runs at the lowest
            # priority and may have been preempted since the fit was decided
            if pending.fits(t0):
                break
        queued, self._queued = self._queued, None
        cpu0 = -1
        if queued is None:  # else the device starts it: the rank's stream opens its slot at the bubble
            self._ledger.started(t0)
            cpu0 = self._cpu_clock()
        if not self._resumed:
            self._resumed = True
            self._task.on_resume()
        yield
        if queued is not None:
            await self._ran_gated(queued)
            return
        if self._device_sync is not None:
            self._device_sync()  # the step's kernels, not just their launches
        t1 = self._clock.now_ns()
        waited = self._run_delay.ns() - delay0
        grant = self._ledger.grant
        if grant is not None and t1 - grant.deadline_ns > _OVERRUN_LOG_NS:  # rare: not on every step
            self._log_overrun(pending.kind, t0, t1, waited, self.estimates.estimate_ns(pending.kind))
        pending.ran(max(1, t1 - t0 - waited))
        self._steps += 1
        self._checkpoints.stepped(t1 - t0)
        self._ledger.stepped(t0, t1, self._cpu_clock(), cpu_at_start_ns=cpu0)

    def _log_overrun(self, kind: str, t0: int, t1: int, waited: int, expected: int) -> None:
        """Name a step that ran well past its bubble's end (see :meth:`GrantLedger.overrun_text`)."""
        text = self._ledger.overrun_text(kind, t0, t1, waited, expected, at_least_ns=_OVERRUN_LOG_NS)
        if text:
            logger.info("[worker] %s", text)

    def checkpoint_at_stop(self) -> bool:
        """The checkpoint of a stopped task, if its state is consistent; else the last one is kept, and said so."""
        return self._checkpoints.at_stop(self._steps)

    def finish(self, reason: p.GrantDoneReason) -> None:
        """Give back the grant held (if any) for ``reason`` and release the CPU wait counter."""
        self._give_back(reason)
        self._run_delay.close()
        if self._courtesy is not None:
            self._courtesy.close()
