"""The arm out on one device: a grant handed over before its bubble starts, honoured once it does.

Armed grants shorten the path from a bubble's start to a step's: once a bubble
is given back (or ends), the task next in turn is armed for the next one (where
the rank publishes its bubble starts), so its worker starts on the rank's own
event instead of waiting for the scheduler's Grant, and stops at the rank's own
end. The scheduler still sees those events and counts the armed task as the
bubble's holder (an arm, once out, is always honoured: the worker may already
run); to a worker not yet shown to hear the rank it sends the same Grant, which
a worker that missed the event starts from. With every bubble of a device an
armed worker's that hears its rank, nothing the scheduler decides waits on the
rank's events (:attr:`~freeride.serve.scheduler.DeviceScheduler.edge_due`).

:class:`DeviceArming` holds the one arm out and the rule of which task may be
armed; its scheduler (:class:`~freeride.serve.scheduler.DeviceScheduler`)
decides when to arm, in turn order, and records the honoured arm as a grant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from freeride import protocol as p
from freeride.holdback import granted
from freeride.serve.gates import DeviceGate
from freeride.serve.guard import InterferenceGuard
from freeride.serve.ledger import DeviceLedger, GrantState
from freeride.serve.tasks import TaskRecord

__all__ = ["Armed", "DeviceArming"]


@dataclass(slots=True)
class Armed:
    """The arm out: its task and grant."""

    task: TaskRecord
    grant_id: int
    guard: tuple[int, float, int] = (0, 1.0, 0)
    """The guard's margin, prediction factor and shortest bubble the arm carries."""
    share: float = 1.0
    """The harvest share of the job's slowdown budget the arm carries."""
    gate_open_ns: int = 0
    """The arm's worker queued its step behind its slot of the device gate, which the rank opens only at a
    bubble expected this long (0: not gated)."""
    early: p.GrantDone | None = None
    """The grant's report, if it came before its bubble's start did."""


def _carried(guard: InterferenceGuard) -> tuple[int, float, int]:
    """What of ``guard``'s an arm carries to its worker."""
    return guard.margin_ns, guard.factor, guard.min_bubble_ns


