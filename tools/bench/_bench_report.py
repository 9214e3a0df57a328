"""The pipeline benchmarks' results and their markdown: runs, paired figures, verdict.

Pure: :func:`render` turns a :class:`Section` (what :func:`_pipeline_bench.bench`
measured) into the markdown the benchmarks print, with the statistics of
:mod:`_stats`. Pairs whose run with side tasks is flagged (the side tasks
finished, failed or did no steps in it) are named and left out of the figures.
An interval that covers less than the 95 % asked for (too few pairs: it is then
the whole range of the pairs) says how much it does cover.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from _stats import GOAL, Estimate, paired_slowdown, pairs_needed, verdict, verdict_text  # the script's directory

from freeride import protocol as p
from freeride.observe.stats import median_interval
from freeride.profile import Profile

__all__ = ["MIN_PAIRS", "Role", "RunKind", "RunResult", "Section", "paired", "render"]

RunKind = Literal["alone", "with", "hooked"]
Role = Literal["warmup", "a", "b"]
MIN_PAIRS = 5
"""Fewer pairs than this give an interval too unreliable to judge by; the section says so."""


@dataclass(slots=True)
class RunResult:
    """One run of the training job and what it measured."""

    kind: RunKind
    role: Role
    """``warmup`` (left out), or the ``a`` (alone) or ``b`` side of a pair."""
    pair: int
    """Index of the pair; -1 for a warm-up run."""
    pair_kind: RunKind
    """What the pair compares with alone: ``with``, ``hooked``, or ``alone`` (an A/A control)."""
    step_ms: float
    """Median step time of rank 0 (leading steps left out)."""
    cpu_ms: float | None
    """Sum over ranks of each rank's median CPU time per step; None if the job does not report it."""
    wall_s: float
    held_step_ms: float | None = None
    """Rank 0's median time of the measured steps the manager held back from side work (None: none)."""
    bubble_ns: int = 0
    offered_ns: int = 0
    """The part of :attr:`bubble_ns` offered to side work: neither held back to measure the job's cost nor left
    out by its slowdown budget."""
    used_ns: int = 0
    overruns: int = 0
    overrun_ns: int = 0
    interference_ns: int = 0
    """Side-task compute while the stages trained (the manager's count)."""
    train_ns: int = 0
    """Training time the manager counted in this run (its ``train_ns``, summed over devices)."""
    trained_ns: int = 0
    """Training time by the job's own step times, summed over ranks: what interference is a share of."""
    task_steps: dict[str, int] = field(default_factory=dict)
    """Side-task steps in this run, by ``name@device``."""
    flags: list[str] = field(default_factory=list)
    """Why this run's side tasks did not run through it (finished, failed, no steps)."""
    freeride_cpu_ns: int = 0
    """CPU time the manager and every process under it used during the run (side-task steps included)."""
    manager_cpu_ns: int = 0
    """The part of it the manager's own process used."""
    steps: int = 0
    """Training steps the run was asked for."""
    shown_from: str = ""
    """The title of the section that ran it, where a later section of the same job shows it too (its A/A pairs:
    the job alone does not depend on the side task); "" for a section's own runs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Section:
    """Everything one benchmark section shows."""

    title: str
    command: str
    """The benchmark's own command line."""
    date: str
    load: str
    """Load average of the machine before and after the runs."""
    training: str
    """The training command of one run."""
    task_target: str
    task_options: tuple[str, ...]
    fill_target: str = ""
    """The side task filling the ends of bubbles beside it ("" none)."""
    fill_options: tuple[str, ...] = ()
    side_priority: Literal["same", "low"]
    """The priority the side tasks actually ran at."""
    priority_note: str = ""
    """Why it differs from the one asked for, if it does."""
    profile: Profile
    runs: list[RunResult]
    final: p.StatusReply
    cpu_note: str = ""
    """Why the job reports no CPU time, if it does not."""


