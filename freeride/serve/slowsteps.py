"""Steps too slow for their bubble: their workers run on only inside bubbles, frozen between them.

A step still running long after its bubble ended, and still computing, is slow
rather than hung: killing it would lose its work and, at every restart, kill it
again. Its worker is frozen (SIGSTOP to its process group) at each bubble's end
and thawed (SIGCONT) at each bubble's start until the step gives its grant back,
so it finishes in bubble time and takes none from training. A task once found
slow has every later overrun frozen at the bubble's end at once.

One :class:`SlowSteps` per device, driven by its scheduler; the liveness check
(:mod:`freeride.serve.liveness`) decides what is slow and what is hung.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from freeride.clock import MONOTONIC, Clock
from freeride.serve.ledger import GrantState
from freeride.serve.tasks import TaskRecord

__all__ = ["Overdue", "SlowSteps"]


class Overdue(NamedTuple):
    """A grant still out past its grace (see :meth:`SlowSteps.overdue`)."""

    task: TaskRecord
    late_ns: int
    """How long past its bubble's end."""
    thawed_ns: int
    """How long its step ran in bubbles since it was frozen as slow (-1: not frozen)."""


@dataclass(slots=True, eq=False)
class _Frozen:
    task: TaskRecord
    running: bool
    """Thawed now (inside a bubble)."""
    since_ns: int
    """When it was last thawed (meaningful while running)."""
    thawed_ns: int = 0
    """Time it was let run since it was frozen."""


class SlowSteps:
    """The frozen steps of one device's side tasks, by task id."""

    def __init__(self, *, clock: Clock = MONOTONIC) -> None:
        self._clock = clock
        self._frozen: dict[int, _Frozen] = {}

    def __contains__(self, task: TaskRecord) -> bool:
        return task.task_id in self._frozen

    @property
    def active(self) -> bool:
        """A frozen step waits for its bubbles: no other task gets one meanwhile."""
        return bool(self._frozen)

    def freeze(self, task: TaskRecord, *, in_bubble: bool) -> None:
        """From now on ``task``'s step runs only in bubbles: at once, or at this bubble's end."""
        if task.task_id in self._frozen or task.runner is None:
            return
        now = self._clock.now_ns()
        self._frozen[task.task_id] = _Frozen(task, running=in_bubble, since_ns=now)
        if not in_bubble:
            task.runner.hold(True)

    def bubble_started(self) -> None:
        now = self._clock.now_ns()
        for frozen in self._frozen.values():
            if not frozen.running and frozen.task.runner is not None:
                frozen.task.runner.hold(False)
                frozen.running, frozen.since_ns = True, now

    def bubble_ended(self) -> None:
        now = self._clock.now_ns()
        for frozen in self._frozen.values():
            if frozen.running and frozen.task.runner is not None:
                frozen.task.runner.hold(True)
                frozen.running = False
                frozen.thawed_ns += max(0, now - frozen.since_ns)

    def release(self, task: TaskRecord) -> None:
        """``task``'s step ended, or it is stopping: it runs freely again (a stopped worker must read its Stop)."""
        frozen = self._frozen.pop(task.task_id, None)
        if frozen is not None and not frozen.running and task.runner is not None:
            task.runner.hold(False)

    def thawed_ns(self, task: TaskRecord) -> int:
        """How long ``task``'s frozen step was let run since it was frozen (-1: not frozen)."""
        frozen = self._frozen.get(task.task_id)
        if frozen is None:
            return -1
        extra = self._clock.now_ns() - frozen.since_ns if frozen.running else 0
        return frozen.thawed_ns + max(0, extra)

    def overdue(
        self, grants: Iterable[GrantState], now_ns: int, grace_ns: Callable[[TaskRecord], int]
    ) -> list[Overdue]:
        """Tasks holding one of ``grants`` not given back ``grace_ns(task)`` after its bubble ended.

        Returns:
            Each such task once, with how long past its bubble's end (its
            deadline, where the end was not seen) the oldest such grant is.
        """
        late: dict[int, Overdue] = {}
        for state in grants:
            task = state.task
            if state.returned or task.runner is None:
                continue
            past = state.late_ns(now_ns)
            seen = late.get(task.task_id)
            if past > grace_ns(task) and (seen is None or past > seen.late_ns):
                late[task.task_id] = Overdue(task, past, self.thawed_ns(task))
        return list(late.values())
