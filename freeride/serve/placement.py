"""Where a side task goes: only to a device whose spare memory holds its peak."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DeviceView", "NoFit", "place"]

_GIB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceView:
    """What placement needs to know about one device."""

    device: str
    spare_memory: int
    """Bytes the training stage leaves free (-1 unknown)."""
    committed_memory: int
    """Peak memory of the side tasks already placed here."""
    tasks: int
    """Side tasks already placed here."""
    bubble_share: float
    """Share of wall time this device has spent in bubbles so far (0 if unknown)."""
    alive: bool


@dataclass(frozen=True, slots=True)
class NoFit:
    """No device can take the task; ``reason`` says why in the user's terms."""

    reason: str


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"


def _free(view: DeviceView) -> int:
    return -1 if view.spare_memory < 0 else view.spare_memory - view.committed_memory


def place(peak_memory: int, devices: Sequence[DeviceView], *, pinned: str = "") -> str | NoFit | None:
    """Choose a device for a task with ``peak_memory`` bytes at its peak.

    Side tasks on one device take turns, so each must fit beside the training
    stage; memory of tasks already placed there counts against it. Among the
    devices that fit, the one with the fewest tasks wins, then the one with
    the most bubble time, then the most free memory.

    Returns:
        The device, ``None`` if no device is known yet (wait for backends),
        or :class:`NoFit` explaining why none will do.
    """
    if pinned:
        views = [d for d in devices if d.device == pinned]
        if not views:
            return None
    else:
        views = [d for d in devices if d.alive] or list(devices)
    if not views:
        return None
    fits = [d for d in views if peak_memory < 0 or _free(d) < 0 or peak_memory <= _free(d)]
    if not fits:
        best = max(views, key=_free)
        return NoFit(
            f"task needs {_gib(peak_memory)} at its peak but the most any device has free is "
            f"{_gib(_free(best))} ({best.device}); lower the task's memory use or free memory on a stage"
        )
    return min(fits, key=lambda d: (not d.alive, d.tasks, -d.bubble_share, -_free(d))).device
