"""Which training objects (engines, schedules) an adapter watches: at most one live adapter each.

A framework backend keeps one :class:`Watched` for the objects it hooks. An
object that cannot be watched is remembered and left alone for good: a
backend's failure costs the training job one logged message, never a retry per
step.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Adapter", "Watched"]

logger = logging.getLogger(__name__)


class Adapter(Protocol):
    """What is read of an adapter here."""

    @property
    def closed(self) -> bool: ...


A = TypeVar("A", bound=Adapter)


class Watched(Generic[A]):
    """Adapters by the object they watch (held weakly: a dropped engine takes its adapter with it).

    Args:
        make: Builds the adapter of an object with its default options.
        what: The object's name in the log line of a failure (``DeepSpeed engine``).
    """

    def __init__(self, make: Callable[[Any], A], *, what: str) -> None:
        self._make = make
        self._what = what
        self._adapters: weakref.WeakKeyDictionary[Any, A] = weakref.WeakKeyDictionary()
        self._failed: weakref.WeakSet[Any] = weakref.WeakSet()

    def live(self, obj: Any) -> A | None:
        """The adapter watching ``obj``, unless there is none or it was closed."""
        try:
            adapter = self._adapters.get(obj)
        except TypeError:  # not weak-referenceable: certainly nothing of ours
            return None
        return None if adapter is None or adapter.closed else adapter

    def watch(self, obj: Any, *, create: bool = True) -> A | None:
        """The adapter watching ``obj``, built on first sight when ``create``; None if it cannot be.

        A closed adapter stays closed: ``obj`` is not watched again. Never raises.
        """
        adapter = self._adapters.get(obj)
        if adapter is not None:
            return None if adapter.closed else adapter
        if not create or obj in self._failed:
            return None
        try:
            adapter = self._adapters[obj] = self._make(obj)
        except Exception:
            self._failed.add(obj)
            logger.exception("[attach] cannot watch this %s; training continues without FreeRide", self._what)
            return None
        return adapter

    def attach(self, obj: Any, make: Callable[[], A]) -> A:
        """The live adapter of ``obj``, or a new one from ``make`` (whose errors propagate)."""
        adapter = self.live(obj)
        if adapter is None:
            adapter = self._adapters[obj] = make()
        return adapter
