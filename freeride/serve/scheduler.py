"""One scheduler per device: hands each bubble to the side tasks placed there.

Everything reaches it by a synchronous call on the manager's event loop: bubble
events from the events loop (the latency-critical path), task changes and
grant reports from the supervisor. It grants and revokes through each task's
:class:`~freeride.serve.runners.Runner`; it asks what kind of task that is only
to arm one (see :mod:`~freeride.serve.arming`: only an iterative worker can be
armed).

Side tasks of a device take turns, as kernels of several processes would on
one GPU. When a bubble starts, the scheduler grants it to the next task (round
robin) whose estimated step fits in the bubble; a task that gives the grant
back early (its next step no longer fits, or it finished) passes the rest of
the bubble on to another task whose step does fit. Fillers (``IterativeSpec.fill``)
come after every other task: they take what is left of a bubble once the
others gave it back, so short steps fill the ends that long ones cannot. When
the bubble ends the grant is revoked.

The scheduler decides and its collaborators keep the rest: the order of
turns and what each task may be offered (:mod:`~freeride.serve.turns`), the
arm out (:mod:`~freeride.serve.arming`), the accounting of bubble time and its use,
which feeds the device's :class:`~freeride.serve.guard.InterferenceGuard`
(:mod:`~freeride.serve.ledger`), the tasks shut out and due a probe
(:mod:`~freeride.serve.probes`) and the steps frozen as slow
(:mod:`~freeride.serve.slowsteps`).

Each event costs O(1) in the number of events seen: the grants in flight are at
most one per task still placed here (those of a task that leaves go with it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from freeride import protocol as p
from freeride.admission import room_ns
from freeride.clock import MONOTONIC, Clock
from freeride.observe.base import Observers
from freeride.observe.stats import LatencyRecorder
from freeride.serve.arming import DeviceArming
from freeride.serve.costs import TrainingCosts, Withheld
from freeride.serve.gates import DeviceGate
from freeride.serve.guard import DEFAULT_TARGET, GuardConfig, InterferenceGuard
from freeride.serve.ledger import MIN_BUBBLES_SEEN, RECENT_BUBBLES, DeviceLedger, GrantState, LedgerView
from freeride.serve.probes import PROBE_AFTER_BUBBLES, PROBE_BUBBLE_SHARE, Probes
from freeride.serve.slowsteps import Overdue, SlowSteps
from freeride.serve.tasks import TaskRecord
from freeride.serve.turns import Turns

__all__ = [
    "PROBE_AFTER_BUBBLES",
    "PROBE_BUBBLE_SHARE",
    "RECENT_BUBBLES",
    "MIN_BUBBLES_SEEN",
    "DeviceScheduler",
    "Overdue",
]

logger = logging.getLogger(__name__)


class DeviceScheduler(LedgerView):
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
        gate: The device's bubble gate (``serve --device-gate``; None: side work is released on the host).
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
        gate: DeviceGate | None = None,
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
        self.ledger = DeviceLedger(device, guard=self.guard, observers=observers, clock=clock)
        """What the bubbles here lasted, and what side work used and took (read on the scheduler: see LedgerView)."""
        self._arming = DeviceArming(self.ledger, gate)
        self._probes = Probes()
        # bubble state
        self._bubble: p.BubbleStarted | None = None
        self._deadline_ns = 0
        self._tried: set[int] = set()
        self._granted_in_bubble = False
        self._left_out = False
        """The current bubble is too short for the guard: no grant in it."""
        self._counted_only = False
        """The current (or last) bubble came with no side work here: counted, nothing decided."""
        self._withheld: Withheld = ""
        """Why the current bubble goes to no side task for its job's cost ("" it may go to one)."""
        self._rank = -1
        """The rank whose bubbles came last (-1: none yet)."""
        self._holder: int | None = None
        self._grants: dict[int, GrantState] = {}
        self._next_grant = 1
        self._turns = Turns(self._probes)
        self.slow = SlowSteps(clock=clock)
        """Steps too slow for their bubble, frozen between bubbles; while one runs, it has the bubbles."""

    # -- public views ---------------------------------------------------------

    @property
    def bubbles_endpoint(self) -> str:
        """Where the rank training here publishes its bubble starts ("" none: no arming)."""
        return self._arming.endpoint

    def no_fit(self, task_id: int) -> tuple[int, str]:
        """Bubbles ``task_id``'s estimated step did not fit, and why the last time."""
        return self._probes.no_fit(task_id)

    @property
    def in_use(self) -> bool:
        """Side tasks are placed here, or grants are out: the device must not be forgotten."""
        return bool(self.tasks) or bool(self._grants)

    def forget_task(self, task_id: int) -> None:
        """Drop what is kept about a task that left the manager's table."""
        self.ledger.forget_task(task_id)
        self._probes.forget(task_id)

    def follow_rank(self, endpoint: str) -> None:
        """The rank training here publishes its bubble starts on ``endpoint`` ("": it does not)."""
        if endpoint == self._arming.endpoint:
            return
        self._arming.disarm()
        self._arming.endpoint = endpoint
        self._arm_next()

    @property
    def edge_due(self) -> bool:
        """Whether a decision here waits on a bubble's start or end: the manager must read this rank's events at once.

        None does while the bubble, or the next one, is an armed worker's that
        hears the rank (it starts on the rank's start and stops at its end by
        itself, and its report wakes the manager), nor on a device with no side
        work. A grant a program holds (frozen at the end), a task next in turn
        that cannot be armed, or a step frozen as slow does.
        """
        if self._idle:
            return False
        if self.slow.active:
            return True
        if self._holder is not None:
            state = self._grants.get(self._holder)
            return state is None or not self._arming.follows(state.task)
        armed = self._arming.armed
        return armed is None or not self._arming.follows(armed.task)

    @property
    def wants_bubbles(self) -> bool:
        """Whether the manager should follow this device's bubbles even with no side work placed here.

        Its first bubbles are: what they last tells the first task placed here its typical bubble.
        """
        return self.in_use or not self.ledger.learned

    def followed_again(self) -> None:
        """The manager follows this device's bubbles again after a time without side work here."""
        self.guard.unseen()

    def backend_lost(self) -> None:
        """The rank training here is gone: stop handing out its bubble (and open the gate it would have opened)."""
        self._arming.rank_gone()
        self._arming.endpoint = ""
        self.ledger.rank_gone()
        if self._bubble is not None:
            self._revoke_current()
            self._bubble = None

    # -- events ---------------------------------------------------------------

    @property
    def _idle(self) -> bool:
        """No side work is here, nor any of its grants or frozen steps: a bubble needs counting only."""
        return not self.tasks and not self._grants and not self.slow.active

    def on_bubble_started(self, ev: p.BubbleStarted) -> None:
        if self._idle:
            # No side work here: the bubble is counted and nothing decided, as for a device
            # the manager does not follow (D50); a task placed before its end opens it then.
            self.ledger.bubble_started(ev)
            self._bubble, self._rank, self._counted_only = ev, ev.rank, True
            return
        if self._bubble is not None:  # the end of the previous one was lost
            self._revoke_current()
            for grant_id, state in list(self._grants.items()):
                if state.returned and not state.bubble_end_ns:
                    self.ledger.settle(state)  # against the deadline: the best left to go by
                    del self._grants[grant_id]
        self.ledger.bubble_started(ev)
        self._bubble = ev
        self._open(ev)

    def _open(self, ev: p.BubbleStarted) -> None:
        """Decide what the bubble ``ev``, counted already, goes to: a grant, an armed task, or nothing."""
        self._counted_only = False
        self.slow.bubble_started()
        expected = self.guard.expected_ns(ev.expected_ns)
        self._deadline_ns = min(p.I64_MAX, ev.t_ns + expected)
        self._arming.saw_start(ev.t_ns)
        self._tried.clear()
        self._granted_in_bubble = False
        self._probes.bubble_started(expected)
        self._rank = ev.rank
        self._withheld = self._costs.withheld(ev.rank, ev.step, ev.index) if self._costs is not None else ""
        self._left_out = not self._withheld and not self.guard.grants(expected)
        if self._withheld == "held_back":
            pass  # measuring the job's cost: an armed worker knows these steps and waits on
        elif self._withheld == "backed_off":
            if self._arming.takes(ev):  # armed with a larger share than now: its worker may run
                self._honour_arm()
        elif self._left_out:
            self.ledger.left_out += 1  # too short to be worth its risk (the guard's judgement): an armed task waits on
        elif self._arming.armed is not None and not self._arming.takes(ev):
            if (gated := self._arming.gated) is not None:  # too short for the step it queued behind the gate:
                self._tried.add(gated.task_id)  # the arm waits for the next bubble, the others may have this one
            else:
                self._arming.disarm()  # armed with a smaller share than now: its worker lets this bubble pass
            self._grant_next(fresh=True)
        elif not self._honour_arm():
            self._grant_next(fresh=True)

    def on_bubble_ended(self, ev: p.BubbleEnded) -> None:
        if self._idle:  # no side work here: the bubble is counted, and the guard has not seen it
            self.ledger.bubble_ended(ev, 0, ())
            self._bubble, self._counted_only = None, False
            self.guard.unseen()
            return
        # Bubble time stays what the rank measured (as the trace shows it); the stage's wait for
        # its core at the end is charged as interference to the step that held it, not as used.
        waited = min(ev.waited_runnable_ns, ev.duration_ns) if self._charge_stage_waits else 0
        self.ledger.bubble_ended(ev, waited, self._grants.values())
        self._grants = {gid: s for gid, s in self._grants.items() if not s.returned}
        self._arming.bubble_ended(ev.t_ns - ev.duration_ns, self._grants.values())
        self.slow.bubble_ended()
        for state in self._grants.values():
            if state.task.slow:  # found too slow before: every overrun of it is frozen at once
                self.slow.freeze(state.task, in_bubble=False)
        self._revoke_current()
        bubble, self._bubble = self._bubble, None
        same = bubble is not None and bubble.index == ev.index and bubble.step == ev.step
        if same:
            self.ledger.withheld_ended(self._withheld, ev.duration_ns, granted=self._granted_in_bubble)
        self._withheld = ""
        if bubble is not None and same:
            self.guard.bubble_ended(
                ev.t_ns, ev.duration_ns - waited, bubble.expected_ns, granted=self._granted_in_bubble
            )
            if self._arming.stale(self.guard, self._harvest_share()):
                self._arming.disarm()  # armed with the guard's old margin, factor, shortest bubble or share: again
        self._arm_next()

    def on_task_changed(self, task: TaskRecord) -> None:
        """``task`` was placed here, became runnable or not, or left."""
        if self._arming.holds(task) and not (task.runnable and task.runner is not None):
            self._arming.disarm()
        if task.device != self.device or task.terminal:
            if task in self.tasks:
                self.tasks.remove(task)
            self._arming.forget_slot(task)
            self._probes.reset(task.task_id)
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
            if self._counted_only and self._bubble is not None:
                self._open(self._bubble)  # the first task here, placed in a bubble: it may have the rest
        if task.runnable and self._holder is None and self._bubble is not None:
            self._grant_next(fresh=False)
        self._arm_next()

    def on_grant_done(self, task: TaskRecord, done: p.GrantDone) -> None:
        """A grant came back (``task`` has already taken its own share of the report)."""
        if self._observers is not None:
            self._observers.grant_done(self.device, task.task_id, task.name, done)
        if done.first_step_delay_ns >= 0:
            self._latency.record(done.first_step_delay_ns)
        if done.armed:
            self._arming.took_event(task)
        if self._arming.hold_early(task, done):
            # The worker took its bubble and gave it back before the rank's event reached
            # this scheduler: the report waits for that event, where the grant is handed over.
            return
        self._returned(task, done)

    def _returned(self, task: TaskRecord, done: p.GrantDone) -> None:
        if task in self.slow and not any(
            st.task is task and not st.returned for gid, st in self._grants.items() if gid != done.grant_id
        ):
            self.slow.release(task)  # its step ended: it runs freely again
        self._arming.returned(task)
        state = self._grants.get(done.grant_id)
        if state is None:  # a grant forgotten when its task left: all we know is its own account
            self.ledger.add_used(done.busy_ns)
        else:
            self.ledger.reported(state, done)
            # Until the bubble's actual end is known the grant waits: the deadline is an
            # expectation, erring early on purpose, and work past the end is not "used".
            if state.bubble_end_ns:
                self.ledger.settle(state)
                self._grants.pop(done.grant_id)
        if self._holder == done.grant_id:
            self._holder = None
            # an armed task that did not fit took the bubble's start: the others get it as fresh
            fresh = state is not None and state.armed and done.steps == 0
            if fresh:
                self._probes.passed_over(task.task_id)
            elif done.steps > 0:
                self._probes.reset(task.task_id)
            elif task.fill and done.reason == "no_fit":
                self._probes.tail_refused(task.task_id)  # a tail it found no piece for
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
        """Tasks holding a grant not given back ``grace_ns(task)`` after its bubble ended: slow or hung steps."""
        return self.slow.overdue(self._grants.values(), now_ns, grace_ns)

    def freeze(self, task: TaskRecord) -> None:
        """``task``'s step is too slow for its bubble: it runs on in bubbles only, and has them to itself."""
        self._arming.disarm()
        self.slow.freeze(task, in_bubble=self._bubble is not None)

    def forget(self, task: TaskRecord) -> None:
        """Drop the grants ``task`` holds: its worker was killed and never answers for them."""
        self.slow.release(task)
        self._arming.drop(task)
        for grant_id, state in list(self._grants.items()):
            if state.task is task:
                del self._grants[grant_id]
                if self._holder == grant_id:
                    self._holder = None
                    self._grant_next(fresh=False)

    # -- granting -------------------------------------------------------------

    def _revoke_current(self) -> None:
        if self._holder is None:
            return
        grant_id, self._holder = self._holder, None
        state = self._grants.get(grant_id)
        if state is not None and state.task.runner is not None:
            state.task.runner.revoke(grant_id)  # its report comes back through on_grant_done

    def _stuck(self, now: int) -> set[int]:
        """Tasks still in a step a full estimate after their last bubble's end: no grant (nor arm) goes to them,
        to sit unread in their sockets while the bubble passes by the tasks that could use it."""
        return {st.task.task_id for st in self._grants.values() if st.stuck(now)}

    def _arm_next(self) -> None:
        """Arm the task next in turn for the next bubble, unless one is armed or the bubble is still held.

        Arming as soon as a bubble is given back, rather than at its end, lets
        the manager leave the end to the worker (it reads the rank's ends
        itself): nothing of the manager's waits on the end, and the Arm reaches
        the worker while its core is still in the bubble.

        A task next in turn that cannot be armed (its step time unknown, due for
        a probe, a program) leaves the next bubble unarmed: its start is granted
        in turn, where that task can get it. Arming the task after it instead
        would hand that one every bubble's start, and the first none at all.
        """
        arming = self._arming
        if arming.armed is not None or not arming.endpoint or not self.tasks:
            return
        if self._bubble is not None and self._holder is not None:
            return  # the bubble is still someone's; once given back and taken by no one, the next one is armed
        if self.slow.active:
            return
        costs, rank = self._costs, self._rank
        share = self._harvest_share()
        if share <= 0.0:
            return  # the budget grants no bubble
        stuck = self._stuck(self._clock.now_ns())
        in_turn = self._turns.order(self.tasks, start=True)
        k = arming.arm_first(
            ((k, task) for k, task in in_turn if task.task_id not in stuck),
            grant_id=self._next_grant,
            guard=self.guard,
            holdback=lambda: costs.holdback(rank) if costs is not None else None,
            harvest_share=share,
            probe_due=self._probes.due_next,
        )
        if k is not None:
            self._next_grant += 1
            self._turns.served(k, len(self.tasks))

    def _harvest_share(self) -> float:
        """The share of bubbles the slowdown budget of the job training here lets be granted now."""
        return self._costs.harvest_share(self._rank) if self._costs is not None else 1.0

    def _honour_arm(self) -> bool:
        """Make the armed task the holder of the bubble just started; False if none is armed."""
        honoured = self._arming.honour(
            self.tasks, self._bubble, deadline_ns=self._deadline_ns, margin_ns=self.guard.margin_ns
        )
        if honoured is None:
            return False
        armed, state = honoured
        self._tried.add(armed.task.task_id)
        self._granted_in_bubble = True
        self._holder = armed.grant_id
        self._grants[armed.grant_id] = state
        if armed.early is not None:
            self._returned(armed.task, armed.early)
        return True

    def _grant_next(self, *, fresh: bool) -> None:
        if self._bubble is None or self._holder is not None or not self.tasks or self._left_out or self._withheld:
            return
        if self.slow.active:
            return  # a slow step has the bubbles to itself until it ends
        margin = self.guard.margin_ns
        now = self._clock.now_ns()
        remaining = room_ns(now, self._deadline_ns, margin)
        if remaining <= 0:
            return
        passed = self._tried | self._stuck(now)
        for offer in self._turns.offers(self.tasks, remaining_ns=remaining, fresh=fresh, passed=passed):
            task = offer.task
            grant_id = self._next_grant
            self._next_grant += 1
            self._tried.add(task.task_id)
            grant = p.Grant(
                grant_id=grant_id,
                bubble_t_ns=self._bubble.t_ns,
                deadline_ns=self._deadline_ns,
                probe=offer.probe,
                margin_ns=margin,
            )
            if (gate := self._arming.gate) is not None:
                gate.release(task.task_id)  # a step it queued behind the device gate runs in this grant
            if task.runner is None or not task.runner.grant(grant):
                continue
            self._turns.served(offer.turn, len(self.tasks))
            state = GrantState(
                task=task,
                bubble_t_ns=self._bubble.t_ns,
                deadline_ns=self._deadline_ns,
                cpu_at_grant=task.runner.cpu_at_grant(),
            )
            self._holder = grant_id
            self._grants[grant_id] = state
            self._granted_in_bubble = True
            return