def paired(
    runs: Sequence[RunResult], pair_kind: RunKind, figure: Literal["step_ms", "cpu_ms", "held_step_ms"]
) -> list[tuple[float, float]]:
    """``(a, b)`` figures of the unflagged pairs of ``pair_kind``, in pair order (missing figures skip the pair)."""
    by_pair: dict[int, dict[Role, RunResult]] = {}
    for r in runs:
        if r.pair >= 0 and r.pair_kind == pair_kind:
            by_pair.setdefault(r.pair, {})[r.role] = r
    out: list[tuple[float, float]] = []
    for _, sides in sorted(by_pair.items()):
        a, b = sides.get("a"), sides.get("b")
        if a is None or b is None or b.flags:
            continue
        fa, fb = a.step_ms if figure == "held_step_ms" else getattr(a, figure), getattr(b, figure)
        if fa is not None and fb is not None:
            out.append((fa, fb))
    return out


def _pct(x: float) -> str:
    return f"{x:+.2%}".replace("%", " %")


def _pairs(n: int) -> str:
    return f"{n} pair" if n == 1 else f"{n} pairs"


def _goal_text() -> str:
    return f"{GOAL:.1%}".replace("%", " %")


def _estimate(pairs: list[tuple[float, float]]) -> Estimate | None:
    return paired_slowdown(pairs) if pairs else None


def _shortfall(est: Estimate) -> str:
    """What the interval covers if that is less than asked, else "": a reader is never told 95 % where it is not."""
    if est.coverage >= est.confidence:
        return ""
    asked = f"{est.confidence:.0%}".replace("%", " %")
    covers = f"{est.coverage:.1%}".replace("%", " %")
    return f"{asked} interval needs {_pairs(pairs_needed(est.confidence))}: min .. max covers {covers}"


def _interval(est: Estimate) -> str:
    """``low .. high``, with its shortfall in parentheses if it has one."""
    shortfall = _shortfall(est)
    return f"{_pct(est.low)} .. {_pct(est.high)}" + (f" ({shortfall})" if shortfall else "")


def _figure_row(name: str, est: Estimate | None, *, judged: bool, missing: str) -> str:
    if est is None:
        return f"| {name} | {missing} | | 0 | |"
    judgement = ""
    if judged:
        judgement = f"not judged: only {_pairs(est.n)}" if est.n < MIN_PAIRS else verdict(est)
    return f"| {name} | {_pct(est.median)} | {_interval(est)} | {est.n} | {judgement} |"


def _interference(interference_ns: int, trained_ns: int) -> str:
    if trained_ns <= 0:
        return f"{interference_ns / 1e9:.2f} s (no training time: share unknown)"
    return f"{interference_ns / 1e9:.2f} s, {_share(interference_ns, trained_ns)} of {trained_ns / 1e9:.1f} s trained"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.2%}".replace("%", " %")


def _by_device(item: tuple[str, int]) -> tuple[str, str]:
    """Sort key of ``name@device`` entries: by device, then name (the runs table lists counts in that order)."""
    name, _, device = item[0].rpartition("@")
    return device, name


