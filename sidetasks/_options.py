"""Checks of the sample tasks' options, each refusing a bad value with one wording for every task."""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["check_at_least", "check_file", "check_positive", "target_ns"]


def check_at_least(low: int, **options: float) -> None:
    """Refuse an option below ``low``.

    Raises:
        ValueError: ``"<name> must be >= <low>, got <value>"`` for the first such option, in the order given.
    """
    for name, value in options.items():
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def check_positive(**options: float) -> None:
    """Refuse an option that is not a finite number above 0.

    Raises:
        ValueError: ``"<name> must be a finite number > 0, got <value>"`` for the first such option, in the
            order given.
    """
    for name, value in options.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number > 0, got {value}")


def check_file(**options: str) -> None:
    """Refuse a path option that is set ("" is not) and names no file (``~`` expanded).

    Raises:
        ValueError: ``"<name> '<path>' is not a file"`` for the first such option, in the order given.
    """
    for name, path in options.items():
        if path and not Path(path).expanduser().is_file():
            raise ValueError(f"{name} {path!r} is not a file")


def target_ns(target_ms: float) -> int:
    """The ``target_ms`` option (the longest a joined step should take; 0: no joining) in nanoseconds.

    Raises:
        ValueError: unless ``target_ms`` is a finite number >= 0.
    """
    if not (target_ms >= 0 and math.isfinite(target_ms)):
        raise ValueError(f"target_ms must be a finite number >= 0, got {target_ms}")
    return round(target_ms * 1e6)
