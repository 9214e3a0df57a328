"""Observers: what the manager tells trace writers and metrics exporters.

The manager calls every registered :class:`Observer` synchronously from its
event loop, so an observer must be quick (buffer and write in bulk) and must
not raise; :class:`Observers` logs and drops an observer that does.
"""

from __future__ import annotations

import logging
from typing import Protocol

from freeride import protocol as p

__all__ = ["Observer", "Observers"]

logger = logging.getLogger(__name__)


class Observer(Protocol):
    def backend_event(self, event: p.BackendEvent) -> None:
        """Every valid event from a training rank (Hello, bubbles, steps, Goodbye)."""

    def grant_done(self, device: str, task_id: int, task_name: str, done: p.GrantDone) -> None:
        """A side task gave a grant back: its work inside that bubble."""

    def task_status(self, status: p.TaskStatus) -> None:
        """A side task changed state (submitted, running, finished, failed, cancelled)."""

    def close(self) -> None:
        """Flush and release; called once at manager shutdown."""


class Observers:
    """Fans each call out to every observer; a failing observer is removed."""

    def __init__(self) -> None:
        self._observers: list[Observer] = []

    def add(self, observer: Observer) -> None:
        self._observers.append(observer)

    def _each(self, what: str, *args: object) -> None:
        for obs in list(self._observers):
            try:
                getattr(obs, what)(*args)
            except Exception:
                logger.exception("[observe] %s failed in %s; removing it", type(obs).__name__, what)
                self._observers.remove(obs)

    def backend_event(self, event: p.BackendEvent) -> None:
        if self._observers:
            self._each("backend_event", event)

    def grant_done(self, device: str, task_id: int, task_name: str, done: p.GrantDone) -> None:
        if self._observers:
            self._each("grant_done", device, task_id, task_name, done)

    def task_status(self, status: p.TaskStatus) -> None:
        if self._observers:
            self._each("task_status", status)

    def close(self) -> None:
        self._each("close")
        self._observers.clear()
