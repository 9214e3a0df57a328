"""One scheduler per device: hands each bubble to the side tasks placed there.

Everything reaches it by a synchronous call on the manager's event loop: bubble
events from the events loop (the latency-critical path), task changes and
grant reports from the supervisor. It grants and revokes through each task's
:class:`~freeride.serve.runners.Runner` and never asks what kind of task that is.

Side tasks of a device take turns, as kernels of several processes would on
one GPU. When a bubble starts, the scheduler grants it to the next task (round
robin) whose estimated step fits in the bubble; a task that gives the grant
back early (its next step no longer fits, or it finished) passes the rest of
the bubble on to another task whose step does fit. Fillers (``TaskSpec.fill``)
come after every other task: they take what is left of a bubble once the
others gave it back, so short steps fill the ends that long ones cannot. When
the bubble ends the grant is revoked. All accounting of bubble time and its
use lives here.

Armed grants shorten the path from a bubble's start to a step's: when a bubble
ends, the task next in turn is armed for the next one (where the rank publishes
its bubble starts), so its worker starts on the rank's own event instead of
waiting for this scheduler's Grant. The scheduler still sees that event, counts
the armed task as the bubble's holder (an arm, once out, is always honoured:
the worker may already run) and sends the same Grant, which a worker that
missed the event starts from.

All accounting feeds the device's :class:`~freeride.serve.guard.InterferenceGuard`, which
sets the margin grants carry and the factor their deadlines are set by.

Each event costs O(1) in the number of events seen: the grants in flight are at
most one per task still placed here (those of a task that leaves go with it),
and every sum saturates at 2**63 - 1, so no sender can make a total that the
status reply could not encode.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from freeride import protocol as p
from freeride.admission import room_ns
from freeride.clock import MONOTONIC, Clock
from freeride.observe.base import Observers
from freeride.observe.stats import LatencyRecorder
from freeride.profile import typical_bubble_ns
from freeride.serve.costs import TrainingCosts, Withheld
from freeride.serve.guard import DEFAULT_TARGET, GuardConfig, InterferenceGuard
from freeride.serve.nobubbles import no_bubbles
from freeride.serve.ranks import DeviceInfo
from freeride.serve.slowsteps import SlowSteps
from freeride.serve.tasks import TaskRecord

__all__ = [
    "PACK_ROOM_NS",
    "PROBE_AFTER_BUBBLES",
    "PROBE_BUBBLE_SHARE",
    "RECENT_BUBBLES",
    "MIN_BUBBLES_SEEN",
    "DeviceScheduler",
    "Overdue",
]

logger = logging.getLogger(__name__)


def _sat(total: int, more: int) -> int:
    """``total + more``, held at the largest value the wire carries."""
    return min(p.I64_MAX, total + more)


PACK_ROOM_NS = 200_000
"""A packing task is granted what is left of a bubble down to this much, whatever its whole step needs."""

RECENT_BUBBLES = 256
"""Bubble lengths a device keeps (see :meth:`DeviceScheduler.typical_bubble_ns`)."""
MIN_BUBBLES_SEEN = 16
"""Bubbles that must have ended on a device before their lengths replace the profile's."""

PROBE_AFTER_BUBBLES = 20
"""A task whose estimate has not fit this many bubbles in a row gets a one-step probe."""

PROBE_BUBBLE_SHARE = 0.5
"""A probe (a step whose estimate is unknown or does not fit) goes only to a bubble expected to last at least
this share of the longest of the last :data:`PROBE_AFTER_BUBBLES`: a step that may be long is run where it can
best end in time (a VGG-19 piece of 55 ms, estimated at 3 ms in an earlier batch, overran 2-4 ms bubbles by
50 ms where the job also had bubbles of 40 ms)."""


class Overdue(NamedTuple):
    """A grant still out past its grace (see :meth:`DeviceScheduler.overdue`)."""

    task: TaskRecord
    late_ns: int
    """How long past its bubble's end."""
    thawed_ns: int
    """How long its step ran in bubbles since it was frozen as slow (-1: not frozen)."""


@dataclass(slots=True)
class _GrantState:
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
    overrun_ns: int = 0
    """What the worker reported as past the grant's deadline (used if the bubble's end is never seen)."""
    armed: bool = False
    """Handed over by an arm: the worker may have started before this scheduler saw the bubble."""
    stage_waited_ns: int = 0
    """How long the stage then waited for its core, runnable, while this grant's step held it."""


