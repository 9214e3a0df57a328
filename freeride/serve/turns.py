"""Whose turn a bubble is: the order in which one device's side tasks get bubbles, and what each may be offered.

Tasks take turns round robin, fillers (``IterativeSpec.fill``) after every
other, so that short steps fill the ends that long ones cannot. A task is
offered what is left of a bubble when its estimated step fits it; a packing
task when some piece of its step may; otherwise it is passed over, counted as
shut out (:class:`~freeride.serve.probes.Probes`), and given a one-step probe
at the start of a long bubble once it is due one. The
:class:`~freeride.serve.scheduler.DeviceScheduler` grants what is offered.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from freeride.serve.probes import Probes
from freeride.serve.tasks import TaskRecord

__all__ = ["PACK_ROOM_NS", "Offer", "Turns"]

PACK_ROOM_NS = 200_000
"""A packing task is offered what is left of a bubble down to this much, whatever its whole step needs."""


@dataclass(frozen=True, slots=True)
class Offer:
    """A task that may have what is left of a bubble."""

    task: TaskRecord
    turn: int
    """Its place in the order of turns (see :meth:`Turns.order`)."""
    probe: bool
    """One step even though its estimate does not fit: the estimate may be stale."""


class Turns:
    """The order of turns of one device's side tasks, and who among them may have what is left of a bubble."""

    def __init__(self, probes: Probes) -> None:
        self._probes = probes
        self._next = 0
        """Where the next round starts: just after the task served last."""

    def order(self, tasks: Sequence[TaskRecord], *, start: bool) -> list[tuple[int, TaskRecord]]:
        """``tasks`` in the order they get their turn, each with its place: fillers after every other.

        At a bubble's ``start`` a filler due a probe comes first: it gets no start otherwise
        (see :meth:`Probes.tail_refused`).
        """
        n = len(tasks)

        def rank(k: int) -> int:
            task = tasks[(self._next + k) % n]
            if not task.fill:
                return 1
            return 0 if start and self._probes.due_next(task.task_id) else 2

        return [(k, tasks[(self._next + k) % n]) for k in sorted(range(n), key=rank)]

    def served(self, turn: int, n: int) -> None:
        """The task at place ``turn`` of ``n`` was served: the next round starts after it."""
        self._next = (self._next + turn + 1) % n

    def offers(
        self, tasks: Sequence[TaskRecord], *, remaining_ns: int, fresh: bool, passed: Collection[int]
    ) -> Iterator[Offer]:
        """The tasks that may have the ``remaining_ns`` left of a bubble, in turn; ``fresh`` at its start.

        Tasks not ready for a grant, or whose ids are in ``passed``, are skipped.
        Each task passed over is counted as shut out as it is reached, so stop
        at the first offer that is taken.
        """
        probes = self._probes
        for turn, task in self.order(tasks, start=fresh):
            if not task.runnable or task.task_id in passed:
                continue
            estimate = task.estimate_ns
            probe = packing = False
            tail = task.fill and not fresh
            if fresh and task.fill and probes.due_next(task.task_id):
                # shut out of the tails (its turns come first at a start for this): one step, as a probe
                probe = probes.due(task.task_id, fresh=True)
                if not probe:
                    continue
            elif task.packs and remaining_ns >= PACK_ROOM_NS and (estimate > remaining_ns or estimate < 0):
                # Its worker offers the largest piece that fits, or gives the grant back at once. A
                # pending piece that cannot be split (a partitioned task's optimizer chunk, say) may
                # never fit: counted as for any task (a grant with steps resets it), it gets its probe.
                packing = True
                probe = probes.due(task.task_id, fresh=fresh)
            elif estimate > remaining_ns:
                # An estimate is only corrected by running steps: a task shut out of
                # bubble after bubble gets one step at the start of a bubble now and then.
                probe = probes.due(task.task_id, fresh=fresh)
                probes.count_no_fit(task.task_id, estimate, remaining_ns)
                if tail:
                    probes.tail_refused(task.task_id)
                if not probe:
                    continue
            elif estimate < 0 and not (fresh and probes.long_bubble()):
                if tail:
                    probes.tail_refused(task.task_id)
                continue  # a task whose step time is unknown probes only at the start of a long bubble
            if not packing or probe:
                probes.reset(task.task_id)
            yield Offer(task=task, turn=turn, probe=probe)
