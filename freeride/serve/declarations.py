"""What the manager reads from a task before starting it: its options, peak memory and device.

The manager checks a submitted task against what its class declares (read from
source by :func:`freeride.tasks.declared.declared_in_source`, never imported: the
event loop must not stall on torch), so bad options are refused at submit, and
a class's ``peak_memory`` and ``device_kind`` count when the submitter gave none.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec

from freeride import protocol as p
from freeride.serve.placement import DeviceView, NoFit
from freeride.tasks.declared import OptionError, declared_in_source, validate_options

__all__ = ["TRACEBACK_LINES", "gpu_views", "last_lines", "pending_reason", "with_declarations"]

TRACEBACK_LINES = 20
"""Lines of a failed task's traceback kept for ``freeride status`` (the whole one is in the manager's log)."""


def with_declarations(spec: p.IterativeSpec) -> p.IterativeSpec | str:
    """``spec`` with its options converted to the declared types and the class's declarations filled in.

    Returns:
        The spec, or why it cannot run (options that do not match ``__init__``).
        A class that cannot be read from source passes unchanged: its worker
        checks the options again and fails the task at once if they do not match.
    """
    decl = declared_in_source(spec.target)
    if decl is None:
        return spec
    try:
        options = validate_options(decl, spec.options)
    except OptionError as exc:
        return str(exc)
    return msgspec.structs.replace(
        spec,
        options=options,
        peak_memory=spec.peak_memory if spec.peak_memory >= 0 or decl.peak_memory <= 0 else decl.peak_memory,
        device_kind="gpu" if decl.device_kind == "gpu" else spec.device_kind,
    )


def gpu_views(views: Sequence[DeviceView], *, pinned: str = "") -> list[DeviceView] | NoFit:
    """The devices a task that needs a GPU may go to (none yet: it waits), or why it can never run as asked."""
    if pinned and not pinned.startswith("cuda"):
        return NoFit(f"the task needs a GPU (device_kind = 'gpu') but is pinned to {pinned}")
    return [v for v in views if v.device.startswith("cuda")]


def pending_reason(spec: p.TaskSpec, views: Sequence[DeviceView], known: Collection[str]) -> str:
    """Why a task that placement left without a device waits (``views``: the devices it may go to)."""
    if spec.device_kind == "gpu" and not views:
        return f"needs a GPU (device_kind = 'gpu'); no CUDA device here (devices: {', '.join(known) or 'none yet'})"
    if spec.device:
        return f"pinned to {spec.device}, which no training rank has announced yet"
    if views and all(view.departed for view in views):
        left = ", ".join(sorted(view.device for view in views))
        return f"the training ranks of {left} have left (their job ended); it waits for a job to train here"
    return "no training rank has announced a device yet"


def last_lines(traceback: str, n: int = TRACEBACK_LINES) -> str:
    """The last ``n`` lines of a traceback: where it was raised, and the error."""
    return "\n".join(traceback.rstrip().splitlines()[-n:])
