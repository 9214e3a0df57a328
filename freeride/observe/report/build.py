"""Building a :class:`~freeride.observe.report.records.Report` from a FreeRide trace and a baseline trace."""

from __future__ import annotations

import bisect
import fnmatch
import statistics

from freeride.observe.report.options import ReportOptions
from freeride.observe.report.records import Report, StageReport, TaskReport
from freeride.observe.report.saving import price_ratio
from freeride.observe.report.spans import covered, intersect, merge
from freeride.observe.timeline import Span, Trace

__all__ = ["build_report"]


def _unused(bubbles: list[Span], work: list[Span], expected: dict[int, int]) -> tuple[int, int, int, int, int]:
    """Where the bubble time that no work span covers lies: (no work at all, before the first, after the last,
    between two, the part of after the last past the predicted end), summed over ``bubbles`` (sorted,
    disjoint; ``work`` likewise; ``expected``: bubble start -> predicted length, where known)."""
    idle = lead = tail = gap = past = 0
    starts = [w[0] for w in work]
    for b0, b1 in bubbles:
        inside = intersect([(b0, b1)], work[max(0, bisect.bisect_right(starts, b0) - 1) :])
        if not inside:
            idle += b1 - b0
            continue
        lead += inside[0][0] - b0
        tail += b1 - inside[-1][1]
        gap += inside[-1][1] - inside[0][0] - sum(end - start for start, end in inside)
        if b0 in expected:
            past += max(0, b1 - max(inside[-1][1], b0 + expected[b0]))
    return idle, lead, tail, gap, past


def _pipeline_steps(trace: Trace, warmup: int) -> dict[int, int]:
    """Counted step number -> its duration on the slowest stage."""
    durations: dict[int, int] = {}
    for timeline in trace.devices.values():
        for step, (start, end) in timeline.steps.items():
            durations[step] = max(durations.get(step, 0), end - start)
    kept = sorted(durations)[warmup:]
    return {s: durations[s] for s in kept}


def build_report(trace: Trace, options: ReportOptions, baseline: Trace | None = None) -> Report:
    """Compute a :class:`Report` from a FreeRide trace and, optionally, a baseline trace."""
    notes: list[str] = []
    counted = _pipeline_steps(trace, options.warmup_steps)
    stages: list[StageReport] = []
    windows: dict[str, Span | None] = {}
    regions: dict[str, list[Span]] = {}
    for timeline in sorted(trace.devices.values(), key=lambda t: (t.stage, t.device)):
        steps = merge([span for s, span in timeline.steps.items() if s in counted])
        bubbles = merge(timeline.bubbles)
        regions[timeline.device] = intersect(bubbles, steps) if steps else bubbles
        windows[timeline.device] = (steps[0][0], steps[-1][1]) if steps else None
        if not steps:
            notes.append(f"{timeline.device}: no training steps in the trace; all its bubbles counted")
    harvested: dict[str, int] = dict.fromkeys(trace.devices, 0)
    starts = {device: [r[0] for r in region] for device, region in regions.items()}
    tasks: list[TaskReport] = []
    interfered: dict[str, int] = dict.fromkeys(trace.devices, 0)
    for task in sorted(trace.tasks.values(), key=lambda t: t.task_id):
        work = busy = taken = 0
        for start, end in task.interference:
            window = windows.get(task.device)
            if window is not None and not window[0] <= start < window[1]:
                continue
            taken += end - start
            if task.device in interfered:
                interfered[task.device] += end - start
        for g in task.grants:
            window = windows.get(g.device)
            if window is not None and not window[0] <= g.start_ns < window[1]:
                continue
            work, busy = work + g.steps, busy + g.busy_ns
            length = g.end_ns - g.start_ns
            if length > 0 and g.device in harvested:
                # busy time is spread over the grant's span; count the share that lies inside bubbles
                inside = covered(regions[g.device], starts[g.device], (g.start_ns, g.end_ns))
                harvested[g.device] += round(g.busy_ns * inside / length)
        rate = next((r for pat, r in options.throughputs if fnmatch.fnmatchcase(task.name, pat)), None)
        if rate is None and work:
            notes.append(f"task {task.task_id} ({task.name}): no --side-throughput given; not in the saving")
        tasks.append(
            TaskReport(
                task_id=task.task_id,
                name=task.name,
                device=task.device,
                work=work,
                busy_ns=busy,
                throughput_alone=rate,
                interference_ns=taken,
            )
        )
    work_on: dict[str, list[Span]] = {}
    for task in trace.tasks.values():
        for g in task.grants:
            work_on.setdefault(g.device, []).append((g.start_ns, g.end_ns))
    for timeline in sorted(trace.devices.values(), key=lambda t: (t.stage, t.device)):
        steps = [span for s, span in timeline.steps.items() if s in counted]
        spans = merge(work_on.get(timeline.device, []))
        idle, lead, tail, gap, past = _unused(regions[timeline.device], spans, timeline.expected)
        stages.append(
            StageReport(
                device=timeline.device,
                stage=timeline.stage,
                steps=len(steps),
                step_ns=sum(end - start for start, end in steps),
                bubble_ns=sum(end - start for start, end in regions[timeline.device]),
                harvested_ns=harvested[timeline.device],
                interference_ns=interfered[timeline.device],
                idle_ns=idle,
                lead_ns=lead,
                tail_ns=tail,
                tail_past_ns=past,
                gap_ns=gap,
            )
        )
    median = int(statistics.median(counted.values())) if counted else None
    base_median: int | None = None
    if baseline is not None:
        base_steps = _pipeline_steps(baseline, options.warmup_steps)
        if base_steps:
            base_median = int(statistics.median(base_steps.values()))
        else:
            notes.append("the baseline trace has no training steps; no slowdown measured")
    elif counted:
        notes.append("no baseline trace: the saving assumes no training slowdown")
    if not counted:
        notes.append("no training steps in the trace: no step time, no saving")
    train_gpus = options.prices.train_gpus or len(trace.devices)
    k = price_ratio(options.prices, train_gpus)
    return Report(
        stages=stages,
        tasks=tasks,
        steps=len(counted),
        median_step_ns=median,
        baseline_median_step_ns=base_median,
        training_s=sum(counted.values()) / 1e9,
        k=k,
        train_gpus=train_gpus,
        prices=options.prices,
        notes=tuple(notes),
        costs=tuple(trace.costs.values()),
    )