class DeviceArming:
    """The arm out on one device (at most one), and where its rank publishes bubble starts.

    Args:
        ledger: The device's ledger, which counts an arm that ran on a bubble never seen.
        gate: The device's bubble gate (``serve --device-gate``; None: none). A task whose worker can use it
            is armed with its slot, while the budget grants every bubble: its worker queues its step ahead and
            the rank's stream releases it (see :mod:`freeride.serve.gates`).
    """

    def __init__(self, ledger: DeviceLedger, gate: DeviceGate | None = None) -> None:
        self._ledger = ledger
        self.gate = gate
        self._endpoint = ""
        self.armed: Armed | None = None
        self._last_start_ns = 0
        self._following: set[tuple[int, int]] = set()
        """(task id, worker pid) of the workers that took an armed grant from this rank's own event."""
        self._late: set[int] = set()
        """Tasks whose slot the host opened at a bubble's end with their grant still out: armed without a slot
        until it is back, so that the step they may still have queued is not shut in again."""

    @property
    def endpoint(self) -> str:
        """Where the rank training here publishes its bubble starts ("" none: no arming)."""
        return self._endpoint

    @endpoint.setter
    def endpoint(self, endpoint: str) -> None:
        if endpoint != self._endpoint:
            self._following.clear()  # another rank: each worker shows again that it hears it
        self._endpoint = endpoint

    def took_event(self, task: TaskRecord) -> None:
        """``task``'s worker took an armed grant from the rank's own event: it hears the rank."""
        if task.runner is not None:
            self._following.add((task.task_id, task.runner.pid))

    def saw_start(self, t_ns: int) -> None:
        """A bubble started at ``t_ns``: an arm handed over later waits for a start after it."""
        self._last_start_ns = max(self._last_start_ns, t_ns)

    def arm_first(
        self,
        candidates: Iterable[tuple[int, TaskRecord]],
        *,
        grant_id: int,
        guard: InterferenceGuard,
        holdback: Callable[[], p.Holdback | None],
        harvest_share: float,
        probe_due: Callable[[int], bool],
    ) -> int | None:
        """Arm the first task of ``candidates`` (turn offset, task) that takes an arm, as ``grant_id``.

        A task that cannot be armed (its step time unknown, due for a probe, a
        program: only an iterative worker follows the rank's events) ends the
        search: its turn comes with a Grant at a bubble's start.

        Returns:
            The offset of the task armed; ``None`` if none was.
        """
        for k, task in candidates:
            if not task.runnable or task.runner is None:
                continue
            if task.estimate_ns < 0 or not isinstance(task.spec, p.IterativeSpec):
                return None  # a probe or a program: only a Grant at a bubble's start serves it
            if probe_due(task.task_id):
                return None  # due for a probe, which only a Grant gives
            slot, gate_open_ns = self._name_slot(task, guard, harvest_share)
            arm = p.Arm(
                grant_id=grant_id,
                endpoint=self.endpoint,
                after_ns=self._last_start_ns,
                margin_ns=guard.margin_ns,
                prediction_factor=guard.factor,
                min_bubble_ns=guard.min_bubble_ns,
                holdback=holdback(),
                harvest_share=harvest_share,
                gate_slot=slot,
                gate_open_ns=gate_open_ns,
            )
            if not task.runner.arm(arm):
                if slot and self.gate is not None:
                    self.gate.name_none()
                continue  # the worker's socket refused
            self.armed = Armed(
                task=task, grant_id=grant_id, guard=_carried(guard), share=harvest_share, gate_open_ns=gate_open_ns
            )
            return k
        return None

    def _name_slot(self, task: TaskRecord, guard: InterferenceGuard, harvest_share: float) -> tuple[int, int]:
        """Name ``task``'s gate slot for the next bubble, where it can be used; (slot, bound) or (0, 0).

        Only while the budget grants every bubble: the rank cannot tell which ones a smaller share leaves out.
        """
        gate = self.gate
        if gate is None:
            return 0, 0
        if harvest_share < 1.0 or not gate.usable(task.task_id) or task.task_id in self._late:
            gate.name_none()
            return 0, 0
        return gate.name(
            task.task_id,
            estimate_ns=task.estimate_ns,
            margin_ns=guard.margin_ns,
            factor=guard.factor,
            min_bubble_ns=guard.min_bubble_ns,
        )

    def follows(self, task: TaskRecord) -> bool:
        """Whether ``task``'s worker has shown it hears this rank (it took an armed grant from its event)."""
        return task.runner is not None and (task.task_id, task.runner.pid) in self._following

    def stale(self, guard: InterferenceGuard, harvest_share: float) -> bool:
        """Whether the arm out carries other values of ``guard``'s, or another harvest share, than hold now."""
        armed = self.armed
        return armed is not None and (armed.guard != _carried(guard) or armed.share != harvest_share)

    def takes(self, bubble: p.BubbleStarted) -> bool:
        """Whether the armed worker starts on ``bubble`` by the harvest share it carries, and where its step waits
        behind the device gate, whether the rank opened its slot there (False: none armed)."""
        armed = self.armed
        return (
            armed is not None
            and granted(armed.share, bubble.step, bubble.index)
            and bubble.expected_ns >= armed.gate_open_ns
        )

    @property
    def gated(self) -> TaskRecord | None:
        """The task of the arm out, if its step waits behind its slot of the device gate."""
        armed = self.armed
        return armed.task if armed is not None and armed.gate_open_ns else None

    def disarm(self) -> None:
        """Withdraw the arm out, if any."""
        armed, self.armed = self.armed, None
        if armed is None:
            return
        if armed.gate_open_ns and self.gate is not None:
            self.gate.name_none()  # a step it queued waits for its next arm, or a Grant
        if armed.early is not None:  # ran on a bubble the scheduler never saw: its own account
            self._ledger.add_used(armed.early.busy_ns)
        elif armed.task.runner is not None:
            armed.task.runner.disarm(armed.grant_id)

    def holds(self, task: TaskRecord) -> bool:
        """Whether ``task`` holds the arm out."""
        return self.armed is not None and self.armed.task is task

    def drop(self, task: TaskRecord) -> None:
        """Forget the arm ``task`` holds: its worker was killed and never answers for it."""
        if self.holds(task):
            self.armed = None
            if self.gate is not None:
                self.gate.name_none()
        self._following = {k for k in self._following if k[0] != task.task_id}
        self.forget_slot(task)  # a worker started again says anew whether the gate works for it

    def forget_slot(self, task: TaskRecord) -> None:
        """``task`` left the device, or its worker: its gate slot is opened and freed."""
        self._late.discard(task.task_id)
        if self.gate is not None:
            self.gate.forget(task.task_id)

    def rank_gone(self) -> None:
        """The rank is gone: the arm is withdrawn, and every slot opened (no stream will open them)."""
        self.disarm()
        if self.gate is not None:
            self.gate.release_all()

    def bubble_ended(self, start_ns: int, grants: Iterable[GrantState]) -> None:
        """Open the slots of the tasks whose grant of the bubble that started at ``start_ns`` is still out.

        A step still running is not affected; one the rank's stream never
        released (a rank that still maps the page of a manager before this
        one) runs now, late, rather than never: its task is armed without a
        slot until its grant is back (:meth:`returned`).
        """
        if self.gate is None:
            return
        late = {g.task.task_id for g in grants if g.bubble_t_ns == start_ns and not g.returned}
        self.gate.release_all_of(late)
        self._late |= late

    def returned(self, task: TaskRecord) -> None:
        """A grant of ``task`` came back: it may be armed with its slot again."""
        self._late.discard(task.task_id)

    def hold_early(self, task: TaskRecord, done: p.GrantDone) -> bool:
        """Keep ``done`` if it is the armed grant's, back before its bubble's start was seen; whether it was."""
        armed = self.armed
        if armed is not None and armed.grant_id == done.grant_id and armed.task is task:
            armed.early = done
            return True
        return False

    def honour(
        self, tasks: list[TaskRecord], bubble: p.BubbleStarted | None, *, deadline_ns: int, margin_ns: int
    ) -> tuple[Armed, GrantState] | None:
        """Spend the arm on the bubble just started: its Grant sent, its state as the bubble's grant.

        Returns:
            The arm and the state of its grant; ``None`` if none is armed (or
            its task left ``tasks``): the arm is spent either way.
        """
        armed, self.armed = self.armed, None
        if armed is None or bubble is None or armed.task not in tasks or armed.task.runner is None:
            return None
        runner = armed.task.runner
        sent = False
        if armed.early is None and not self.follows(armed.task):
            # The Grant a worker that missed the rank's event starts from (one that did not ignores
            # it). A worker that has taken armed grants from this rank's events gets none: it hears
            # the rank, and the Grant would be one more message each way per bubble. Should it miss
            # an event all the same, it gives the grant back unused at the bubble's Revoke.
            sent = runner.grant(
                p.Grant(
                    grant_id=armed.grant_id,
                    bubble_t_ns=bubble.t_ns,
                    deadline_ns=deadline_ns,
                    margin_ns=margin_ns,
                )
            )
        state = GrantState(
            task=armed.task,
            bubble_t_ns=bubble.t_ns,
            deadline_ns=deadline_ns,
            cpu_at_grant=runner.cpu_at_grant() if sent else -1,  # an armed report says when it started
            armed=True,
        )
        return armed, state
