"""PageRank side task: agreement with networkx, file input, exact resume, joined iterations (packing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import pytest
import torch
from _sidetaskfix import cpu_context, deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.sidetask import run_alone
from freeride.sidetasks.pagerank import PageRank, generate_graph, read_edge_list


def _networkx_reference(graph: nx.DiGraph, alpha: float) -> dict[int, float]:
    """Stationary vector of networkx's Google matrix, by an eigen-solve (no power iteration)."""
    nodes = list(graph)
    google = nx.google_matrix(graph, alpha=alpha, nodelist=nodes)
    values, vectors = np.linalg.eig(google.T)
    v = np.abs(vectors[:, int(np.argmax(values.real))].real)
    return dict(zip(nodes, (v / v.sum()).tolist(), strict=True))


def _digraph(edges: torch.Tensor, nodes: int) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(range(nodes))
    graph.add_edges_from(edges.tolist())
    return graph


async def test_matches_networkx_on_graph_with_dangling_nodes(tmp_path: Path) -> None:
    edges = generate_graph(60, 2.5, seed=3)
    graph = _digraph(edges, 60)
    dangling = [n for n in graph if graph.out_degree(n) == 0]
    assert len(dangling) >= 5, "the generated graph should exercise dangling-node handling"
    task = PageRank(nodes=60, avg_degree=2.5, seed=3, tol=1e-12, max_iters=1000)
    await run_alone(task, steps=1000, ctx=cpu_context(tmp_path))
    assert task.metrics()["converged"] == 1.0
    ours = task.result()
    ref = _networkx_reference(graph, 0.85)
    assert max(abs(ours[n] - ref[n]) for n in ref) < 1e-6
    assert sum(ours.values()) == pytest.approx(1.0, abs=1e-9)


async def test_matches_networkx_pagerank_directly(tmp_path: Path) -> None:
    pytest.importorskip("scipy")  # networkx.pagerank needs scipy, which torch does not bring
    edges = generate_graph(80, 3.0, seed=5)
    task = PageRank(nodes=80, avg_degree=3.0, seed=5, tol=1e-12, max_iters=1000, alpha=0.9)
    await run_alone(task, steps=1000, ctx=cpu_context(tmp_path))
    ref = nx.pagerank(_digraph(edges, 80), alpha=0.9, tol=1e-12, max_iter=1000)
    ours = task.result()
    assert max(abs(ours[n] - ref[n]) for n in ref) < 1e-6


async def test_edge_list_file_with_labels_comments_and_duplicates(tmp_path: Path) -> None:
    text = "# a comment\n10 20\n20,30\n30 10 0.5\n10 20\n% another comment\n40 10\n\n30 50\n"
    path = tmp_path / "g.txt"
    path.write_text(text)
    edges, labels = read_edge_list(path)
    assert labels.tolist() == [10, 20, 30, 40, 50]
    assert edges.shape == (6, 2)
    task = PageRank(graph_file=str(path), tol=1e-12, max_iters=1000)
    await run_alone(task, steps=1000, ctx=cpu_context(tmp_path))
    graph = nx.DiGraph([(10, 20), (20, 30), (30, 10), (40, 10), (30, 50)])
    ref = _networkx_reference(graph, 0.85)
    ours = task.result()
    assert sorted(ours) == sorted(ref)
    assert max(abs(ours[n] - ref[n]) for n in ref) < 1e-6
    assert task.metrics()["edges"] == 5.0  # the duplicate 10->20 counts once


def test_edge_list_rejects_a_line_without_two_ids(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text("1 2\n3\n")
    with pytest.raises(ValueError, match=r"bad.txt:2"):
        read_edge_list(path)


async def test_resume_from_disk_is_bit_identical(tmp_path: Path) -> None:
    opts: dict[str, Any] = {"nodes": 3000, "avg_degree": 6.0, "seed": 1, "tol": 1e-10, "iters_per_step": 2}
    straight = PageRank(**opts)
    await run_alone(straight, steps=10, ctx=cpu_context(tmp_path))

    first = PageRank(**opts)
    await run_alone(first, steps=4, ctx=cpu_context(tmp_path))
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    second = PageRank(**opts)
    second.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    await run_alone(second, steps=6, ctx=cpu_context(tmp_path))

    assert second.iterations == straight.iterations == 20
    assert torch.equal(second.ranks, straight.ranks)
    assert second.residual == straight.residual


async def test_stops_at_tolerance_or_max_iters_and_saves(tmp_path: Path) -> None:
    capped = PageRank(nodes=2000, seed=2, tol=1e-15, max_iters=7)
    durations = await run_alone(capped, steps=100, ctx=cpu_context(tmp_path))
    assert len(durations) == 7 and capped.done() and capped.metrics()["converged"] == 0.0

    loose = PageRank(nodes=2000, seed=2, tol=1e-3, output="out/ranks.pt")
    await run_alone(loose, steps=100, ctx=cpu_context(tmp_path))
    assert loose.residual < 1e-3 and loose.iterations < 100
    saved = torch.load(tmp_path / "out" / "ranks.pt", weights_only=True)
    assert torch.equal(saved["ranks"], loose.ranks)
    assert saved["labels"].tolist() == list(range(2000))


def test_generated_graph_is_heavy_tailed() -> None:
    edges = generate_graph(5000, 8.0, seed=0)
    indeg = torch.bincount(edges[:, 1], minlength=5000).double()
    outdeg = torch.bincount(edges[:, 0], minlength=5000)
    assert indeg.max() > 20 * indeg.mean()
    assert int((outdeg == 0).sum()) > 100
    assert torch.equal(edges, generate_graph(5000, 8.0, seed=0))


async def test_checkpoint_of_another_graph_is_refused(tmp_path: Path) -> None:
    other = PageRank(nodes=99, seed=0)
    await run_alone(other, steps=1, ctx=cpu_context(tmp_path))
    task = PageRank(nodes=100, seed=0)
    task.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="nodes=99"):
        await task.setup(cpu_context(tmp_path))


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("alpha", 1.0),
        ("tol", 0.0),
        ("max_iters", 0),
        ("iters_per_step", 0),
        ("dtype", "int8"),
        ("nodes", 0),
        ("target_ms", -1.0),
        ("target_ms", float("inf")),
    ],
)
def test_bad_options_name_the_field(option: str, value: Any) -> None:
    kwargs: dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=option):
        PageRank(**kwargs)


