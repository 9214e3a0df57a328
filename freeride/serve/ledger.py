"""The ledger of one device's bubbles: how long they lasted, and what side work used and took.

A :class:`DeviceLedger` counts bubbles and their time, settles each grant once
its report and its bubble's end are both known (time used inside the bubble,
overruns past its end, the stage's wait for its core, interference taken from
training), and keeps the span ranks trained here and the lengths of the last
bubbles (the device's typical bubble). Its scheduler
(:class:`~freeride.serve.scheduler.DeviceScheduler`) decides who gets each
bubble and tells the ledger what happened; the ledger feeds the device's
:class:`~freeride.serve.guard.InterferenceGuard` and builds its status.

Every sum saturates at 2**63 - 1, so no sender can make a total that the
status reply could not encode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from freeride import protocol as p
from freeride.clock import Clock
from freeride.observe.base import Observers
from freeride.profile import typical_bubble_ns
from freeride.serve.costs import Withheld
from freeride.serve.guard import InterferenceGuard
from freeride.serve.nobubbles import no_bubbles
from freeride.serve.ranks import DeviceInfo
from freeride.serve.tasks import TaskRecord

__all__ = ["MIN_BUBBLES_SEEN", "RECENT_BUBBLES", "DeviceLedger", "GrantState", "LedgerView"]


def _sat(total: int, more: int) -> int:
    """``total + more``, held at the largest value the wire carries."""
    return min(p.I64_MAX, total + more)


RECENT_BUBBLES = 256
"""Bubble lengths a device keeps (see :meth:`DeviceLedger.typical_bubble_ns`)."""
MIN_BUBBLES_SEEN = 16
"""Bubbles that must have ended on a device before their lengths replace the profile's."""


@dataclass(slots=True)
class GrantState:
    """One grant out or back, until it is settled."""

    task: TaskRecord
    bubble_t_ns: int = 0
    bubble_end_ns: int = 0
    """Actual end of the bubble (0 while it lasts)."""
    deadline_ns: int = 0
    """Expected end of the bubble, when the grant was handed over."""
    last_step_end_ns: int = 0
    returned: bool = False
    busy_ns: int = 0
    """Side-task time the grant reported."""
    cpu_at_grant: int = -1
    """The task's CPU clock when the grant was handed over (-1 unreadable)."""
    cpu_at_end: int = -1
    """The task's CPU clock when the bubble's end was handled, if the grant was still out then."""
    cpu_done: int = -1
    """The task's CPU clock at its last step in the grant, as reported."""
    last_step_start_ns: int = 0
    cpu_at_last_step: int = -1
    """The task's CPU clock when its last step in the grant started, as reported (-1 unknown)."""
    overrun_ns: int = 0
    """What the worker reported as past the grant's deadline (used if the bubble's end is never seen)."""
    armed: bool = False
    """Handed over by an arm: the worker may have started before the scheduler saw the bubble."""
    stage_waited_ns: int = 0
    """How long the stage then waited for its core, runnable, while this grant's step held it."""

    def late_ns(self, now: int) -> int:
        """How long past its bubble's end (its deadline, where the end was not seen) ``now`` is."""
        return now - (self.bubble_end_ns or self.deadline_ns)

    def stuck(self, now: int) -> bool:
        """Still out a full step estimate after its bubble's end: the task is still in a step."""
        return not self.returned and self.late_ns(now) > max(self.task.estimate_ns, 0)