def _run_rows(runs: Sequence[RunResult]) -> list[str]:
    rows = [
        "| run | pair | kind | median step (ms) | CPU/step (ms) | bubble use | overruns | interference | "
        "side-task steps (by device) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(runs):
        pair = "warm-up" if r.role == "warmup" else f"{r.pair} ({'A/A' if r.pair_kind == 'alone' else r.role})"
        cpu = f"{r.cpu_ms:.2f}" if r.cpu_ms is not None else "-"
        if r.kind == "with":
            use = f"{r.used_ns / r.bubble_ns:.1%}" if r.bubble_ns else "no bubbles"
            over = f"{r.overruns} ({r.overrun_ns / 1e6:.0f} ms)"
            inter = (
                f"{r.interference_ns / 1e9:.2f} s ({_share(r.interference_ns, r.trained_ns)})"
                if r.trained_ns > 0
                else f"{r.interference_ns / 1e9:.2f} s"
            )
            steps = ", ".join(f"{n}" for _, n in sorted(r.task_steps.items(), key=_by_device))
        else:
            use = over = inter = steps = "-"
        note = "; ".join(r.flags) if r.flags else ("left out" if r.role == "warmup" else "")
        if r.shown_from:
            note = f"from the section '{r.shown_from.lstrip('# ')}'" + (f"; {note}" if note else "")
        rows.append(
            f"| {i} | {pair} | {r.kind} | {r.step_ms:.2f} | {cpu} | {use} | {over} | {inter} | {steps} | {note} |"
        )
    return rows


def _priority_text(section: Section) -> str:
    if section.side_priority == "same":
        text = (
            "Side tasks ran at the stage's own CPU priority (`--side-priority same`, the benchmarks' default): "
            "a side-task step that runs past a bubble's end delays the stage, as it would on a GPU."
        )
    else:
        text = (
            "Side tasks ran at nice 19 (`--side-priority low`, the production default on CPU): the stage preempts "
            "a side-task step that runs past a bubble's end, which a GPU would not, so on CPU overruns cost "
            "training less than they would on a GPU."
        )
    return f"{text} ({section.priority_note})" if section.priority_note else text


def _verdict_text(wall: Estimate | None, floor: Estimate | None, flagged: int, pairs: int) -> str:
    if wall is None:
        if flagged:
            return (
                f"**No slowdown figure: in all {flagged} pairs the side tasks finished, failed or did no steps "
                "during the run with them**, so the runs measured nothing of their cost."
            )
        return "**No slowdown figure** (no pairs ran)."
    if wall.n < MIN_PAIRS:
        text = (
            f"**No verdict: only {_pairs(wall.n)} counted, too few for an interval to judge by** (at least "
            f"{MIN_PAIRS}; their median slowdown, {_pct(wall.median)}, is not a measurement)."
        )
    elif shortfall := _shortfall(wall):
        text = (
            f"**Verdict: the wall-time slowdown is {_pct(wall.median)}, interval {_pct(wall.low)} .. "
            f"{_pct(wall.high)} over {_pairs(wall.n)} ({shortfall}): the interval {verdict_text(wall, GOAL)}.**"
        )
    else:
        text = (
            f"**Verdict: the wall-time slowdown is {_pct(wall.median)}, 95 % interval {_pct(wall.low)} .. "
            f"{_pct(wall.high)} over {_pairs(wall.n)}: the interval {verdict_text(wall, GOAL)}.**"
        )
    if flagged:
        text += f" {flagged} of {pairs} pairs were left out (see the notes: their side tasks did not run through)."
    if floor is not None:
        text += (
            f" The A/A noise floor (alone vs. alone) is {_pct(floor.median)}, interval {_interval(floor)}: "
            f"differences smaller than about {floor.half_width:.2%} are below what this "
            "machine resolves with these runs."
        )
    else:
        text += " No A/A pairs ran, so the noise floor is unknown."
    return text


def _meter_row(final: p.StatusReply) -> str:
    """The manager's own measure of the job's cost, pooled over the paired runs with side tasks."""
    pooled = [
        d
        for c in final.costs
        if c.job.startswith("bench-with-with-") and not c.job.endswith("-warmup")
        for d in c.recent
    ]
    what = "| training cost the manager measured on the runs' own steps (held back / harvested pairs, pooled)"
    if not pooled:
        return f"{what} | no pair complete | |"
    est = median_interval(pooled)
    interval = f"{_pct(est.low)} .. {_pct(est.high)}"
    if est.coverage < 0.95:
        interval += f" (covers {est.coverage:.1%})"
    return f"{what} | {_pct(est.median)} ({interval}, {est.n} pairs) | |"


def _offered(used_ns: int, with_runs: Sequence[RunResult]) -> str:
    """What share of the bubble time offered to side work it used, where some was not offered ("" if all was)."""
    bubble, offered = sum(r.bubble_ns for r in with_runs), sum(r.offered_ns for r in with_runs)
    if offered >= bubble or offered <= 0:
        return ""
    return (
        f"; {used_ns / offered:.1%} of the {offered / 1e9:.2f} s offered (the rest held back to measure the job's"
        " cost, or left out by its slowdown budget)"
    )


def _outside_row(with_runs: Sequence[RunResult], *, on_gpu: bool) -> str:
    """FreeRide's CPU time beyond what side-task steps used in bubbles, per training step: what it may take from
    training where no core is spare (the manager's wake-ups, the workers' own work between steps).

    With side work on GPUs the bubble time used is device time, not CPU time: the row gives FreeRide's host
    CPU per training step, nothing subtracted.
    """
    steps = sum(r.steps for r in with_runs)
    if not steps or not any(r.freeride_cpu_ns for r in with_runs):
        return "| FreeRide's CPU beyond bubble time used, per training step | not measured | |"
    total = sum(r.freeride_cpu_ns for r in with_runs) / steps / 1e6
    manager = sum(r.manager_cpu_ns for r in with_runs) / steps / 1e6
    step = statistics.median(r.step_ms for r in with_runs)
    if on_gpu:
        return (
            f"| FreeRide's host CPU per training step (manager {manager:.2f} ms, workers {total - manager:.2f} ms;"
            f" side work on GPUs: their device time is not in it) | {total:.2f} ms, {total / step:.2%} of a"
            f" {step:.1f} ms step | |"
        )
    used = sum(r.used_ns for r in with_runs) / steps / 1e6
    return (
        f"| FreeRide's CPU beyond bubble time used, per training step (manager {manager:.2f} ms, workers"
        f" {total - manager:.2f} ms, less {used:.2f} ms of steps in bubbles) | {total - used:.2f} ms,"
        f" {(total - used) / step:.2%} of a {step:.1f} ms step | |"
    )


def render(section: Section) -> str:
    """The markdown section of one benchmark."""
    runs = section.runs
    with_runs = [r for r in runs if r.kind == "with" and r.role != "warmup"]
    with_pairs = sorted({r.pair for r in with_runs})
    flagged = sum(1 for r in with_runs if r.flags)
    wall = _estimate(paired(runs, "with", "step_ms"))
    cpu = _estimate(paired(runs, "with", "cpu_ms"))
    floor = _estimate(paired(runs, "alone", "step_ms"))
    floor_cpu = _estimate(paired(runs, "alone", "cpu_ms"))
    hooked = _estimate(paired(runs, "hooked", "step_ms"))
    held = _estimate(paired(runs, "with", "held_step_ms"))
    warm = [r for r in runs if r.role == "warmup"]
    warm_alone = next((r for r in warm if r.kind == "alone"), None)
    warm_with = next((r for r in warm if r.kind == "with"), None)
    has_cpu = any(r.cpu_ms is not None for r in runs)
    no_cpu = section.cpu_note or "not reported by this job"
    lines = [
        section.title,
        "",
        f"Command: `{section.command}` ({section.date}; load average {section.load}).",
        "",
        f"Training: `{section.training}`; side task `{section.task_target}` "
        f"({', '.join(section.task_options) or 'defaults'}) pinned to each stage's device"
        + (
            f", with `{section.fill_target}` ({', '.join(section.fill_options) or 'defaults'}) filling the ends"
            " of its bubbles (`--fill`). "
            if section.fill_target
            else ". "
        )
        + _priority_text(section),
        "",
        "| stage | device | step (profile) | bubbles/step | bubble share |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in section.profile.stages:
        lines.append(
            f"| {s.stage} | {s.device} | {s.step_time_ns / 1e6:.1f} ms | {len(s.bubbles)} "
            f"({', '.join(f'{b.key} {b.duration_ns / 1e6:.1f} ms' for b in s.bubbles)}) | {s.bubble_fraction:.1%} |"
        )
    lines += ["", *_run_rows(runs), ""]
    lines += [
        f"| figure (per pair: b / a - 1) | median | 95 % interval | pairs | against the {_goal_text()} goal |",
        "| --- | --- | --- | --- | --- |",
        _figure_row("slowdown, step time (with / alone)", wall, judged=True, missing="no pair counted"),
        _figure_row(
            "slowdown, training ranks' CPU time per step",
            cpu,
            judged=True,
            missing="no pair counted" if has_cpu else no_cpu,
        ),
        _figure_row("A/A noise floor, step time (alone / alone)", floor, judged=False, missing="no A/A pairs"),
        _figure_row(
            "A/A noise floor, CPU time per step", floor_cpu, judged=False, missing="no A/A pairs" if has_cpu else no_cpu
        ),
    ]
    if hooked is not None:
        lines.append(_figure_row("hooks, no manager (hooked / alone)", hooked, judged=False, missing=""))
    if held is not None:
        lines.append(
            _figure_row(
                "FreeRide running, no side work: the steps of the runs with side tasks that the manager held back"
                " (held back / alone)",
                held,
                judged=False,
                missing="",
            )
        )
    if warm_alone is not None and warm_with is not None:
        lines.append(
            f"| warm-up pair, left out (with / alone) | {_pct(warm_with.step_ms / warm_alone.step_ms - 1)} | | 1 | |"
        )
    bubble = sum(r.bubble_ns for r in with_runs)
    used = sum(r.used_ns for r in with_runs)
    overrun = sum(r.overrun_ns for r in with_runs)
    train_s = sum(r.wall_s for r in with_runs)
    steps_by_task: dict[str, int] = {}
    for r in with_runs:
        for name, n in r.task_steps.items():
            steps_by_task[name] = steps_by_task.get(name, 0) + n
    latency = section.final.latency
    lines += [
        "",
        "| metric (runs with side tasks, warm-up left out) | value | goal |",
        "| --- | --- | --- |",
        "| interference: side-task compute while the stage trained | "
        f"{_interference(sum(r.interference_ns for r in with_runs), sum(r.trained_ns for r in with_runs))} | |",
        "| training time the manager counted (`train_ns`), for comparison | "
        f"{sum(r.train_ns for r in with_runs) / 1e9:.1f} s | |",
        f"| bubble time used by side-task steps | {used / bubble:.1%} of {bubble / 1e9:.2f} s"
        f"{_offered(used, with_runs)} | >= 85 % |"
        if bubble
        else "| bubble time used by side-task steps | no bubbles seen | >= 85 % |",
        f"| side-task steps past a bubble's end | {overrun / 1e9:.2f} s in all | |",
        _outside_row(with_runs, on_gpu=any(d.device.startswith("cuda") for d in section.final.devices)),
        f"| side-task throughput | {sum(steps_by_task.values()) / train_s:.1f} steps/s "
        f"({', '.join(f'{d}: {n / train_s:.1f}' for d, n in sorted(steps_by_task.items(), key=_by_device))}) | |"
        if train_s > 0
        else "| side-task throughput | no runs | |",
        _meter_row(section.final),
        f"| bubble start -> side-task step start | p50 {latency.p50_ns / 1e6:.2f} ms, "
        f"p99 {latency.p99_ns / 1e6:.2f} ms ({latency.count} grants) | p99 <= 1 ms |",
        "",
        _verdict_text(wall, floor, flagged, len(with_pairs)),
    ]
    if cpu is not None and cpu.n >= MIN_PAIRS:
        shortfall = _shortfall(cpu)
        lines.append(
            f"By the training ranks' CPU time per step the slowdown is {_pct(cpu.median)} "
            f"({_pct(cpu.low)} .. {_pct(cpu.high)}{'; ' + shortfall if shortfall else ''}): "
            f"the interval {verdict_text(cpu, GOAL)}."
        )
    return "\n".join(lines)
