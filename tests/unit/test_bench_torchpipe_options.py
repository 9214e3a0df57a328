"""tools/bench/torchpipe_overhead.py's options: the side task it submits, the schedules it runs.

The script lives in tools/bench and imports its harness as a sibling module, so
it is imported with that directory on sys.path; ``bench`` itself is replaced
(nothing runs).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "tools" / "bench"
TRAIN_DIR = BENCH_DIR.parent / "train"


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("torchpipe_overhead")


def _run(module: ModuleType, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> list[tuple[Any, Any, Any]]:
    seen: list[tuple[Any, Any, Any]] = []

    def fake_bench(job: object, task: object, options: object, **kwargs: object) -> str:
        seen.append((job, task, options))
        return "## section\n\nbody"

    monkeypatch.setattr(module, "bench", fake_bench)
    assert module.main(argv) == 0
    return seen


@pytest.mark.parametrize(
    ("argv", "target", "options"),
    [
        ([], "freeride.sidetasks.graph_sgd:GraphSGD", ("batch_edges=2048",)),
        (["--task", "pagerank"], "freeride.sidetasks.pagerank:PageRank", ()),
        (["--task", "pagerank", "--opt", "nodes=1000"], "freeride.sidetasks.pagerank:PageRank", ("nodes=1000",)),
    ],
)
def test_it_submits_the_task_it_was_given(
    module: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    target: str,
    options: tuple[str, ...],
) -> None:
    seen = _run(module, monkeypatch, argv)
    assert len(seen) == 3  # 1f1b, interleaved, zbv by default
    assert {(t.target, t.options, t.step_time, t.fill) for _, ts, _ in seen for t in ts} == {
        (target, options, "2ms", False)
    }
    assert "## torch.distributed.pipelining" in capsys.readouterr().out


def test_schedules_steps_and_training_args_reach_each_job(
    module: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--schedules", "dualpipev,interleaved-zb", "--steps", "6", "--with-only", "1", "--", "--hidden", "32"]
    seen = _run(module, monkeypatch, argv)
    jobs = [job for job, _, _ in seen]
    assert [job.args for job in jobs] == [
        ("--schedule", "dualpipev", "--hidden", "32"),
        ("--schedule", "interleaved-zb", "--vpp", "2", "--hidden", "32"),
    ]
    assert all(job.script.name == "torchpipe_gpt.py" and job.script.parent == TRAIN_DIR for job in jobs)
    assert all(opts.steps == 6 and opts.with_only == 1 for _, _, opts in seen)
    capsys.readouterr()


def test_every_schedule_of_the_training_script_is_offered(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TRAIN_DIR))
    train = importlib.import_module("torchpipe_gpt")
    assert set(module.SCHEDULE_ARGS) == set(train.SCHEDULES)
    for name, args in module.SCHEDULE_ARGS.items():
        assert train.parse_args([*args]).schedule == name


@pytest.mark.parametrize(
    "argv",
    [["--schedules", "pipedream"], ["--schedules", ","], ["--steps", "2"], ["--fill-opt", "nodes=1"]],
)
def test_bad_options_are_refused(module: ModuleType, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        module.main(argv)
    assert "error" in capsys.readouterr().err
