"""The side task the pipeline benchmarks submit: defaults only for the task they belong to.

``deepspeed_overhead.py --task pagerank`` once crashed: the default
``batch_edges=2048`` of graph SGD was passed to every task. The scripts live in
tools/bench and import their harness as a sibling module, so they are imported
with that directory on sys.path; ``bench`` itself is replaced (nothing runs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "tools" / "bench"


@pytest.fixture
def bench_module(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module


def test_graph_sgd_gets_its_default(bench_module: Callable[[str], ModuleType]) -> None:
    harness = bench_module("_pipeline_bench")
    task = harness.side_task("graph-sgd", [], "2ms")
    assert task.target == "freeride.sidetasks.graph_sgd:GraphSGD"
    assert task.options == ("batch_edges=2048",)


def test_other_tasks_get_no_graph_sgd_default(bench_module: Callable[[str], ModuleType]) -> None:
    harness = bench_module("_pipeline_bench")
    assert harness.side_task("pagerank", [], "2ms").options == ()
    assert harness.side_task("freeride.sidetasks.pagerank:PageRank", ["nodes=1000"], "2ms").options == ("nodes=1000",)


def test_options_override_defaults_key_by_key(bench_module: Callable[[str], ModuleType]) -> None:
    harness = bench_module("_pipeline_bench")
    task = harness.side_task("graph-sgd", ["batch-edges=64", "eval_every=5"], "2ms")
    assert task.options == ("batch_edges=64", "eval_every=5")


@pytest.mark.parametrize(
    ("task", "opts", "step_time", "message"),
    [
        ("no-such-task", [], "2ms", "unknown side task 'no-such-task'"),
        ("pagerank", ["nodes"], "2ms", "--opt expects KEY=VALUE, got 'nodes'"),
        ("pagerank", [], "soon", "soon"),
    ],
)
def test_bad_input_is_a_value_error(
    bench_module: Callable[[str], ModuleType], task: str, opts: list[str], step_time: str, message: str
) -> None:
    harness = bench_module("_pipeline_bench")
    with pytest.raises(ValueError, match=message):
        harness.side_task(task, opts, step_time)


@pytest.mark.parametrize("script", ["deepspeed_overhead", "megatron_overhead", "sim_overhead"])
@pytest.mark.parametrize(
    ("argv", "target", "options"),
    [
        ([], "freeride.sidetasks.graph_sgd:GraphSGD", ("batch_edges=2048",)),
        (["--task", "pagerank"], "freeride.sidetasks.pagerank:PageRank", ()),
        (["--task", "pagerank", "--opt", "nodes=1000"], "freeride.sidetasks.pagerank:PageRank", ("nodes=1000",)),
    ],
)
def test_scripts_submit_the_task_they_were_given(
    bench_module: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    script: str,
    argv: list[str],
    target: str,
    options: tuple[str, ...],
) -> None:
    module = bench_module(script)
    seen: list[Any] = []

    def fake_bench(job: object, task: object, options: object, **kwargs: object) -> str:
        seen.append(task)
        return "## section\n\nbody"

    monkeypatch.setattr(module, "bench", fake_bench)
    assert module.main(argv) == 0
    assert seen, "the script ran no benchmark"
    assert {(t.target, t.options, t.step_time, t.fill) for ts in seen for t in ts} == {(target, options, "2ms", False)}
    capsys.readouterr()


@pytest.mark.parametrize("script", ["deepspeed_overhead", "megatron_overhead", "sim_overhead"])
def test_scripts_submit_a_filler_beside_the_task_with_fill(
    bench_module: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    script: str,
) -> None:
    module = bench_module(script)
    seen: list[Any] = []
    monkeypatch.setattr(module, "bench", lambda job, task, options, **kw: seen.append(task) or "## s\n\nbody")
    argv = ["--task", "resnet50-train", "--fill", "pagerank", "--fill-opt", "nodes=20000"]
    assert module.main(argv) == 0
    tasks = seen[0]
    assert [(t.target, t.options, t.fill) for t in tasks] == [
        ("freeride.sidetasks.vision:ResNet50Training", (), False),
        ("freeride.sidetasks.pagerank:PageRank", ("nodes=20000",), True),
    ]
    assert tasks[1].step_time == "1ms"
    capsys.readouterr()


def test_fill_options_without_a_filler_are_refused(bench_module: Callable[[str], ModuleType]) -> None:
    with pytest.raises(SystemExit):
        bench_module("deepspeed_overhead").main(["--fill-opt", "nodes=1"])
