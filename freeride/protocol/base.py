"""What every message is built from: the protocol version, frame limits, bounded field types, the base Struct."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = [
    "I64_MAX",
    "MAX_CONTROL_FRAME",
    "MAX_ESTIMATE_KINDS",
    "MAX_EVENT_FRAME",
    "MAX_WORKER_FRAME",
    "PROTOCOL_VERSION",
    "Bytes",
    "Cores",
    "Count",
    "CountOrUnknown",
    "DeviceKind",
    "LongText",
    "Message",
    "Metrics",
    "Name",
    "Nanos",
    "NanosOrUnknown",
    "Options",
    "Position",
    "Small",
    "StepEstimatesSummary",
    "Text",
]

PROTOCOL_VERSION = 3
"""Bumped only when a peer of another version could misread a frame."""

# --------------------------------------------------------------------------
# bounds: what a decoder admits. A frame with a value outside them is
# rejected like a malformed one, so no arithmetic in the manager meets an
# integer that msgpack cannot encode again (it stops at 2**64 - 1).
# --------------------------------------------------------------------------

I64_MAX = 2**63 - 1
"""Largest signed 64-bit integer: the ceiling of every time, count and size on the wire."""

MAX_EVENT_FRAME = 64 * 1024
"""Largest backend event frame, in bytes (a Hello with 4096 cores is ~20 kB)."""
MAX_WORKER_FRAME = 4 * 1024 * 1024
"""Largest worker frame (a failure's traceback is the big one)."""
MAX_CONTROL_FRAME = 4 * 1024 * 1024
"""Largest control request (a task's options and command line)."""

_I32_MAX = 2**31 - 1

Nanos = Annotated[int, msgspec.Meta(ge=0, le=I64_MAX)]
"""A monotonic timestamp or a duration, in ns."""
NanosOrUnknown = Annotated[int, msgspec.Meta(ge=-1, le=I64_MAX)]
"""A duration, or -1 for unknown."""
Count = Annotated[int, msgspec.Meta(ge=0, le=I64_MAX)]
"""Steps, events, ids."""
CountOrUnknown = Annotated[int, msgspec.Meta(ge=-1, le=I64_MAX)]
Bytes = Annotated[int, msgspec.Meta(ge=-1, le=I64_MAX)]
"""A size in bytes, or -1 for unknown."""
Small = Annotated[int, msgspec.Meta(ge=0, le=_I32_MAX)]
"""Ranks, stages, pids, cores, versions."""
Position = Annotated[int, msgspec.Meta(ge=-1, le=I64_MAX)]
"""A training step or a bubble's index in it (-1 admitted: before the first step)."""
Name = Annotated[str, msgspec.Meta(max_length=256)]
"""Devices, frameworks, task names, metric keys."""
Text = Annotated[str, msgspec.Meta(max_length=64 * 1024)]
"""Error messages, reasons, paths, targets, one argument."""
LongText = Annotated[str, msgspec.Meta(max_length=1024 * 1024)]
"""A traceback."""
Cores = Annotated[list[Small], msgspec.Meta(max_length=4096)]

Metrics = Annotated[dict[Name, float], msgspec.Meta(max_length=1024)]
"""Named numbers a side task reports (loss, accuracy, images, ...)."""

Options = Annotated[dict[Name, Text | int | float | bool], msgspec.Meta(max_length=1024)]
"""Constructor arguments of a side task: plain scalars only."""

MAX_ESTIMATE_KINDS = 32
"""Step kinds a worker reports estimates of, at most (the status of a task stays small)."""
StepEstimatesSummary = Annotated[dict[Name, NanosOrUnknown], msgspec.Meta(max_length=MAX_ESTIMATE_KINDS)]
"""A task's running step-time estimate per step kind, in ns (-1: not measured yet)."""

DeviceKind = Literal["any", "gpu"]
"""What device a task needs: ``gpu`` is never placed on a CPU device."""


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every message: frozen, keyword-only, tagged by subclasses."""
