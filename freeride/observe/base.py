"""Observers: what the manager tells trace writers and metrics exporters.

The manager calls every registered :class:`Observer` synchronously from its
event loop, so an observer must be quick (buffer and write in bulk) and must
not raise; :class:`Observers` logs and drops an observer that does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from freeride import protocol as p

__all__ = ["Observer", "Observers"]

logger = logging.getLogger(__name__)


class Observer:
    """What an observer may be told; each method does nothing unless overridden."""

    def backend_event(self, event: p.BackendEvent) -> None:
        """Every valid event from a training rank (Hello, bubbles, steps, Goodbye)."""

    def grant_done(self, device: str, task_id: int, task_name: str, done: p.GrantDone) -> None:
        """A side task gave a grant back: its work inside that bubble."""

    def interference(
        self, device: str, task_id: int, task_name: str, t_ns: int, dur_ns: int, *, stage_wait_ns: int = 0
    ) -> None:
        """A side task took ``dur_ns`` from training after its bubble ended at ``t_ns``.

        ``stage_wait_ns`` of it was the stage waiting for its core while the side step held it
        (on CPU); the rest is the task's compute after the end.
        """

    def task_status(self, status: p.TaskStatus) -> None:
        """A side task changed state (submitted, running, finished, failed, cancelled)."""

    def training_cost(self, cost: p.TrainingCost) -> None:
        """A job's measured cost changed (a held-back / harvested pair was measured)."""

    def close(self) -> None:
        """Flush and release; called once at manager shutdown."""


class Observers:
    """Fans each call out to every observer; a failing observer is removed."""

    def __init__(self) -> None:
        self._observers: list[Observer] = []

    def add(self, observer: Observer) -> None:
        self._observers.append(observer)

    def _each(self, what: str, call: Callable[[Observer], None]) -> None:
        for obs in list(self._observers):
            try:
                call(obs)
            except Exception:
                logger.exception("[observe] %s failed in %s; removing it", type(obs).__name__, what)
                self._observers.remove(obs)

    def backend_event(self, event: p.BackendEvent) -> None:
        if self._observers:
            self._each("backend_event", lambda obs: obs.backend_event(event))

    def grant_done(self, device: str, task_id: int, task_name: str, done: p.GrantDone) -> None:
        if self._observers:
            self._each("grant_done", lambda obs: obs.grant_done(device, task_id, task_name, done))

    def interference(
        self, device: str, task_id: int, task_name: str, t_ns: int, dur_ns: int, *, stage_wait_ns: int = 0
    ) -> None:
        if self._observers:
            self._each(
                "interference",
                lambda obs: obs.interference(device, task_id, task_name, t_ns, dur_ns, stage_wait_ns=stage_wait_ns),
            )

    def task_status(self, status: p.TaskStatus) -> None:
        if self._observers:
            self._each("task_status", lambda obs: obs.task_status(status))

    def training_cost(self, cost: p.TrainingCost) -> None:
        if self._observers:
            self._each("training_cost", lambda obs: obs.training_cost(cost))

    def close(self) -> None:
        self._each("close", lambda obs: obs.close())
        self._observers.clear()
