"""A worker's progress reports to the manager: steps, metrics, estimates, and whether the task waits for input.

Reports go out at most once a period, except where news cannot wait: a
task that starts waiting for its input says so at once, once per period at
most, so that one waiting for every item does not send a report per item.
"""

from __future__ import annotations

from collections.abc import Callable

from freeride import protocol as p
from freeride.sidetask import IterativeTask, StepEstimates

__all__ = ["PROGRESS_EVERY_NS", "ProgressReports"]

PROGRESS_EVERY_NS = 250_000_000
"""The period of progress reports."""


class ProgressReports:
    """The progress reports of ``task``.

    Args:
        assign: What the manager assigned (the task's id).
        task: The task reported on (its own metrics).
        estimates: The estimate of each step kind.
        send: Sends a message to the manager.
    """

    def __init__(
        self,
        assign: p.Assign,
        task: IterativeTask,
        estimates: StepEstimates,
        send: Callable[[p.WorkerToManager], None],
    ) -> None:
        self.assign = assign
        self._task = task
        self._estimates = estimates
        self._send = send
        self._last_ns = 0
        self.reported: dict[str, float] = {}
        """Metrics the task published with ``report``, sent with every progress report."""
        self.waiting = False
        self._said_waiting = False
        """The last progress report said the task waits for input."""

    def progress(self, steps: int) -> p.Progress:
        """What the task has done so far: steps, metrics and the estimate of each step kind."""
        estimates = self._estimates
        kinds = estimates.kinds()[-p.MAX_ESTIMATE_KINDS :]  # the newest kinds, when there are many
        return p.Progress(
            task_id=self.assign.task_id,
            steps=steps,
            metrics={**self._task.metrics(), **self.reported},
            estimates={kind: estimates.estimate_ns(kind) for kind in kinds},
            waiting=self.waiting,
        )

    def send(self, now: int, steps: int, *, force: bool = False) -> None:
        """Send a report if ``force``, or if none went out for a period."""
        if force or now - self._last_ns >= PROGRESS_EVERY_NS:
            self._last_ns = now
            self._said_waiting = self.waiting
            self._send(self.progress(steps))

    def report(self, now: int, steps: int, metrics: dict[str, float]) -> None:
        """Publish ``metrics`` (sent at once, or with the next report if one went out lately)."""
        self.reported.update(metrics)
        self.send(now, steps)

    def wait_started(self, now: int, steps: int) -> None:
        """Note that the task waits for its input; the start of a wait is news, once a period at most."""
        self.waiting = True
        self.send(now, steps, force=not self._said_waiting)