@dataclass(slots=True)
class _Armed:
    task: TaskRecord
    grant_id: int
    early: p.GrantDone | None = None
    """The grant's report, if it came before its bubble's start did."""


class DeviceScheduler:
    """Grants the bubbles of one device to its side tasks.

    Args:
        device: The device's name.
        latency: Where bubble start -> first step delays are recorded.
        margin_ns: The margin to start from (the device's guard adapts it).
        interference_target: What the guard keeps interference under, as a share of training time.
        charge_stage_waits: Side tasks can hold the stage's core (they run at its own CPU
            priority): a stage's wait for its core at a bubble's end is charged to the step that
            was running. At nice 19 the stage preempts a side task at once, so a wait is other
            load's and is charged to no one.
        observers: Told of grants and interference.
        costs: What the jobs' measured costs leave to side work: no bubble of a held-back step
            is granted, nor one the slowdown budget leaves out.
        clock: Where the time comes from.
    """

    def __init__(
        self,
        device: str,
        *,
        latency: LatencyRecorder,
        margin_ns: int,
        interference_target: float = DEFAULT_TARGET,
        charge_stage_waits: bool = True,
        observers: Observers | None = None,
        costs: TrainingCosts | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.device = device
        self._costs = costs
        self._charge_stage_waits = charge_stage_waits
        self.guard = InterferenceGuard(GuardConfig(target=interference_target, margin_ns=margin_ns))
        """Sets the margin and the bubbles' prediction factor from the interference measured here."""
        self.tasks: list[TaskRecord] = []
        self._observers = observers
        self._latency = latency
        self._clock = clock
        # bubble state
        self._bubble: p.BubbleStarted | None = None
        self._deadline_ns = 0
        self._tried: set[int] = set()
        self._granted_in_bubble = False
        self._left_out = False
        """The current bubble is too short for the guard: no grant in it."""
        self._withheld: Withheld = ""
        """Why the current bubble goes to no side task for its job's cost ("" it may go to one)."""
        self._rank = -1
        """The rank whose bubbles came last (-1: none yet)."""
        self._recent_expected: deque[int] = deque(maxlen=PROBE_AFTER_BUBBLES)
        """The expected lengths (factor applied) of the last bubbles, this one's included."""
        self._starved: dict[int, int] = {}
        """Consecutive bubbles a task's estimate kept it out of."""
        self._no_fit: dict[int, tuple[int, str]] = {}
        """Bubbles a task's estimate kept it out of in all, and why the last time (for status)."""
        self._kept_out: set[int] = set()
        """Tasks kept out of the current bubble (each counted once per bubble)."""
        self._holder: int | None = None
        self._grants: dict[int, _GrantState] = {}
        self._next_grant = 1
        self._rr = 0
        self.bubbles_endpoint = ""
        """Where the rank training here publishes its bubble starts ("" none: no arming)."""
        self._armed: _Armed | None = None
        self._last_start_ns = 0
        self.armed_grants = 0
        """Grants whose first step started on the rank's own event."""
        self.left_out = 0
        """Bubbles that got no grant because the guard found bubbles that short too costly."""
        self.held_back_ns = 0
        """Bubble time held back to measure the job's cost (see :mod:`freeride.serve.holdback`)."""
        self.backed_off_ns = 0
        """Bubble time left out for the job's slowdown budget (see :mod:`freeride.serve.budget`)."""
        # accounting
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
        self.first_seen_ns = clock.now_ns()
        self._first_event_ns = 0
        """First bubble event of the rank training here now (0: none since the last one left)."""
        self._last_event_ns = 0
        self._trained_before_ns = 0
        """Training time of the ranks that trained here before (each from its first event to its last)."""
        self.slow = SlowSteps(clock=clock)
        """Steps too slow for their bubble, frozen between bubbles; while one runs, it has the bubbles."""

    # -- public views ---------------------------------------------------------

    def status(self, info: DeviceInfo) -> p.DeviceStatus:
        """This device's status: who trains here (``info``) and what its bubbles were used for."""
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
            margin_ns=self.guard.margin_ns,
            prediction_factor=self.guard.factor,
            min_bubble_ns=self.guard.min_bubble_ns,
            left_out=self.left_out,
            guard_reason=self.guard.reason,
            no_bubbles=no_bubbles(info),
            typical_bubble_ns=self.typical_bubble_ns(info),
            held_back_ns=self.held_back_ns,
            backed_off_ns=self.backed_off_ns,
        )

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

    @property
    def in_use(self) -> bool:
        """Side tasks are placed here, or grants are out: the device must not be forgotten."""
        return bool(self.tasks) or bool(self._grants)

    def forget_task(self, task_id: int) -> None:
        """Drop what is kept about a task that left the manager's table."""
        self._task_interference.pop(task_id, None)
        self._starved.pop(task_id, None)
        self._no_fit.pop(task_id, None)

    def bubble_share(self) -> float:
        elapsed = self._clock.now_ns() - self.first_seen_ns
        return self.bubble_ns / elapsed if elapsed > 0 else 0.0

    def follow_rank(self, endpoint: str) -> None:
        """The rank training here publishes its bubble starts on ``endpoint`` ("": it does not)."""
        if endpoint == self.bubbles_endpoint:
            return
        self._disarm()
        self.bubbles_endpoint = endpoint
        self._arm_next()

    def backend_lost(self) -> None:
        """The rank training here is gone: stop handing out its bubble."""
        self._disarm()
        self.bubbles_endpoint = ""
        if self._first_event_ns:
            self._trained_before_ns += max(0, self._last_event_ns - self._first_event_ns)
            self._first_event_ns = 0
        if self._bubble is not None:
            self._revoke_current()
            self._bubble = None

    # -- events ---------------------------------------------------------------

    def on_bubble_started(self, ev: p.BubbleStarted) -> None:
        if self._bubble is not None:  # the end of the previous one was lost
            self._revoke_current()
            for grant_id, state in list(self._grants.items()):
                if state.returned and not state.bubble_end_ns:
                    self._settle(state)  # against the deadline: the best left to go by
                    del self._grants[grant_id]
        self._first_event_ns = self._first_event_ns or ev.t_ns
        self._last_event_ns = max(self._last_event_ns, ev.t_ns)
        self._bubble = ev
        self.slow.bubble_started()
        expected = self.guard.expected_ns(ev.expected_ns)
        self._deadline_ns = min(p.I64_MAX, ev.t_ns + expected)
        self._last_start_ns = max(self._last_start_ns, ev.t_ns)
        self._tried.clear()
        self._kept_out.clear()
        self._granted_in_bubble = False
        self.bubbles += 1
        self._recent_expected.append(expected)
        self._rank = ev.rank
        self._withheld = self._costs.withheld(ev.rank, ev.step, ev.index) if self._costs is not None else ""
        self._left_out = not self._withheld and not self.guard.grants(expected)
        if self._withheld == "held_back":
            pass  # measuring the job's cost: an armed worker knows these steps and waits on
        elif self._withheld == "backed_off":
            self._honour_arm()  # an arm from before the budget backed off is honoured: its worker may run
        elif self._left_out:
            self.left_out += 1  # too short to be worth its risk (the guard's judgement): an armed task waits on
        elif not self._honour_arm():
            self._grant_next(fresh=True)

    def on_bubble_ended(self, ev: p.BubbleEnded) -> None:
        # Bubble time stays what the rank measured (as the trace shows it); the stage's wait for
        # its core at the end is charged as interference to the step that held it, not as used.
        waited = min(ev.waited_runnable_ns, ev.duration_ns) if self._charge_stage_waits else 0
        if waited > 0:
            self._charge_stage_wait(ev.t_ns - waited, waited)
        self.bubble_ns = _sat(self.bubble_ns, ev.duration_ns)
        self._recent_bubbles.append(ev.duration_ns)
        self._first_event_ns = self._first_event_ns or max(0, ev.t_ns - ev.duration_ns)
        self._last_event_ns = max(self._last_event_ns, ev.t_ns)
        for state in self._grants.values():
            if state.bubble_end_ns == 0:
                state.bubble_end_ns = ev.t_ns
                if state.returned:
                    self._settle(state)
                elif state.task.runner is not None:
                    # What the task runs from here on is taken from training. Read before the
                    # revoke below, which freezes a program at once.
                    state.cpu_at_end = state.task.runner.cpu_ns()
        self._grants = {gid: s for gid, s in self._grants.items() if not s.returned}
        self.slow.bubble_ended()
        for state in self._grants.values():
            if state.task.slow:  # found too slow before: every overrun of it is frozen at once
                self.slow.freeze(state.task, in_bubble=False)
        self._revoke_current()
        bubble, self._bubble = self._bubble, None
        same = bubble is not None and bubble.index == ev.index and bubble.step == ev.step
        if same and self._withheld == "held_back":
            self.held_back_ns = _sat(self.held_back_ns, ev.duration_ns)
        elif same and self._withheld == "backed_off" and not self._granted_in_bubble:
            self.backed_off_ns = _sat(self.backed_off_ns, ev.duration_ns)
        self._withheld = ""
        if bubble is not None and same:
            shortest = self.guard.min_bubble_ns
            self.guard.bubble_ended(
                ev.t_ns, ev.duration_ns - waited, bubble.expected_ns, granted=self._granted_in_bubble
            )
            if self.guard.min_bubble_ns != shortest:
                self._disarm()  # armed with the old shortest bubble: armed again with the new one
        self._arm_next()

    def _charge_stage_wait(self, free_until_ns: int, waited_ns: int) -> None:
        """Charge the stage's wait for its core at a bubble's end to the grant whose step held it.

        The stage was free until ``free_until_ns`` and then runnable for
        ``waited_ns`` (its schedstat run delay): if a side task of this bubble
        was still in a step then (its grant not back, or back with a step that
        ended after that), that wait is training time lost to side work, as a
        side kernel holding a GPU past a bubble's end is. With no such grant it
        is other load on the machine, and charged to no one.
        """
        for state in self._grants.values():
            if state.bubble_end_ns == 0 and (not state.returned or state.last_step_end_ns > free_until_ns):
                state.stage_waited_ns = waited_ns
                return

    def on_task_changed(self, task: TaskRecord) -> None:
        """``task`` was placed here, became runnable or not, or left."""
        armed = self._armed
        if armed is not None and armed.task is task and not (task.runnable and task.runner is not None):
            self._disarm()
        if task.device != self.device or task.terminal:
            if task in self.tasks:
                self.tasks.remove(task)
            self._starved.pop(task.task_id, None)
            holder = self._holder
            held = self._grants.get(holder) if holder is not None else None
            # Its grants still out go with it (a report that comes later is counted as an
            # unknown grant's); one already returned waits for the bubble's end to be settled.
            gone = [gid for gid, state in self._grants.items() if state.task is task and not state.returned]
            for gid in gone:
                del self._grants[gid]
            if holder is not None and held is not None and held.task is task:
                self._holder = None
                self._grant_next(fresh=False)
            self._arm_next()
            return
        if task not in self.tasks:
            self.tasks.append(task)
        if task.runnable and self._holder is None and self._bubble is not None:
            self._grant_next(fresh=False)
        self._arm_next()

    def on_grant_done(self, task: TaskRecord, done: p.GrantDone) -> None:
        """A grant came back (``task`` has already taken its own share of the report)."""
        if self._observers is not None:
            self._observers.grant_done(self.device, task.task_id, task.name, done)
        if done.first_step_delay_ns >= 0:
            self._latency.record(done.first_step_delay_ns)
        armed = self._armed
        if armed is not None and armed.grant_id == done.grant_id and armed.task is task:
            # The worker took its bubble and gave it back before the rank's event reached
            # this scheduler: the report waits for that event, where the grant is handed over.
            armed.early = done
            return
        self._returned(task, done)

    def _returned(self, task: TaskRecord, done: p.GrantDone) -> None:
        if not any(st.task is task and not st.returned for gid, st in self._grants.items() if gid != done.grant_id):
            self.slow.release(task)  # its step ended: it runs freely again
        state = self._grants.get(done.grant_id)
        if state is None:  # a grant forgotten when its task left: all we know is its own account
            self.used_ns = _sat(self.used_ns, done.busy_ns)
        else:
            state.returned = True
            if done.armed:
                self.armed_grants += 1 if done.steps else 0
                if done.cpu_at_start_ns >= 0:  # read as the worker took it, before its first step
                    state.cpu_at_grant = done.cpu_at_start_ns
            state.busy_ns = done.busy_ns
            state.last_step_end_ns = done.last_step_end_ns
            state.overrun_ns = done.overrun_ns
            state.cpu_done = done.cpu_ns
            # Until the bubble's actual end is known the grant waits: the deadline is an
            # expectation, erring early on purpose, and work past the end is not "used".
            if state.bubble_end_ns:
                self._settle(state)
                self._grants.pop(done.grant_id)
        if self._holder == done.grant_id:
            self._holder = None
            # an armed task that did not fit took the bubble's start: the others get it as fresh
            fresh = state is not None and state.armed and done.steps == 0
            if fresh:
                self._starved[task.task_id] = self._starved.get(task.task_id, 0) + 1
            elif done.steps > 0:
                self._starved.pop(task.task_id, None)
            if done.reason in ("no_fit", "finished", "idle") and self._bubble is not None:
                self._grant_next(fresh=fresh)
        elif state is not None and self._bubble is not None and state.bubble_t_ns != self._bubble.t_ns:
            # A grant of an earlier bubble, back only now: its last step ran past that bubble's end
            # (on a CPU, the stage then preempts it until it blocks again) and its task was passed
            # over as still in a step when this bubble started. Nobody else took this bubble either
            # (or it would hold it): offer what is left of it now. In a 2-stage DeepSpeed job this
            # left 4-8 % of a stage's bubble time, whole bubbles of 18-20 ms, to no one.
            self._grant_next(fresh=False)
        self._arm_next()

    # -- liveness (the supervisor's hang detector calls these) ----------------

    def overdue(self, now_ns: int, grace_ns: Callable[[TaskRecord], int]) -> list[Overdue]:
        """Tasks holding a grant not given back ``grace_ns(task)`` after its bubble ended: slow or hung steps.

        Returns:
            Each such task once, with how long past its bubble's end (its
            deadline, where the end was not seen) the oldest such grant is.
        """
        late: dict[int, Overdue] = {}
        for state in self._grants.values():
            task = state.task
            if state.returned or task.runner is None:
                continue
            past = now_ns - (state.bubble_end_ns or state.deadline_ns)
            seen = late.get(task.task_id)
            if past > grace_ns(task) and (seen is None or past > seen.late_ns):
                late[task.task_id] = Overdue(task, past, self.slow.thawed_ns(task))
        return list(late.values())

    def freeze(self, task: TaskRecord) -> None:
        """``task``'s step is too slow for its bubble: it runs on in bubbles only, and has them to itself."""
        if self._armed is not None:
            self._disarm()
        self.slow.freeze(task, in_bubble=self._bubble is not None)

    def forget(self, task: TaskRecord) -> None:
        """Drop the grants ``task`` holds: its worker was killed and never answers for them."""
        self.slow.release(task)
        if self._armed is not None and self._armed.task is task:
            self._armed = None
        for grant_id, state in list(self._grants.items()):
            if state.task is task:
                del self._grants[grant_id]
                if self._holder == grant_id:
                    self._holder = None
                    self._grant_next(fresh=False)

    # -- granting -------------------------------------------------------------

    def _settle(self, state: _GrantState) -> None:
        """Account for a grant once its report and its bubble's end are both known.

        "Used" is the side-task compute that ran inside the bubble: CPU time
        between the grant and the bubble's end (never more than the wall time of
        the task's steps inside it), so a task that waited for its core uses
        nothing. Interference is the compute that ran after the end: on a GPU,
        which does not preempt a running kernel, that time is taken from
        training. Where the task's CPU clock could not be read (or the end was
        handled after the task's report), wall times stand in.
        """
        end = state.bubble_end_ns
        late = max(0, state.last_step_end_ns - end if end and state.last_step_end_ns else state.overrun_ns)
        if late > 0:
            self.overruns += 1
            self.overrun_ns = _sat(self.overrun_ns, late)
        # the side work that held the core while the stage waited for it was not used bubble time
        inside_wall = max(0, state.busy_ns - late - state.stage_waited_ns)
        used = inside_wall
        if state.cpu_done >= 0 and state.cpu_at_grant >= 0:
            upto = state.cpu_done if state.cpu_at_end < 0 else min(state.cpu_done, state.cpu_at_end)
            used = min(max(0, upto - state.cpu_at_grant), inside_wall)
        self.used_ns = _sat(self.used_ns, used)
        if state.cpu_done >= 0 and state.cpu_at_end >= 0:
            interference = max(0, state.cpu_done - state.cpu_at_end)
        elif late > 0 and state.cpu_done >= 0 and state.cpu_at_grant >= 0:
            interference = min(late, max(0, state.cpu_done - state.cpu_at_grant))
        else:
            interference = late
        interference += state.stage_waited_ns
        self.guard.settled(state.deadline_ns - state.bubble_t_ns, used, interference)
        if interference > 0:
            task = state.task
            self.interference_ns = _sat(self.interference_ns, interference)
            self.guard.add_interference(interference)
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

    def _revoke_current(self) -> None:
        if self._holder is None:
            return
        grant_id, self._holder = self._holder, None
        state = self._grants.get(grant_id)
        if state is not None and state.task.runner is not None:
            state.task.runner.revoke(grant_id)  # its report comes back through on_grant_done

    def no_fit(self, task_id: int) -> tuple[int, str]:
        """Bubbles ``task_id``'s estimated step did not fit, and why the last time."""
        return self._no_fit.get(task_id, (0, ""))

    def _count_no_fit(self, task_id: int, estimate_ns: int, room: int) -> None:
        if task_id in self._kept_out:
            return
        self._kept_out.add(task_id)
        count = self._no_fit.get(task_id, (0, ""))[0] + 1
        why = f"its step estimate {estimate_ns / 1e6:.3g} ms > the {room / 1e6:.3g} ms left in the bubble"
        self._no_fit[task_id] = (count, why)

    def _stuck(self, now: int) -> set[int]:
        """Tasks still in a step a full estimate after their last bubble's end.

        Such a task gets no grant (nor arm): it would sit unread in its socket
        while the bubble passes by the tasks that could use it.
        """
        return {
            st.task.task_id
            for st in self._grants.values()
            if not st.returned and (st.bubble_end_ns or st.deadline_ns) + max(st.task.estimate_ns, 0) < now
        }

    def _arm_next(self) -> None:
        """Between bubbles, arm the task next in turn, unless one is armed.

        A task next in turn that cannot be armed (its step time unknown, due for
        a probe, a program) leaves the next bubble unarmed: its start is granted
        in turn, where that task can get it. Arming the task after it instead
        would hand that one every bubble's start, and the first none at all.
        """
        if self._armed is not None or self._bubble is not None or not self.bubbles_endpoint or not self.tasks:
            return
        if self.slow.active:
            return
        if self._costs is not None and not self._costs.may_arm(self._rank):
            return  # the budget leaves bubbles out, and the worker could not tell which
        stuck = self._stuck(self._clock.now_ns())
        for k in self._turns():
            task = self.tasks[(self._rr + k) % len(self.tasks)]
            if not task.runnable or task.runner is None or task.task_id in stuck:
                continue
            if task.estimate_ns < 0 or task.spec.kind != "iterative":
                return  # a probe or a program: only a Grant at a bubble's start serves it
            if self._starved.get(task.task_id, 0) + 1 >= PROBE_AFTER_BUBBLES:
                return  # due for a probe, which only a Grant gives
            arm = p.Arm(
                grant_id=self._next_grant,
                endpoint=self.bubbles_endpoint,
                after_ns=self._last_start_ns,
                margin_ns=self.guard.margin_ns,
                prediction_factor=self.guard.factor,
                min_bubble_ns=self.guard.min_bubble_ns,
                holdback=self._costs.holdback(self._rank) if self._costs is not None else None,
            )
            if not task.runner.arm(arm):
                continue  # the worker's socket refused
            self._next_grant += 1
            self._rr = (self._rr + k + 1) % len(self.tasks)
            self._armed = _Armed(task=task, grant_id=arm.grant_id)
            return

    def _disarm(self) -> None:
        armed, self._armed = self._armed, None
        if armed is None:
            return
        if armed.early is not None:  # ran on a bubble this scheduler never saw: its own account
            self.used_ns = _sat(self.used_ns, armed.early.busy_ns)
        elif armed.task.runner is not None:
            armed.task.runner.disarm(armed.grant_id)

    def _honour_arm(self) -> bool:
        """Make the armed task the holder of the bubble just started; False if none is armed."""
        armed, self._armed = self._armed, None
        bubble = self._bubble
        if armed is None or bubble is None or armed.task not in self.tasks or armed.task.runner is None:
            return False
        runner = armed.task.runner
        if armed.early is None:
            # the Grant a worker that missed the rank's event starts from (one that did not ignores it)
            runner.grant(
                p.Grant(
                    grant_id=armed.grant_id,
                    bubble_t_ns=bubble.t_ns,
                    deadline_ns=self._deadline_ns,
                    margin_ns=self.guard.margin_ns,
                )
            )
        self._tried.add(armed.task.task_id)
        self._granted_in_bubble = True
        self._holder = armed.grant_id
        self._grants[armed.grant_id] = _GrantState(
            task=armed.task,
            bubble_t_ns=bubble.t_ns,
            deadline_ns=self._deadline_ns,
            cpu_at_grant=runner.cpu_at_grant(),
            armed=True,
        )
        if armed.early is not None:
            self._returned(armed.task, armed.early)
        return True

    def _probe_due(self, task_id: int, *, fresh: bool) -> bool:
        """Count a bubble's start the task is shut out of; whether it is now due a probe step in this one."""
        starved = self._starved.get(task_id, 0) + (1 if fresh else 0)
        self._starved[task_id] = starved
        return fresh and starved >= PROBE_AFTER_BUBBLES and self._long_bubble()

    def _long_bubble(self) -> bool:
        """Whether the current bubble is long enough for a probe (see :data:`PROBE_BUBBLE_SHARE`)."""
        expected = self._recent_expected[-1] if self._recent_expected else 0
        return expected >= PROBE_BUBBLE_SHARE * max(self._recent_expected, default=0)

    def _turns(self) -> list[int]:
        """Offsets from the task served last, in the order tasks get their turn: fillers after every other."""
        n = len(self.tasks)
        return sorted(range(n), key=lambda k: self.tasks[(self._rr + k) % n].spec.fill)

    def _grant_next(self, *, fresh: bool) -> None:
        if self._bubble is None or self._holder is not None or not self.tasks or self._left_out or self._withheld:
            return
        if self.slow.active:
            return  # a slow step has the bubbles to itself until it ends
        margin = self.guard.margin_ns
        remaining = room_ns(self._clock.now_ns(), self._deadline_ns, margin)
        if remaining <= 0:
            return
        now = self._clock.now_ns()
        stuck = self._stuck(now)
        n = len(self.tasks)
        for k in self._turns():
            task = self.tasks[(self._rr + k) % n]
            if not task.runnable or task.task_id in self._tried or task.task_id in stuck:
                continue
            estimate = task.estimate_ns
            probe = packing = False
            if task.packs and remaining >= PACK_ROOM_NS and (estimate > remaining or estimate < 0):
                # Its worker offers the largest piece that fits, or gives the grant back at once. A
                # pending piece that cannot be split (a partitioned task's optimizer chunk, say) may
                # never fit: counted as for any task (a grant with steps resets it), it gets its probe.
                packing = True
                probe = self._probe_due(task.task_id, fresh=fresh)
            elif estimate > remaining:
                # An estimate is only corrected by running steps: a task shut out of
                # bubble after bubble gets one step at the start of a bubble now and then.
                probe = self._probe_due(task.task_id, fresh=fresh)
                self._count_no_fit(task.task_id, estimate, remaining)
                if not probe:
                    continue
            elif estimate < 0 and not (fresh and self._long_bubble()):
                continue  # a task whose step time is unknown probes only at the start of a long bubble
            if not packing or probe:
                self._starved.pop(task.task_id, None)
            grant_id = self._next_grant
            self._next_grant += 1
            self._tried.add(task.task_id)
            self._rr = (self._rr + k + 1) % n
            grant = p.Grant(
                grant_id=grant_id,
                bubble_t_ns=self._bubble.t_ns,
                deadline_ns=self._deadline_ns,
                probe=probe,
                margin_ns=margin,
            )
            if task.runner is None or not task.runner.grant(grant):
                continue
            state = _GrantState(
                task=task,
                bubble_t_ns=self._bubble.t_ns,
                deadline_ns=self._deadline_ns,
                cpu_at_grant=task.runner.cpu_at_grant(),
            )
            self._holder = grant_id
            self._grants[grant_id] = state
            self._granted_in_bubble = True
            return