MS = 1_000_000


def test_a_piece_joins_the_most_iterations_that_fit_the_room_and_the_largest_piece() -> None:
    estimates = {"": 1 * MS, "i2": 2 * MS, "i4": 4 * MS, "i8": 8 * MS}
    known = lambda kind: estimates.get(kind, -1)  # noqa: E731
    task = PageRank(nodes=50, max_iters=1000)  # target_ms 5.0
    assert task.fit_piece(30 * MS, known) == "i4" and task.step_kind() == "i4"
    assert task.step_cost("i4") == 4 * task.step_cost("") == 4.0
    wide = PageRank(nodes=50, max_iters=1000, target_ms=100.0, iters_per_step=3)
    assert wide.fit_piece(30 * MS, known) == "i8"  # i16 is not measured yet (nor estimated): not joined
    assert wide.step_cost("i8") == 24.0
    assert wide.fit_piece(5 * MS, known) == "i4"  # the room left bounds it too
    assert wide.fit_piece(int(0.5 * MS), known) == ""  # not even one step fits: the plain step
    assert PageRank(nodes=50, target_ms=0.0).fit_piece(30 * MS, known) == ""
    assert PageRank(nodes=50).fit_piece(30 * MS, lambda kind: -1) == ""  # nothing measured yet
    # never more iterations than max_iters leaves
    assert PageRank(nodes=50, max_iters=5, target_ms=100.0).fit_piece(30 * MS, known) == "i4"


async def test_a_piece_not_run_yet_is_judged_on_twice_the_piece_below_it(tmp_path: Path) -> None:
    task = PageRank(nodes=50, max_iters=1000)
    await task.setup(cpu_context(tmp_path))
    # the plain kind measured once, cold (4 ms); i2 warm (1 ms); i4 as the runtime scales it from both (8 ms)
    estimates = {"": 4 * MS, "i2": 1 * MS, "i4": 8 * MS}
    known = lambda kind: estimates.get(kind, -1)  # noqa: E731
    assert task.fit_piece(30 * MS, known) == ""  # i2 not run yet here: twice the cold 4 ms is past 5 ms
    assert task.fit_piece(30 * MS, lambda kind: {"": 1 * MS, "i2": 2 * MS}.get(kind, -1)) == "i2"
    task.step()  # i2 has run: from now on its own estimate counts
    assert task.fit_piece(30 * MS, known) == "i4"  # twice i2's 1 ms, and the runtime's 8 ms fits the room
    assert task.fit_piece(6 * MS, known) == "i2"  # the runtime's 8 ms for i4 would not fit: not offered


async def test_joined_iterations_give_the_same_ranks_as_one_at_a_time(tmp_path: Path) -> None:
    opts: dict[str, Any] = {"nodes": 3000, "avg_degree": 6.0, "seed": 1, "tol": 1e-300, "max_iters": 23}
    plain = PageRank(**opts)
    await run_alone(plain, steps=1000, ctx=cpu_context(tmp_path))
    joined = PageRank(**opts, target_ms=100.0)
    await joined.setup(cpu_context(tmp_path))
    estimates = {"": 1 * MS, "i2": 2 * MS, "i4": 4 * MS, "i8": 8 * MS}
    kinds = []
    while not joined.done():
        kinds.append(joined.fit_piece(20 * MS, lambda kind: estimates.get(kind, -1)))
        joined.step()
        assert joined.step_kind() == ""  # a piece is chosen for one step only
    assert kinds == ["i8", "i8", "i4", "i2", ""]  # 8 + 8 + 4 + 2 + 1: the last ones bounded by max_iters
    assert joined.iterations == plain.iterations == 23
    assert torch.equal(joined.ranks, plain.ranks)
    assert joined.residual == plain.residual
