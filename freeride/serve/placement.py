"""Where a side task goes: to the device with the most spare bubble time that holds its peak memory.

Both rules here are pure: :func:`place` chooses a device for a task, and
:func:`better_device` says whether a placed task should move to another one.
A device's capacity is its bubble time per second of training (from the
profile, or learned from its steps); the side tasks placed on a device take
turns in its bubbles, so each gets an equal share of that capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["NEGLIGIBLE_SHARE", "DeviceView", "NoFit", "better_device", "place", "spare_share"]

_GIB = 1 << 30

NEGLIGIBLE_SHARE = 0.02
"""A device idle for less than this share of its step is used only when no better one exists."""


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
    """Bubble time per second of training (profiled or learned); negative while unknown."""
    alive: bool
    departed: bool = False
    """A rank trained here and left: an unpinned task is not placed here (nothing may ever train here again)."""


@dataclass(frozen=True, slots=True)
class NoFit:
    """No device can take the task; ``reason`` says why in the user's terms."""

    reason: str


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"


def _free(view: DeviceView) -> int:
    return -1 if view.spare_memory < 0 else view.spare_memory - view.committed_memory


def _fits(peak_memory: int, view: DeviceView) -> bool:
    return peak_memory < 0 or _free(view) < 0 or peak_memory <= _free(view)


def spare_share(view: DeviceView, *, joining: bool = True) -> float:
    """The share of ``view``'s bubble time one task there gets (0 while unknown).

    Args:
        joining: Whether the task would join the device (counted on top of
            :attr:`DeviceView.tasks`) or is already counted there.
    """
    if view.bubble_share <= 0:
        return 0.0
    return view.bubble_share / max(1, view.tasks + (1 if joining else 0))


def _tier(view: DeviceView) -> int:
    """0: bubbles worth having; 1: not known yet; 2: negligible bubbles."""
    if view.bubble_share < 0:
        return 1
    return 0 if view.bubble_share >= NEGLIGIBLE_SHARE else 2


def place(peak_memory: int, devices: Sequence[DeviceView], *, pinned: str = "") -> str | NoFit | None:
    """Choose a device for a task with ``peak_memory`` bytes at its peak.

    Side tasks on one device take turns, so each must fit beside the training
    stage; memory of tasks already placed there counts against it. Among the
    live devices that fit, one whose bubbles are worth having wins over one
    whose bubbles are not known yet, which wins over one with negligible
    bubbles (under :data:`NEGLIGIBLE_SHARE` of its step); then the most
    bubble time the task would get there (its device's capacity shared with
    the tasks already placed), then the fewest tasks, then the most free memory.

    Returns:
        The device, ``None`` if no device is known yet, or every known one's
        rank left (wait for backends), or :class:`NoFit` explaining why none
        will do.
    """
    if pinned:
        views = [d for d in devices if d.device == pinned]
        if not views:
            return None
    else:
        # a device declared before its rank reports may take tasks to set up; one whose rank left may not
        views = [d for d in devices if d.alive] or [d for d in devices if not d.departed]
    if not views:
        return None
    fits = [d for d in views if _fits(peak_memory, d)]
    if not fits:
        best = max(views, key=_free)
        return NoFit(
            f"task needs {_gib(peak_memory)} at its peak but the most any device has free is "
            f"{_gib(_free(best))} ({best.device}); lower the task's memory use or free memory on a stage"
        )
    return min(fits, key=lambda d: (not d.alive, _tier(d), -spare_share(d), d.tasks, -_free(d))).device


def better_device(
    current: str, peak_memory: int, devices: Sequence[DeviceView], *, gain: float, min_gain_share: float
) -> tuple[str, float, float] | None:
    """The device a task on ``current`` should move to, if one is clearly better.

    A move costs a checkpoint and a restart, so it must pay: the task's share
    of bubble time there must be at least ``gain`` times its share here and
    larger by at least ``min_gain_share`` (of a second per second of training).
    Only live devices whose capacity is known, is worth having, and that hold
    the task's peak memory are candidates. ``current``'s view counts the task
    among its tasks; the others' do not.

    Returns:
        ``(device, share here, share there)``, or None to stay.
    """
    here = next((d for d in devices if d.device == current), None)
    if here is None or not here.alive or here.bubble_share < 0:
        # nothing to compare with yet; a device without its rank may be about to
        # train (a profiled one before the job starts, a rank restarting)
        return None
    now = spare_share(here, joining=False)
    best: tuple[str, float, float] | None = None
    for view in devices:
        if view.device == current or not view.alive or _tier(view) != 0 or not _fits(peak_memory, view):
            continue
        there = spare_share(view)
        if there >= gain * now and there - now >= min_gain_share and (best is None or there > best[2]):
            best = (view.device, now, there)
    return best