class DeviceLedger:
    """What one device's bubbles lasted and what side work used of them and took from training.

    Args:
        device: The device's name.
        guard: The device's guard, told of every settled grant and all interference.
        observers: Told of interference.
        clock: Where the time comes from.
    """

    def __init__(self, device: str, *, guard: InterferenceGuard, observers: Observers | None, clock: Clock) -> None:
        self.device = device
        self._by_cpu_clock = not device.startswith("cuda")
        """Side work here is measured by its task's CPU clock. On a CUDA device a worker sleeps in a
        blocking sync at each step's end, so its CPU clock says nothing of the device's work: wall times."""
        self._guard = guard
        self._observers = observers
        self._clock = clock
        self.bubbles = 0
        self.bubble_ns = 0
        self._recent_bubbles: deque[int] = deque(maxlen=RECENT_BUBBLES)
        """The lengths of the last bubbles that ended here."""
        self.used_ns = 0
        self.overruns = 0
        self.overrun_ns = 0
        self.interference_ns = 0
        """Side-task compute after bubble ends: what a GPU, which does not preempt, would take from training."""
        self._task_interference: dict[int, int] = {}
        self.armed_grants = 0
        """Grants whose first step started on the rank's own event."""
        self.left_out = 0
        """Bubbles that got no grant because the guard found bubbles that short too costly."""
        self.held_back_ns = 0
        """Bubble time held back to measure the job's cost (see :mod:`freeride.holdback`)."""
        self.backed_off_ns = 0
        """Bubble time left out for the job's slowdown budget (see :mod:`freeride.serve.budget`)."""
        self.first_seen_ns = clock.now_ns()
        self._first_event_ns = 0
        """First bubble event of the rank training here now (0: none since the last one left)."""
        self._last_event_ns = 0
        self._trained_before_ns = 0
        """Training time of the ranks that trained here before (each from its first event to its last)."""

    # -- views ------------------------------------------------------------------

    def status(self, info: DeviceInfo, *, gpu_uuid: str = "") -> p.DeviceStatus:
        """This device's status: who trains here (``info``), what its bubbles were used for, its GPU's UUID."""
        guard = self._guard
        return p.DeviceStatus(
            device=self.device,
            stage=info.stage,
            rank=info.rank,
            framework=info.framework,
            alive=info.alive,
            bubbles=self.bubbles,
            bubble_ns=self.bubble_ns,
            used_ns=max(0, self.used_ns),
            overruns=self.overruns,
            overrun_ns=self.overrun_ns,
            spare_memory=info.spare_memory,
            steps=info.train_steps,
            dropped=info.dropped,
            free_memory=info.free_memory,
            interference_ns=self.interference_ns,
            train_ns=self.train_ns(alive=info.alive),
            armed_grants=self.armed_grants,
            margin_ns=guard.margin_ns,
            prediction_factor=guard.factor,
            min_bubble_ns=guard.min_bubble_ns,
            left_out=self.left_out,
            guard_reason=guard.reason,
            no_bubbles=no_bubbles(info),
            typical_bubble_ns=self.typical_bubble_ns(info),
            held_back_ns=self.held_back_ns,
            backed_off_ns=self.backed_off_ns,
            gpu_uuid=gpu_uuid,
        )

    @property
    def learned(self) -> bool:
        """Enough bubbles ended here for :meth:`typical_bubble_ns` to be measured, not profiled."""
        return len(self._recent_bubbles) >= MIN_BUBBLES_SEEN

    def typical_bubble_ns(self, info: DeviceInfo) -> int:
        """This device's typical bubble (see :func:`freeride.profile.typical_bubble_ns`); 0 while unknown.

        Learned from the last bubbles that ended here once there are
        :data:`MIN_BUBBLES_SEEN`, else taken from the profile (``info``), or
        without one from the few that ended (a job without a profile has its
        tasks placed after its first steps): what was measured wins over what
        was profiled.
        """
        if len(self._recent_bubbles) >= MIN_BUBBLES_SEEN or not info.profiled_bubble_ns:
            return typical_bubble_ns(self._recent_bubbles)
        return info.profiled_bubble_ns

    def train_ns(self, *, alive: bool) -> int:
        """Wall time ranks have trained here: each from its first bubble event to its last (to now while alive).

        A job launched again on this device adds its own span, not the time in between.
        """
        if not self._first_event_ns:
            return self._trained_before_ns
        until = self._clock.now_ns() if alive else self._last_event_ns
        return self._trained_before_ns + max(0, until - self._first_event_ns)

    def task_interference_ns(self, task_id: int) -> int:
        return self._task_interference.get(task_id, 0)

    def forget_task(self, task_id: int) -> None:
        """Drop what is kept about a task that left the manager's table."""
        self._task_interference.pop(task_id, None)

    def bubble_share(self) -> float:
        elapsed = self._clock.now_ns() - self.first_seen_ns
        return self.bubble_ns / elapsed if elapsed > 0 else 0.0

    # -- what happened ------------------------------------------------------------

    def bubble_started(self, ev: p.BubbleStarted) -> None:
        self._first_event_ns = self._first_event_ns or ev.t_ns
        self._last_event_ns = max(self._last_event_ns, ev.t_ns)
        self.bubbles += 1

    def bubble_ended(self, ev: p.BubbleEnded, waited_ns: int, grants: Iterable[GrantState]) -> None:
        """Count the bubble that ended, and mark its end on ``grants``: settled if back, else read their CPU.

        ``waited_ns`` is the stage's wait for its core at the end, charged to the step that held it.
        """
        states = list(grants)
        if waited_ns > 0:
            self._charge_stage_wait(states, ev.t_ns - waited_ns, waited_ns)
        self.bubble_ns = _sat(self.bubble_ns, ev.duration_ns)
        self._recent_bubbles.append(ev.duration_ns)
        self._first_event_ns = self._first_event_ns or max(0, ev.t_ns - ev.duration_ns)
        self._last_event_ns = max(self._last_event_ns, ev.t_ns)
        for state in states:
            if state.bubble_end_ns == 0:
                state.bubble_end_ns = ev.t_ns
                if state.returned:
                    self.settle(state)
                elif state.task.runner is not None and self._by_cpu_clock:
                    # What the task runs from here on is taken from training. Read before the
                    # scheduler's revoke, which freezes a program at once.
                    state.cpu_at_end = state.task.runner.cpu_ns()

    def withheld_ended(self, withheld: Withheld, duration_ns: int, *, granted: bool) -> None:
        """A bubble withheld from side work for its job's cost ended after ``duration_ns``."""
        if withheld == "held_back":
            self.held_back_ns = _sat(self.held_back_ns, duration_ns)
        elif withheld == "backed_off" and not granted:
            self.backed_off_ns = _sat(self.backed_off_ns, duration_ns)

    def unpublished(self, bubbles: int, duration_ns: int) -> None:
        """Count ``bubbles`` of a held-back step that its rank announced to no one (their time, all held back)."""
        self.bubbles += bubbles
        self.bubble_ns = _sat(self.bubble_ns, duration_ns)
        self.withheld_ended("held_back", duration_ns, granted=False)

    def rank_gone(self) -> None:
        """The rank training here is gone: its span is trained time, the next rank's starts anew."""
        if self._first_event_ns:
            self._trained_before_ns += max(0, self._last_event_ns - self._first_event_ns)
            self._first_event_ns = 0

    def add_used(self, busy_ns: int) -> None:
        """Count a grant's own account as used: a grant the scheduler no longer (or never) tracked."""
        self.used_ns = _sat(self.used_ns, busy_ns)

    def reported(self, state: GrantState, done: p.GrantDone) -> None:
        """Keep ``done``, the report of the grant ``state``, until the grant is settled."""
        state.returned = True
        if done.armed:
            self.armed_grants += 1 if done.steps else 0
            if done.cpu_at_start_ns >= 0:  # read as the worker took it, before its first step
                state.cpu_at_grant = done.cpu_at_start_ns
        state.busy_ns = done.busy_ns
        state.last_step_end_ns = done.last_step_end_ns
        state.overrun_ns = done.overrun_ns
        state.cpu_done = done.cpu_ns
        state.last_step_start_ns, state.cpu_at_last_step = done.last_step_start_ns, done.cpu_at_last_step_ns

    def settle(self, state: GrantState) -> None:
        """Account for a grant once its report and its bubble's end are both known.

        "Used" is the side-task compute that ran inside the bubble: CPU time
        between the grant and the bubble's end (never more than the wall time of
        the task's steps inside it), so a task that waited for its core uses
        nothing. Interference is the compute that ran after the end: on a GPU,
        which does not preempt a running kernel, that time is taken from
        training. Where the end was handled after the task's report (the
        manager reads rank events in batches while no decision waits on them),
        the clock was not read at the end: the last step's CPU time past the
        end is what it ran beyond the wall time it had inside the bubble, the
        core being the task's alone while the stage waited (see
        :func:`_cpu_past_end`). Where the task's CPU clock could not be read,
        and on a CUDA device (the worker sleeps while its kernels run), wall
        times stand in.
        """
        end = state.bubble_end_ns
        late = max(0, state.last_step_end_ns - end if end and state.last_step_end_ns else state.overrun_ns)
        if late > 0:
            self.overruns += 1
            self.overrun_ns = _sat(self.overrun_ns, late)
        # the side work that held the core while the stage waited for it was not used bubble time
        inside_wall = max(0, state.busy_ns - late - state.stage_waited_ns)
        used = inside_wall
        clocked = self._by_cpu_clock and state.cpu_done >= 0
        if clocked and state.cpu_at_grant >= 0:
            upto = state.cpu_done if state.cpu_at_end < 0 else min(state.cpu_done, state.cpu_at_end)
            used = min(max(0, upto - state.cpu_at_grant), inside_wall)
        self.used_ns = _sat(self.used_ns, used)
        # A clock read at the end's handling after the task's last step had ended (the end was read
        # late, in a batch) is no reading at the end, as for a report that came first: estimated.
        read_at_end = state.cpu_at_end >= 0 and not (late > 0 and state.cpu_at_end >= state.cpu_done)
        if clocked and read_at_end:
            interference = max(0, state.cpu_done - state.cpu_at_end)
        elif late > 0 and clocked and state.cpu_at_grant >= 0:
            interference = _cpu_past_end(state, late)
        else:
            interference = late
        interference += state.stage_waited_ns
        self._guard.settled(state.deadline_ns - state.bubble_t_ns, used, interference)
        if interference > 0:
            task = state.task
            self.interference_ns = _sat(self.interference_ns, interference)
            self._guard.add_interference(interference)
            self._task_interference[task.task_id] = _sat(self._task_interference.get(task.task_id, 0), interference)
            if self._observers is not None:
                self._observers.interference(
                    self.device,
                    task.task_id,
                    task.name,
                    end or state.last_step_end_ns - late,
                    interference,
                    stage_wait_ns=state.stage_waited_ns,
                )

    @staticmethod
    def _charge_stage_wait(grants: list[GrantState], free_until_ns: int, waited_ns: int) -> None:
        """Charge the stage's wait for its core at a bubble's end to the grant whose step held it.

        The stage was free until ``free_until_ns`` and then runnable for
        ``waited_ns`` (its schedstat run delay): if a side task of this bubble
        was still in a step then (its grant not back, or back with a step that
        ended after that), that wait is training time lost to side work, as a
        side kernel holding a GPU past a bubble's end is. With no such grant it
        is other load on the machine, and charged to no one.
        """
        for state in grants:
            if state.bubble_end_ns == 0 and (not state.returned or state.last_step_end_ns > free_until_ns):
                state.stage_waited_ns = waited_ns
                return


