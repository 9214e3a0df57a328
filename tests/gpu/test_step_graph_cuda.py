"""Steps as CUDA graphs on a real GPU: captured PageRank steps compute the eager steps' ranks; a step that
reads the device from the host cannot be captured and runs eagerly. The same order of calls on CPU,
through a stand-in of capture and replay: ``tests/unit/test_step_graph.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from freeride.sidetask import TaskContext
from freeride.sidetask.graphs import WARMUP_RUNS, StepGraph
from freeride.sidetasks.pagerank import PageRank

pytestmark = pytest.mark.gpu
MS = 1_000_000


def _ctx(tmp_path: Path) -> TaskContext:
    return TaskContext(task_id=0, device="cuda:0", torch_device="cuda:0", workdir=tmp_path)


async def _run(task: PageRank, tmp_path: Path) -> None:
    await task.setup(_ctx(tmp_path))
    while not task.done():
        task.fit_piece(20 * MS, lambda kind: {"": MS, "i2": 2 * MS, "i4": 4 * MS}.get(kind, -1))
        task.step()


async def test_graphed_pagerank_steps_compute_the_eager_ranks(tmp_path: Path) -> None:
    options: dict[str, Any] = {"nodes": 20_000, "avg_degree": 8.0, "seed": 2, "tol": 1e-300, "target_ms": 100.0}
    iters = 4 * (WARMUP_RUNS + 3)
    eager = PageRank(**options, max_iters=iters, cuda_graph=False)
    await _run(eager, tmp_path)
    graphed = PageRank(**options, max_iters=iters)
    await _run(graphed, tmp_path)
    assert graphed.iterations == eager.iterations == iters
    assert [g.mode for g in graphed._graphs.values()] == ["graph"]  # steps of 4 iterations, captured
    assert torch.allclose(graphed.ranks, eager.ranks, rtol=1e-12, atol=1e-15)


def test_a_step_that_reads_the_device_from_the_host_runs_eagerly() -> None:
    x = torch.ones(1024, device="cuda")
    seen: list[float] = []
    graph = StepGraph(lambda: seen.append(float(x.sum())), device=torch.device("cuda", 0), name="a host read", warmup=1)
    for _ in range(3):
        graph.run()
    assert graph.mode == "eager" and graph.why.startswith("capture failed"), graph.why
    assert seen[-1] == 1024.0
    torch.cuda.synchronize()  # the device is usable after the failed capture
