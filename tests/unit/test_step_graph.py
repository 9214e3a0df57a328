"""A step as a captured CUDA graph: warm-up, capture, replay, and the eager fallback that says why.

CUDA graph capture and replay are replaced by ``tests/standins/fake_cuda_graph.py``
because no CUDA exists on CPU machines: it imitates the order of the calls and
a capture that fails, not the recording of kernels. The same on a real device:
``tests/gpu/test_step_graph_cuda.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _files import load
from _sidetaskfix import cpu_context, deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.sidetask import run_alone
from freeride.sidetask.graphs import WARMUP_RUNS, StepGraph
from freeride.sidetasks.pagerank import PageRank

FakeGraphApi: Any = load("tests/standins/fake_cuda_graph.py", "fake_cuda_graph").FakeGraphApi
CUDA = torch.device("cuda", 0)
MS = 1_000_000


def test_a_step_warms_up_then_is_captured_once_and_replayed(caplog: pytest.LogCaptureFixture) -> None:
    api, ran = FakeGraphApi(), []
    graph = StepGraph(lambda: ran.append(1), device=CUDA, name="the step", api=api)
    with caplog.at_level(logging.INFO, logger="freeride.sidetask.graphs"):
        for _ in range(WARMUP_RUNS + 3):
            graph.run()
    assert api.calls == ["warm"] * WARMUP_RUNS + ["capture", "replay", "replay", "replay"]
    assert len(ran) == WARMUP_RUNS + 3  # the capture's own step ran, by its first replay
    assert graph.mode == "graph" and graph.why == ""
    assert "the step runs as a CUDA graph" in caplog.text


def test_a_step_that_cannot_be_captured_runs_eagerly_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    api, ran = FakeGraphApi(fail=RuntimeError("operation not permitted when stream is capturing\nmore")), []
    graph = StepGraph(lambda: ran.append(1), device=CUDA, name="the step", api=api, warmup=1)
    with caplog.at_level(logging.WARNING, logger="freeride.sidetask.graphs"):
        for _ in range(4):
            graph.run()
    assert api.calls == ["warm", "capture"]  # no second try: the step stays as it could always run
    assert len(ran) == 4
    assert graph.mode == "eager"
    assert graph.why == "capture failed: RuntimeError: operation not permitted when stream is capturing"
    assert caplog.text.count("the step runs eagerly: capture failed") == 1


def test_on_a_cpu_a_step_runs_eagerly_without_any_cuda_call() -> None:
    ran: list[int] = []
    graph = StepGraph(lambda: ran.append(1), device=torch.device("cpu"), name="the step")
    graph.run()
    graph.run()
    assert ran == [1, 1] and graph.mode == "eager" and graph.why == "not a CUDA device"


def _pagerank(**extra: Any) -> PageRank:
    options: dict[str, Any] = {"nodes": 3000, "avg_degree": 6.0, "seed": 1, "tol": 1e-300, "max_iters": 23}
    return PageRank(**{**options, "target_ms": 100.0, **extra})


async def _joined(task: PageRank, tmp_path: Path, *, until: int | None = None) -> list[str | None]:
    """Steps of 8, 8, 4, 2 and 1 iterations (the last bounded by max_iters), as a worker fits them."""
    await task.setup(cpu_context(tmp_path))
    estimates = {"": 1 * MS, "i2": 2 * MS, "i4": 4 * MS, "i8": 8 * MS}
    kinds = []
    while not task.done() and (until is None or task.iterations < until):
        kinds.append(task.fit_piece(20 * MS, lambda kind: estimates.get(kind, -1)))
        task.step()
    return kinds


async def test_graphed_pagerank_steps_give_the_ranks_of_eager_ones(tmp_path: Path) -> None:
    plain = _pagerank()
    await run_alone(plain, steps=1000, ctx=cpu_context(tmp_path))
    graphed = _pagerank()
    graphed.graph_api = api = FakeGraphApi()
    assert await _joined(graphed, tmp_path) == ["i8", "i8", "i4", "i2", ""]
    assert api.calls.count("capture") == 0  # each count of iterations ran once: all warm-up so far
    assert graphed.iterations == plain.iterations == 23
    assert torch.equal(graphed.ranks, plain.ranks) and graphed.residual == plain.residual

    again = _pagerank(max_iters=8 * (WARMUP_RUNS + 2))
    again.graph_api = api = FakeGraphApi()
    await again.setup(cpu_context(tmp_path))
    while not again.done():
        again.fit_piece(20 * MS, lambda kind: {"": MS, "i2": 2 * MS, "i4": 4 * MS, "i8": 8 * MS}.get(kind, -1))
        again.step()
    assert api.calls == ["warm"] * WARMUP_RUNS + ["capture", "replay", "replay"]
    straight = _pagerank(max_iters=again.max_iters)
    await run_alone(straight, steps=1000, ctx=cpu_context(tmp_path))
    assert torch.equal(again.ranks, straight.ranks) and again.residual == straight.residual


async def test_a_graphed_pagerank_checkpoint_is_its_own_and_resumes_exactly(tmp_path: Path) -> None:
    straight = _pagerank()
    straight.graph_api = FakeGraphApi()
    await _joined(straight, tmp_path)
    first = _pagerank()
    first.graph_api = FakeGraphApi()
    await _joined(first, tmp_path, until=16)
    state = first.state_dict()
    saved = state["ranks"].clone()
    first.fit_piece(20 * MS, lambda kind: MS if kind == "" else -1)
    first.step()  # a step after the checkpoint updates the ranks in place: not the checkpoint's copy
    assert torch.equal(state["ranks"], saved)
    second = _pagerank()
    second.graph_api = FakeGraphApi()
    second.load_state_dict(state)
    await second.setup(cpu_context(tmp_path))
    assert second.iterations == 16
    await _joined(second, tmp_path)
    assert torch.equal(second.ranks, straight.ranks) and second.iterations == 23
    first.load_state_dict(state)  # back to the checkpoint in the same task, whose graphs hold the old vector
    await _joined(first, tmp_path)
    assert torch.equal(first.ranks, straight.ranks) and first.iterations == 23


async def test_a_pagerank_step_that_cannot_be_captured_still_computes_the_ranks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain = _pagerank(max_iters=40)
    await run_alone(plain, steps=1000, ctx=cpu_context(tmp_path))
    failing = _pagerank(max_iters=40)
    failing.graph_api = FakeGraphApi(fail=RuntimeError("CUDA error: operation not supported when capturing"))
    with caplog.at_level(logging.WARNING, logger="freeride.sidetask.graphs"):
        await run_alone(failing, steps=1000, ctx=cpu_context(tmp_path))
    assert failing.iterations == 40 and torch.equal(failing.ranks, plain.ranks)
    assert "pagerank step of 1 iterations runs eagerly: capture failed: RuntimeError" in caplog.text


def test_cuda_graph_is_an_option_of_the_task() -> None:
    assert _pagerank(cuda_graph=False).cuda_graph is False and _pagerank().cuda_graph is True