def _cpu_past_end(state: GrantState, late: int) -> int:
    """The CPU time a returned grant's task ran past its bubble's end, where its clock was not read at the end.

    At most the wall time past the end (``late``) and the grant's whole CPU
    time. Where the last step's start and the CPU clock then are known, the
    step ran on its core alone until the end (the stage was waiting: nothing
    else of the job needs the core in a bubble), so what it ran past the end is
    its CPU time less its wall time inside the bubble. On a shared core the
    stage preempts the step once the bubble ends: the step's wall time past the
    end then counts the stage's own compute, its CPU time does not.
    """
    bound = min(late, max(0, state.cpu_done - state.cpu_at_grant))
    if state.cpu_at_last_step < 0 or not state.last_step_start_ns or not state.bubble_end_ns:
        return bound
    inside = max(0, state.bubble_end_ns - state.last_step_start_ns)
    return min(bound, max(0, state.cpu_done - state.cpu_at_last_step - inside))


class LedgerView:
    """The ledger's counts and views, read on the object that keeps the ledger (a device's scheduler)."""

    ledger: DeviceLedger

    @property
    def bubbles(self) -> int:
        return self.ledger.bubbles

    @property
    def bubble_ns(self) -> int:
        return self.ledger.bubble_ns

    @property
    def used_ns(self) -> int:
        return self.ledger.used_ns

    @property
    def overruns(self) -> int:
        return self.ledger.overruns

    @property
    def overrun_ns(self) -> int:
        return self.ledger.overrun_ns

    @property
    def interference_ns(self) -> int:
        """Side-task compute after bubble ends: what a GPU, which does not preempt, would take from training."""
        return self.ledger.interference_ns

    @property
    def armed_grants(self) -> int:
        """Grants whose first step started on the rank's own event."""
        return self.ledger.armed_grants

    @property
    def left_out(self) -> int:
        """Bubbles that got no grant because the guard found bubbles that short too costly."""
        return self.ledger.left_out

    @property
    def held_back_ns(self) -> int:
        """Bubble time held back to measure the job's cost (see :mod:`freeride.holdback`)."""
        return self.ledger.held_back_ns

    @property
    def backed_off_ns(self) -> int:
        """Bubble time left out for the job's slowdown budget (see :mod:`freeride.serve.budget`)."""
        return self.ledger.backed_off_ns

    @property
    def first_seen_ns(self) -> int:
        return self.ledger.first_seen_ns

    def status(self, info: DeviceInfo, *, gpu_uuid: str = "") -> p.DeviceStatus:
        """This device's status: who trains here (``info``), what its bubbles were used for, its GPU's UUID."""
        return self.ledger.status(info, gpu_uuid=gpu_uuid)

    def typical_bubble_ns(self, info: DeviceInfo) -> int:
        """This device's typical bubble; 0 while unknown (see :meth:`DeviceLedger.typical_bubble_ns`)."""
        return self.ledger.typical_bubble_ns(info)

    def train_ns(self, *, alive: bool) -> int:
        """Wall time ranks have trained here (see :meth:`DeviceLedger.train_ns`)."""
        return self.ledger.train_ns(alive=alive)

    def task_interference_ns(self, task_id: int) -> int:
        return self.ledger.task_interference_ns(task_id)

    def bubble_share(self) -> float:
        return self.ledger.bubble_share()
