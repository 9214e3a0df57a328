"""Reading a FreeRide trace back: bubbles, steps and side-task grants per track.

The inverse of :mod:`freeride.observe.trace`, for ``freeride report`` and
``tools/render_timeline.py``. Accepts the JSON Object and JSON Array forms of
the Trace Event Format, and a file cut short by a crash (it is cut back to its
last whole event).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from freeride import protocol as p
from freeride.observe.trace import SIDE_TASKS_PID, TRAINING_PID

__all__ = [
    "DeviceTimeline",
    "GrantSpan",
    "Span",
    "TaskTimeline",
    "Trace",
    "load_trace",
    "merge_traces",
    "parse_trace",
]

Span = tuple[int, int]
"""``(start_ns, end_ns)``."""


@dataclass(slots=True)
class DeviceTimeline:
    """One training stage's device in a trace."""

    device: str
    stage: int = -1
    bubbles: list[Span] = field(default_factory=list)
    steps: dict[int, Span] = field(default_factory=dict)
    """Step number -> its span."""
    expected: dict[int, int] = field(default_factory=dict)
    """Bubble start -> the length the rank predicted for it when it announced it (where the trace says)."""


@dataclass(frozen=True, slots=True)
class GrantSpan:
    """A side task's work inside one grant: first step start to last step end."""

    start_ns: int
    end_ns: int
    steps: int
    busy_ns: int
    device: str


@dataclass(slots=True)
class TaskTimeline:
    task_id: int
    name: str
    device: str = ""
    grants: list[GrantSpan] = field(default_factory=list)
    interference: list[tuple[int, int]] = field(default_factory=list)
    """Side-task compute after a bubble's end: (bubble end, bubble end + compute) in ns."""
    state: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Trace:
    devices: dict[str, DeviceTimeline] = field(default_factory=dict)
    tasks: dict[int, TaskTimeline] = field(default_factory=dict)
    costs: dict[str, p.TrainingCost] = field(default_factory=dict)
    """Each job's measured training cost, the last figure the trace holds."""


def _decode_events(data: bytes) -> list[dict[str, Any]]:
    """Events of a JSON Object or Array trace; a file cut short by a crash is cut back to its last whole event."""
    for attempt in range(64):
        try:
            doc = msgspec.json.decode(data)
        except msgspec.DecodeError:
            if attempt == 0 and data.lstrip().startswith(b"["):
                data = data.rstrip().rstrip(b",") + b"]"
                continue
            cut = data.rstrip().rfind(b"}", 0, len(data.rstrip()) - 1)
            if cut < 0:
                raise ValueError("not a trace-event JSON file") from None
            data = data[: cut + 1] + (b"]" if data.lstrip().startswith(b"[") else b"]}")
            continue
        events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
        if not isinstance(events, list):
            raise ValueError("traceEvents is not a list")
        return [e for e in events if isinstance(e, dict)]
    raise ValueError("trace file too damaged to read")


def parse_trace(data: bytes) -> Trace:
    """Read the bubbles, steps and side-task grants of a FreeRide trace.

    Raises:
        ValueError: not a trace-event JSON document.
    """
    trace = Trace()
    track_device: dict[int, str] = {}
    for ev in _decode_events(data):
        args = ev.get("args") or {}
        cat, pid = ev.get("cat"), ev.get("pid")
        ts_ns = round(float(ev.get("ts", 0.0)) * 1000)
        dur_ns = round(float(ev.get("dur", 0.0)) * 1000)
        if pid == TRAINING_PID and cat in ("bubble", "step"):
            device = str(args.get("device") or track_device.get(int(ev.get("tid", 0)), ""))
            track_device[int(ev.get("tid", 0))] = device
            timeline = trace.devices.setdefault(device, DeviceTimeline(device=device))
            if cat == "bubble":
                timeline.bubbles.append((ts_ns, ts_ns + dur_ns))
                if (expected := int(args.get("expected_ns", -1))) > 0:
                    timeline.expected[ts_ns] = expected
            else:
                start = int(args.get("start_ns", ts_ns - int(args.get("duration_ns", 0))))
                timeline.steps[int(args["step"])] = (start, start + int(args.get("duration_ns", ts_ns - start)))
                timeline.stage = int(args.get("stage", timeline.stage))
        elif pid == TRAINING_PID and cat == "training_cost" and ev.get("ph") == "i":
            try:
                cost = msgspec.convert(args, p.TrainingCost)
            except msgspec.ValidationError:
                continue  # a figure of another version: the rest of the trace still reads
            trace.costs[cost.job] = cost
        elif pid == SIDE_TASKS_PID and cat in ("side_task", "task_status", "interference"):
            task_id = int(args.get("task_id", ev.get("tid", 0)))
            task = trace.tasks.setdefault(task_id, TaskTimeline(task_id=task_id, name=str(ev.get("name", ""))))
            task.device = str(args.get("device") or task.device)
            if cat == "interference":
                task.interference.append((ts_ns, ts_ns + dur_ns))
            elif cat == "side_task":
                task.grants.append(
                    GrantSpan(
                        ts_ns, ts_ns + dur_ns, int(args.get("steps", 0)), int(args.get("busy_ns", 0)), task.device
                    )
                )
            else:
                task.name = str(args.get("name") or task.name)
                task.state = str(args.get("state", ""))
                task.metrics.update({str(k): float(v) for k, v in (args.get("metrics") or {}).items()})
    for timeline in trace.devices.values():
        timeline.bubbles.sort()
    for task in trace.tasks.values():
        task.grants.sort(key=lambda g: g.start_ns)
    return trace


def load_trace(path: Path) -> Trace:
    """:func:`parse_trace` of a file."""
    return parse_trace(path.read_bytes())


def merge_traces(nodes: Sequence[tuple[str, Trace]]) -> Trace:
    """One trace of one job's traces from several nodes: devices named ``NODE/DEVICE``, task ids kept apart.

    Each node's times stay on its own clock: a report compares times only
    within one device (its steps, bubbles and the grants on it), and a step
    number means the same pipeline step on every node of the job.

    Raises:
        ValueError: two nodes have the same name.
    """
    names = [name for name, _ in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"node names must differ: {names}")
    merged = Trace()
    next_id = 0
    for name, trace in nodes:
        for device, timeline in trace.devices.items():
            key = f"{name}/{device}"
            merged.devices[key] = dataclasses.replace(timeline, device=key)
        for task_id in sorted(trace.tasks):
            task = trace.tasks[task_id]
            merged.tasks[next_id] = dataclasses.replace(
                task,
                task_id=next_id,
                device=f"{name}/{task.device}" if task.device else "",
                grants=[dataclasses.replace(g, device=f"{name}/{g.device}") for g in task.grants],
            )
            next_id += 1
        for job, cost in trace.costs.items():  # every node measures the same job: the one with most pairs
            if job not in merged.costs or cost.pairs > merged.costs[job].pairs:
                merged.costs[job] = cost
    return merged
