"""The pipeline benchmarks' report without running anything: what a run with side tasks did, the
tables and their verdict, the PageRank graph, a manager that exits, and the manager's own measure.

``_bench_report`` and ``_pipeline_bench`` live in tools/bench and are imported with
that directory on sys.path (the fixtures in _benchfix). Runs and manager status
replies are made up here; no training job or manager starts.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest
from _benchfix import fixture_harness, fixture_mod, fixture_report  # noqa: F401 - fixtures
from test_bench_harness import _lines

from freeride import protocol as p
from freeride.profile import BubbleProfile, Profile, StageProfile

# -- what a run with side tasks did ------------------------------------------------------------


def _device(name: str, **values: int) -> p.DeviceStatus:
    base = dict(bubbles=0, bubble_ns=0, used_ns=0, overruns=0, overrun_ns=0, steps=0, interference_ns=0, train_ns=0)
    base.update(values)
    return p.DeviceStatus(device=name, stage=0, rank=0, framework="deepspeed", alive=True, spare_memory=-1, **base)


def _task(task_id: int, device: str, steps: int, state: p.TaskState = "running", error: str = "") -> p.TaskStatus:
    return p.TaskStatus(
        task_id=task_id,
        name=f"t{task_id}",
        kind="iterative",
        state=state,
        device=device,
        steps=steps,
        busy_ns=0,
        error=error,
    )


def _reply(devices: list[p.DeviceStatus], tasks: list[p.TaskStatus]) -> p.StatusReply:
    return p.StatusReply(
        devices=devices,
        tasks=tasks,
        latency=p.LatencySummary(count=10, p50_ns=1_000_000, p99_ns=3_000_000, max_ns=4_000_000),
        events=0,
        rejected_frames=0,
        uptime_ns=0,
    )


def _run(report: ModuleType, kind: str, role: str, pair: int, pair_kind: str, step: float, cpu: float | None) -> Any:
    return report.RunResult(kind, role, pair, pair_kind, step, cpu, 10.0)


def test_with_figures_are_deltas(harness: ModuleType, report: ModuleType) -> None:
    before = _reply(
        [_device("cpu:0", bubble_ns=100, used_ns=50, interference_ns=5, train_ns=1000)], [_task(1, "cpu:0", 10)]
    )
    after = _reply(
        [
            _device("cpu:0", bubble_ns=300, used_ns=200, overruns=2, overrun_ns=7, interference_ns=25, train_ns=3000),
            _device("cpu:1", bubble_ns=100, used_ns=80, interference_ns=10, train_ns=2000),
        ],
        [_task(1, "cpu:0", 30), _task(2, "cpu:1", 4)],
    )
    result = _run(report, "with", "b", 0, "with", 100.0, None)
    harness.with_figures(result, before, after)
    assert (result.bubble_ns, result.used_ns, result.overruns, result.overrun_ns) == (300, 230, 2, 7)
    assert (result.interference_ns, result.train_ns) == (30, 4000)
    assert result.task_steps == {"t1@cpu:0": 20, "t2@cpu:1": 4}
    assert result.flags == []


def test_bubble_use_is_also_given_of_the_time_offered_to_side_work(harness: ModuleType, report: ModuleType) -> None:
    """Held-back steps and the slowdown budget take part of the bubble time away from side work: the report gives
    the share used of all of it (the goal's) and of what was offered."""
    before = _reply([_device("cpu:0", bubble_ns=1000, used_ns=100)], [_task(1, "cpu:0", 10)])
    after_device = _device("cpu:0", bubble_ns=3000, used_ns=1300)
    after_device = msgspec.structs.replace(after_device, held_back_ns=300, backed_off_ns=200)
    result = _run(report, "with", "b", 0, "with", 100.0, None)
    harness.with_figures(result, before, _reply([after_device], [_task(1, "cpu:0", 20)]))
    assert (result.bubble_ns, result.offered_ns, result.used_ns) == (2000, 1500, 1200)
    text = report.render(_section(report, [_run(report, "alone", "a", 0, "with", 100.0, None), result]))
    assert "| bubble time used by side-task steps | 60.0% of 0.00 s; 80.0% of the 0.00 s offered (the rest" in text
    result.offered_ns = result.bubble_ns  # all of it offered: one figure
    assert "s offered" not in report.render(_section(report, [result]))


def test_side_task_steps_are_listed_by_device(report: ModuleType) -> None:
    runs = _runs(report, 0.0)
    runs[1].task_steps = {"b@cpu:1": 7, "a@cpu:0": 3}  # by name, cpu:1's task would come first
    text = report.render(_section(report, runs))
    assert "| 3, 7 | left out |" in text


def test_finished_or_idle_side_tasks_flag_the_run(harness: ModuleType, report: ModuleType) -> None:
    before = _reply([], [_task(1, "cpu:0", 10), _task(2, "cpu:1", 10), _task(3, "cpu:1", 1)])
    after = _reply(
        [],
        [_task(1, "cpu:0", 12, state="finished"), _task(2, "cpu:1", 10), _task(3, "cpu:1", 1, "failed", "boom")],
    )
    result = _run(report, "with", "b", 0, "with", 100.0, None)
    harness.with_figures(result, before, after)
    assert result.flags == [
        "t1@cpu:0 finished after 2 steps in this run",
        "t2@cpu:1 did no steps in this run",
        "t3@cpu:1 failed after 0 steps in this run: boom",
    ]
    nothing = _run(report, "with", "b", 0, "with", 100.0, None)
    harness.with_figures(nothing, _reply([], []), _reply([], []))
    assert nothing.flags == ["no side tasks"]


# -- the tables ---------------------------------------------------------------------


def _profile() -> Profile:
    bubble = BubbleProfile(index=0, key="0B0", offset_ns=0, duration_ns=20_000_000, p5_ns=0, p95_ns=0, count=8)
    return Profile(
        stages=[
            StageProfile(
                stage=0,
                rank=0,
                device="cpu:0",
                framework="deepspeed",
                num_stages=2,
                num_microbatches=4,
                steps=8,
                step_time_ns=100_000_000,
                bubble_ns=20_000_000,
                bubbles=[bubble],
            )
        ]
    )


def _section(report: ModuleType, runs: list[Any], **over: Any) -> Any:
    values: dict[str, Any] = dict(
        title="## Bench",
        command="python tools/bench/x.py --pairs 8",
        date="2026-01-01 00:00 UTC",
        load="0.50 -> 1.50",
        training="python train.py --steps 25",
        task_target="freeride.sidetasks.graph_sgd:GraphSGD",
        task_options=("batch_edges=2048",),
        side_priority="same",
        profile=_profile(),
        runs=runs,
        final=_reply([], []),
    )
    values.update(over)
    return report.Section(**values)


def _with(report: ModuleType, pair: int, step: float, cpu: float | None, **figures: Any) -> Any:
    r = _run(report, "with", "b", pair, "with", step, cpu)
    r.bubble_ns, r.used_ns, r.interference_ns = 2_000_000_000, 1_000_000_000, 100_000_000
    r.train_ns, r.trained_ns = 30_000_000_000, 10_000_000_000
    r.task_steps = {"t1@cpu:0": 100, "t2@cpu:1": 50}
    for key, value in figures.items():
        setattr(r, key, value)
    return r


def _runs(report: ModuleType, slow: float, *, flag_pairs: tuple[int, ...] = (), cpu: bool = True) -> list[Any]:
    runs = [_run(report, "alone", "warmup", -1, "alone", 100.0, 50.0 if cpu else None)]
    runs.append(_with(report, -1, 120.0, 60.0 if cpu else None, role="warmup"))
    for pair in range(8):
        base = 100.0 + pair
        runs.append(_run(report, "alone", "a", pair, "with", base, 50.0 if cpu else None))
        flags = ["t1@cpu:0 finished after 3 steps in this run"] if pair in flag_pairs else []
        runs.append(_with(report, pair, base * (1 + slow), 50.0 * (1 + slow) if cpu else None, flags=flags))
    for pair in range(8, 12):
        runs.append(_run(report, "alone", "a", pair, "alone", 100.0, 50.0 if cpu else None))
        runs.append(_run(report, "alone", "b", pair, "alone", 100.0 + (pair - 10) * 0.1, 50.0 if cpu else None))
    return runs


def test_render_states_the_verdict_and_the_floor(report: ModuleType) -> None:
    text = report.render(_section(report, _runs(report, 0.02)))
    assert "Command: `python tools/bench/x.py --pairs 8` (2026-01-01 00:00 UTC; load average 0.50 -> 1.50)." in text
    assert "`--side-priority same`" in text
    assert "| slowdown, step time (with / alone) | +2.00 % | +2.00 % .. +2.00 % | 8 | above |" in text
    assert "| slowdown, training ranks' CPU time per step | +2.00 % |" in text
    assert "| A/A noise floor, step time (alone / alone) |" in text
    assert "| warm-up pair, left out (with / alone) | +20.00 % | | 1 | |" in text
    assert "**Verdict: the wall-time slowdown is +2.00 %, 95 % interval +2.00 % .. +2.00 % over 8 pairs: " in text
    assert "over 8 pairs: the interval lies above the 0.5 % goal.**" in text
    assert "(+2.00 % .. +2.00 %): the interval lies above the 0.5 % goal." in text
    assert "The A/A noise floor (alone vs. alone) is" in text


def test_a_later_section_shows_and_counts_the_a_a_pairs_an_earlier_one_ran(
    harness: ModuleType, report: ModuleType
) -> None:
    """The GPU check runs its A/A pairs with the first workload only: the job alone does not depend on the side
    task. Each later workload's section counts them in its noise floor, after its own pairs, named as shown."""
    first = harness.Benched("### pagerank in the bubbles", "", _runs(report, 0.0))
    controls = first.controls()
    assert [(r.pair, r.role, r.shown_from) for r in controls[:2]] == [
        (8, "a", "### pagerank in the bubbles"),
        (8, "b", "### pagerank in the bubbles"),
    ]
    assert len(controls) == 8 and all(r.pair_kind == "alone" for r in controls)
    assert all(not r.shown_from for r in first.runs)  # the first section's own runs are not changed
    own = [_with(report, -1, 120.0, 60.0, role="warmup")]
    for pair in range(2):
        own += [_run(report, "alone", "a", pair, "with", 100.0, 50.0), _with(report, pair, 101.0, 50.5)]
    shown = harness._renumbered(controls, after=own)
    assert sorted({r.pair for r in shown}) == [2, 3, 4, 5]
    text = report.render(_section(report, [*own, *shown]))
    floor = next(line for line in text.splitlines() if line.startswith("| A/A noise floor, step time"))
    assert floor.split(" | ")[3] == "4"  # the four A/A pairs of the earlier section
    assert "| slowdown, step time (with / alone) | +1.00 % |" in text
    assert "| alone | 100.00 | 50.00 | - | - | - | - | from the section 'pagerank in the bubbles' |" in text


def test_render_shows_interference_as_seconds_and_share(report: ModuleType) -> None:
    text = report.render(_section(report, _runs(report, 0.0)))
    # 8 counted runs with side tasks, 0.1 s of 10 s each; the warm-up is left out
    assert "| interference: side-task compute while the stage trained | 0.80 s, 1.00 % of 80.0 s trained | |" in text
    assert "| training time the manager counted (`train_ns`), for comparison | 240.0 s | |" in text
    assert "| 1 | warm-up | with | 120.00 | 60.00 | 50.0% | 0 (0 ms) | 0.10 s (1.00 %) | 100, 50 | left out |" in text
    assert "the interval lies below the 0.5 % goal" in text


def test_freeride_cpu_is_not_less_the_bubble_time_used_where_side_work_ran_on_gpus(report: ModuleType) -> None:
    """On a GPU the bubble time used is device time: subtracting it from FreeRide's CPU time would say nothing."""
    runs = _runs(report, 0.0)
    for r in runs:
        r.steps, r.freeride_cpu_ns, r.manager_cpu_ns, r.used_ns = 25, 50_000_000, 10_000_000, 25_000_000
    on_cpu = report.render(_section(report, runs, final=_reply([_device("cpu:0")], [])))
    assert "| FreeRide's CPU beyond bubble time used, per training step (manager 0.40 ms, workers 1.60 ms," in on_cpu
    assert "less 1.00 ms of steps in bubbles) | 1.00 ms," in on_cpu
    on_gpu = report.render(_section(report, runs, final=_reply([_device("cuda:0")], [])))
    assert "| FreeRide's host CPU per training step (manager 0.40 ms, workers 1.60 ms; side work on GPUs" in on_gpu
    assert "| 2.00 ms, " in on_gpu and "less 1.00 ms" not in on_gpu


def test_render_without_training_time_says_the_share_is_unknown(report: ModuleType) -> None:
    runs = _runs(report, 0.0)
    for r in runs:
        r.trained_ns = r.interference_ns = 0
    text = report.render(_section(report, runs))
    assert "0.00 s (no training time: share unknown)" in text


def test_flagged_pairs_are_named_and_left_out(report: ModuleType) -> None:
    text = report.render(_section(report, _runs(report, 0.0, flag_pairs=(1, 4))))
    assert "| slowdown, step time (with / alone) | +0.00 % | +0.00 % .. +0.00 % | 6 | below |" in text
    assert "2 of 8 pairs were left out" in text
    assert text.count("t1@cpu:0 finished after 3 steps in this run") == 2


def test_no_slowdown_when_the_side_tasks_never_ran(report: ModuleType) -> None:
    text = report.render(_section(report, _runs(report, 0.2, flag_pairs=tuple(range(8)))))
    assert "**No slowdown figure: in all 8 pairs the side tasks finished, failed or did no steps" in text
    assert "| slowdown, step time (with / alone) | no pair counted | | 0 | |" in text
    assert "| slowdown, training ranks' CPU time per step | no pair counted | | 0 | |" in text
    assert "Verdict" not in text


def test_few_pairs_are_not_judged_as_a_fact(report: ModuleType) -> None:
    runs = [r for r in _runs(report, 0.02) if r.pair < 2]
    text = report.render(_section(report, runs))
    assert "| 2 | not judged: only 2 pairs |" in text
    assert "**No verdict: only 2 pairs counted, too few for an interval to judge by**" in text
    assert "Verdict:" not in text
    assert "By the training ranks' CPU time" not in text
    assert "No A/A pairs ran, so the noise floor is unknown." in text


def test_low_priority_and_missing_cpu_time_are_said(report: ModuleType) -> None:
    section = _section(
        report,
        _runs(report, 0.0, cpu=False),
        side_priority="low",
        priority_note="this `freeride serve` has no --side-priority: side tasks ran at nice 19",
        cpu_note="none: timed by the wall clock",
    )
    text = report.render(section)
    assert "Side tasks ran at nice 19 (`--side-priority low`" in text
    assert "(this `freeride serve` has no --side-priority: side tasks ran at nice 19)" in text
    assert "| slowdown, training ranks' CPU time per step | none: timed by the wall clock | | 0 | |" in text
    assert "By the training ranks' CPU time" not in text


# -- the slowly converging PageRank graph ------------------------------------------------------------


def test_dag_edges_point_forward_within_reach(mod: Callable[[str], ModuleType]) -> None:
    dag = mod("pagerank_dag")
    edges = dag.dag_edges(100, 3, 5, 0)
    assert edges == dag.dag_edges(100, 3, 5, 0)
    assert all(0 < j - i <= 5 and j < 100 for i, j in edges)
    assert len(edges) > 280  # only edges past the last node are dropped


def test_render_of_runs_with_side_tasks_only_gives_their_figures_and_no_slowdown(report: ModuleType) -> None:
    text = report.render(_section(report, [_with(report, 0, 120.0, 60.0), _with(report, 1, 121.0, 61.0)]))
    assert "50.0% of 4.00 s" in text  # bubble time used, over both runs
    assert "no pair counted" in text and "No slowdown figure" in text


def test_a_manager_that_exits_fails_the_wait_at_once_with_its_log(harness: ModuleType, tmp_path: Path) -> None:
    import subprocess
    import sys

    log = tmp_path / "serve.log"
    log.write_text("freeride.gpu.mps.MpsError: nvidia-cuda-mps-control '-d' timed out after 10.0s\n")
    serve = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    serve.wait(30)
    never: Callable[[], bool] = lambda: False  # noqa: E731
    with pytest.raises(harness.ManagerFailed, match=r"(?s)freeride serve exited with 1; its log ends:.*timed out"):
        harness.wait_for_serve("the manager", 20, never, serve, log)  # at once: an exit does not wait 20 s out


# -- the manager's own measure, and what FreeRide costs with no side work ---------------


def test_parse_steps_takes_the_held_back_steps_of_the_runs_job(harness: ModuleType) -> None:
    schedule = harness.holdback_of("bench-with-with-0-b", 2)
    steps = [100.0 + i for i in range(60)]
    figures = harness.parse_steps("\n".join(_lines(0, steps)), schedule)
    slots = [schedule.slot(i) for i in range(60)]
    # held back and measured (not a block's first step), past the steps every figure leaves out
    held = [ms for i, ms in enumerate(steps) if i >= 3 and slots[i] and slots[i].role == "held" and slots[i].measured]
    assert len(held) >= 6 and figures.held_step_ms == statistics.median(held)
    assert harness.parse_steps("\n".join(_lines(0, steps))).held_step_ms is None
    assert harness.holdback_of("x", 0) is None


def test_render_names_the_cost_with_no_side_work_and_the_meters_pooled_figure(report: ModuleType) -> None:
    runs = _runs(report, 0.02)
    for r in runs:
        if r.kind == "with":
            r.held_step_ms = r.step_ms / 1.02 * 1.005  # FreeRide running, side work held back: +0.5 %
    costs = [
        p.TrainingCost(job=f"bench-with-with-{k}-b", steps=40, pairs=4, recent=[0.01, 0.015, 0.02, 0.012])
        for k in range(8)
    ] + [p.TrainingCost(job="bench-with-alone--1-warmup", steps=40, pairs=1, recent=[0.5])]
    final = p.StatusReply(
        devices=[], tasks=[], latency=p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0), events=0,
        rejected_frames=0, uptime_ns=0, costs=costs,
    )  # fmt: skip
    text = report.render(_section(report, runs, final=final))
    assert "| FreeRide running, no side work: the steps of the runs with side tasks" in text
    assert "| +0.50 % | +0.50 % .. +0.50 % | 8 |" in text
    # the warm-up run's job is left out of the pooled pairs
    assert "(held back / harvested pairs, pooled) | +1.35 % (+1.20 % .. +1.50 %, 32 pairs) | |" in text
