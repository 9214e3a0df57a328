"""Side tasks whose step estimate keeps them out of one device's bubbles, and when each is due a probe.

An estimate is only corrected by running steps: a task shut out of bubble after
bubble gets one step (a probe) at the start of a bubble now and then, and only
in a long one. :class:`Probes` counts the bubbles each task was shut out of
(in a row, and in all with why, for status) and keeps the expected lengths of
the last bubbles that tell a long one; its scheduler
(:class:`~freeride.serve.scheduler.DeviceScheduler`) asks it who is due.
"""

from __future__ import annotations

from collections import deque

__all__ = ["PROBE_AFTER_BUBBLES", "PROBE_BUBBLE_SHARE", "Probes"]

PROBE_AFTER_BUBBLES = 20
"""A task whose estimate has not fit this many bubbles in a row gets a one-step probe."""

PROBE_BUBBLE_SHARE = 0.5
"""A probe (a step whose estimate is unknown or does not fit) goes only to a bubble expected to last at least
this share of the longest of the last :data:`PROBE_AFTER_BUBBLES`: a step that may be long is run where it can
best end in time (a VGG-19 piece of 55 ms, estimated at 3 ms in an earlier batch, overran 2-4 ms bubbles by
50 ms where the job also had bubbles of 40 ms)."""


class Probes:
    """The bubbles one device's side tasks were shut out of, by task id."""

    def __init__(self) -> None:
        self._recent_expected: deque[int] = deque(maxlen=PROBE_AFTER_BUBBLES)
        """The expected lengths (factor applied) of the last bubbles, this one's included."""
        self._starved: dict[int, int] = {}
        """Consecutive bubbles a task's estimate kept it out of."""
        self._no_fit: dict[int, tuple[int, str]] = {}
        """Bubbles a task's estimate kept it out of in all, and why the last time (for status)."""
        self._kept_out: set[int] = set()
        """Tasks kept out of the current bubble (each counted once per bubble)."""
        self._tails: set[int] = set()
        """Fillers counted as shut out of the current bubble's tail (once per bubble)."""

    def bubble_started(self, expected_ns: int) -> None:
        """A bubble expected to last ``expected_ns`` (factor applied) started."""
        self._kept_out.clear()
        self._tails.clear()
        self._recent_expected.append(expected_ns)

    def no_fit(self, task_id: int) -> tuple[int, str]:
        """Bubbles ``task_id``'s estimated step did not fit, and why the last time."""
        return self._no_fit.get(task_id, (0, ""))

    def count_no_fit(self, task_id: int, estimate_ns: int, room: int) -> None:
        if task_id in self._kept_out:
            return
        self._kept_out.add(task_id)
        count = self._no_fit.get(task_id, (0, ""))[0] + 1
        why = f"its step estimate {estimate_ns / 1e6:.3g} ms > the {room / 1e6:.3g} ms left in the bubble"
        self._no_fit[task_id] = (count, why)

    def due(self, task_id: int, *, fresh: bool) -> bool:
        """Count a bubble's start the task is shut out of; whether it is now due a probe step in this one."""
        starved = self._starved.get(task_id, 0) + (1 if fresh else 0)
        self._starved[task_id] = starved
        return fresh and starved >= PROBE_AFTER_BUBBLES and self.long_bubble()

    def tail_refused(self, task_id: int) -> None:
        """A filler's estimate kept it out of what was left of this bubble (or it gave that back unused).

        A filler never gets a bubble's start in turn, where :meth:`due` counts the
        others: without this, one whose estimate fits no tail would never run the
        step that corrects the estimate. Counted once a bubble, as a start is.
        """
        if task_id in self._tails:
            return
        self._tails.add(task_id)
        self._starved[task_id] = self._starved.get(task_id, 0) + 1

    def due_next(self, task_id: int) -> bool:
        """Whether the task is due a probe if shut out of one more bubble's start (which only a Grant gives)."""
        return self._starved.get(task_id, 0) + 1 >= PROBE_AFTER_BUBBLES

    def passed_over(self, task_id: int) -> None:
        """The task took a bubble's start and ran nothing in it."""
        self._starved[task_id] = self._starved.get(task_id, 0) + 1

    def reset(self, task_id: int) -> None:
        """The task ran, or was granted, or left the device: its count in a row starts anew."""
        self._starved.pop(task_id, None)

    def long_bubble(self) -> bool:
        """Whether the current bubble is long enough for a probe (see :data:`PROBE_BUBBLE_SHARE`)."""
        expected = self._recent_expected[-1] if self._recent_expected else 0
        return expected >= PROBE_BUBBLE_SHARE * max(self._recent_expected, default=0)

    def forget(self, task_id: int) -> None:
        """Drop what is kept about a task that left the manager's table."""
        self._starved.pop(task_id, None)
        self._no_fit.pop(task_id, None)
