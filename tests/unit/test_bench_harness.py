"""The pipeline benchmarks' harness without running anything: flags, the plan of runs, parsing a run,
and one side task profiled alone.

``_pipeline_bench`` and the benchmark scripts live in tools/bench and are imported
with that directory on sys.path (the fixtures in _benchfix), as the scripts import
one another. No training job or manager starts; the report's side is in test_bench_report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from _benchfix import fixture_harness, fixture_mod  # noqa: F401 - fixtures

from freeride.cli.sim import add_pipeline_options, sim_config


def _options(harness: ModuleType, argv: list[str]) -> Any:
    ap = argparse.ArgumentParser()
    harness.add_bench_args(ap, steps=25)
    return harness.bench_options(ap.parse_args(argv))


# -- flags --------------------------------------------------------------------------


def test_defaults_are_eight_pairs_at_the_stages_priority(harness: ModuleType) -> None:
    options = _options(harness, [])
    assert (options.pairs, options.controls, options.steps) == (8, 4, 25)
    assert options.side_priority == "same"
    assert not options.hooked


def test_flags_reach_the_options(harness: ModuleType) -> None:
    options = _options(harness, ["--pairs", "10", "--controls", "0", "--steps", "20", "--side-priority", "low"])
    assert (options.pairs, options.controls, options.steps, options.side_priority) == (10, 0, 20, "low")


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--pairs", "0"], "pairs must be >= 1"), (["--controls", "-1"], "controls"), (["--steps", "3"], "steps")],
)
def test_bad_counts_are_value_errors(harness: ModuleType, argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _options(harness, argv)


def test_side_priority_is_passed_to_serve(harness: ModuleType, tmp_path: Path) -> None:
    cmd = harness.serve_cmd(tmp_path, tmp_path / "p.json", "same")
    assert cmd[cmd.index("serve") :] == [
        "serve",
        "--runtime-dir",
        str(tmp_path),
        "--profile",
        str(tmp_path / "p.json"),
        "--side-priority",
        "same",
    ]
    assert harness.serve_cmd(tmp_path, tmp_path / "p.json", "low")[-2:] == ["--side-priority", "low"]
    assert "--side-priority" not in harness.serve_cmd(tmp_path, tmp_path / "p.json", "same", supported=False)


@pytest.mark.parametrize("script", ["deepspeed_overhead", "megatron_overhead", "sim_overhead"])
def test_scripts_pass_their_options(
    mod: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    script: str,
) -> None:
    module = mod(script)
    seen: list[Any] = []

    def fake_bench(job: Any, task: object, options: Any, **kwargs: Any) -> str:
        seen.append((job, options, kwargs))
        return "## section"

    monkeypatch.setattr(module, "bench", fake_bench)
    argv = ["--pairs", "9", "--controls", "3", "--side-priority", "low", "--steps", "21"]
    assert module.main(argv) == 0
    job, options, kwargs = seen[0]
    assert (options.pairs, options.controls, options.side_priority, options.steps) == (9, 3, "low", 21)
    assert kwargs["command"].endswith(" ".join(argv))
    assert job.profiles_itself == (script == "sim_overhead")
    capsys.readouterr()


def test_the_sim_job_gets_the_shape_its_benchmark_was_given(
    mod: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = mod("sim_overhead")
    jobs: list[Any] = []
    monkeypatch.setattr(module, "bench", lambda job, *_a, **_k: jobs.append(job) or "## section")
    shape = ["--schedule", "interleaved", "--chunks", "2", "--microbatches", "6", "--forward", "5ms"]
    assert module.main([*shape, "--backward", "7ms", "--compute", "spin"]) == 0
    parser = argparse.ArgumentParser()
    add_pipeline_options(parser, compute="cpu")  # as the job's script reads them
    config = sim_config(parser.parse_args(list(jobs[0].args)), endpoint="", stages=2, steps=3)
    assert (config.schedule, config.num_chunks, config.num_microbatches) == ("interleaved", 2, 6)
    assert (config.forward_s, config.backward_s, config.compute) == (0.005, 0.007, "spin")
    capsys.readouterr()


# -- the plan of runs ------------------------------------------------------------------


def test_plan_warms_up_then_alternates_the_order(harness: ModuleType) -> None:
    runs = harness.plan(_options(harness, ["--pairs", "8", "--controls", "4"]))
    assert [(r.kind, r.role) for r in runs[:2]] == [("alone", "warmup"), ("with", "warmup")]
    body = runs[2:]
    assert len(body) == 2 * 12
    for index in range(12):
        first, second = body[2 * index], body[2 * index + 1]
        assert first.pair == second.pair == index
        assert [first.role, second.role] == (["a", "b"] if index % 2 == 0 else ["b", "a"])
    kinds = [r.pair_kind for r in body[::2]]
    assert kinds.count("with") == 8
    assert kinds.count("alone") == 4


def test_plan_spreads_the_controls(harness: ModuleType) -> None:
    runs = harness.plan(_options(harness, ["--pairs", "8", "--controls", "4"]))
    kinds = [r.pair_kind for r in runs[2::2]]
    controls = [i for i, k in enumerate(kinds) if k == "alone"]
    assert controls == [1, 4, 7, 10]  # one A/A pair in every three
    assert all(r.kind == "alone" for r in runs[2:] if r.pair_kind == "alone")


def test_plan_with_hooks_and_without_controls(harness: ModuleType) -> None:
    runs = harness.plan(_options(harness, ["--pairs", "2", "--controls", "0", "--hooked"]))
    assert [r.kind for r in runs if r.role == "warmup"] == ["alone", "hooked", "with"]
    # --hooked adds as many hooked pairs as controls: none here
    assert [r.pair_kind for r in runs if r.role == "a"] == ["with", "with"]
    runs = harness.plan(_options(harness, ["--pairs", "2", "--controls", "2", "--hooked"]))
    assert sorted(r.pair_kind for r in runs if r.role == "a") == ["alone", "alone", "hooked", "hooked", "with", "with"]


def test_plan_after_an_earlier_section_of_the_same_job_warms_up_with_side_tasks_only(harness: ModuleType) -> None:
    runs = harness.plan(harness.BenchOptions(pairs=2, controls=0, warm_alone=False))
    expected = [("with", "warmup"), ("alone", "a"), ("with", "b"), ("with", "b"), ("alone", "a")]
    assert [(r.kind, r.role) for r in runs] == expected


def test_plan_with_only_runs_with_side_tasks(harness: ModuleType) -> None:
    runs = harness.plan(_options(harness, ["--with-only", "3", "--pairs", "8"]))
    assert [(r.kind, r.role, r.pair) for r in runs] == [("with", "b", 0), ("with", "b", 1), ("with", "b", 2)]
    with pytest.raises(ValueError, match="with_only must be >= 0"):
        harness.BenchOptions(with_only=-1)
    assert harness.BenchOptions(pairs=0, with_only=1).with_only == 1  # pairs are not needed then


# -- parsing a run ---------------------------------------------------------------------


def _lines(rank: int, steps: list[float], cpu: list[float] | None = None) -> list[str]:
    out = []
    for i, ms in enumerate(steps):
        record: dict[str, Any] = {"rank": rank, "stage": rank, "step": i, "step_ms": ms}
        if cpu is not None:
            record["cpu_ms"] = cpu[i]
        out.append(json.dumps(record))
    return out


def test_parse_steps_skips_the_first_steps(harness: ModuleType) -> None:
    stdout = "\n".join(
        [
            "some log line",
            *_lines(0, [900, 800, 700, 100, 102, 104], [50, 50, 50, 10, 11, 12]),
            *_lines(1, [900, 800, 700, 100, 102, 104], [60, 60, 60, 20, 20, 20]),
            json.dumps({"rank": 0, "done": True, "median_step_ms": 102}),
        ]
    )
    figures = harness.parse_steps(stdout)
    assert (figures.step_ms, figures.cpu_ms) == (102.0, 11.0 + 20.0)
    assert figures.trained_ns == 2 * (900 + 800 + 700 + 100 + 102 + 104) * 1_000_000


def test_parse_steps_without_cpu_time(harness: ModuleType) -> None:
    figures = harness.parse_steps("\n".join(_lines(0, [1, 1, 1, 5, 6, 7])))
    assert (figures.step_ms, figures.cpu_ms, figures.trained_ns) == (6.0, None, 21_000_000)


def test_parse_steps_needs_enough_steps(harness: ModuleType) -> None:
    with pytest.raises(RuntimeError, match="printed 3 steps"):
        harness.parse_steps("\n".join(_lines(0, [1, 2, 3])))


# -- one side task alone ------------------------------------------------------------------------------


def test_the_profile_takes_resource_usage_as_the_first_measured_step_starts(
    mod: Callable[[str], ModuleType],
) -> None:
    gate = mod("sidetask_profile")._MeasuredGate(2)

    async def steps() -> list[bool]:
        taken = []
        for _ in range(4):
            async with gate.step("k"):
                taken.append(gate.start is not None)
        return taken

    assert asyncio.run(steps()) == [False, False, True, True] and gate.steps == 4


def test_the_profile_gives_page_faults_and_system_time_per_measured_step(
    mod: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    prof = mod("sidetask_profile")
    # the process's usage as the first measured step starts, then once the last has ended
    usage = iter([SimpleNamespace(ru_minflt=100, ru_majflt=0, ru_stime=1.0)])
    end = SimpleNamespace(ru_minflt=500, ru_majflt=4, ru_stime=1.4)
    monkeypatch.setattr(prof.resource, "getrusage", lambda who: next(usage, end))
    options = {"nodes": 1000, "tol": 1e-30, "max_iters": 1000}
    r = prof._child("pagerank", options, steps=4, warmup=1, threads=0, device="cpu")
    assert r["steps"] == 5 and r["median_ms"] > 0
    assert r["faults_per_step"] == pytest.approx((504 - 100) / 4)  # minor and major, over the 4 measured steps
    assert r["sys_ms_per_step"] == pytest.approx(400 / 4)
