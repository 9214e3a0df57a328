"""Graph SGD side task: the per-edge update rule, recovery of a planted matrix, exact resume, packing."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _sidetaskfix import cpu_context, deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.sidetask import run_alone
from freeride.sidetasks.graph_sgd import GraphSGD, planted_ratings, read_ratings

SMALL: dict[str, Any] = {
    "users": 300,
    "items": 200,
    "rank": 4,
    "density": 0.2,
    "noise": 0.1,
    "batch_edges": 1024,
    "seed": 7,
}


async def test_one_step_applies_the_gardenia_edge_updates(tmp_path: Path) -> None:
    opts: dict[str, Any] = {"users": 6, "items": 5, "rank": 2, "density": 0.8, "lr": 0.3, "l2": 0.05, "holdout": 0.2}
    n_train = len(GraphSGD(**opts).train_idx)
    task = GraphSGD(**opts, batch_edges=n_train)  # one step visits every training edge once
    await task.setup(cpu_context(tmp_path))
    p0, q0 = task.p.clone(), task.q.clone()
    await run_alone(task, steps=1, ctx=cpu_context(tmp_path))
    # Reference: the textbook per-edge update from the factors before the step, summed per row.
    exp_p, exp_q = p0.clone(), q0.clone()
    for e_id in task.train_idx.tolist():
        u, i = (int(v) for v in task.edges[e_id])
        err = float(task.values[e_id]) - task.mu - sum(float(a * b) for a, b in zip(p0[u], q0[i], strict=True))
        for d in range(task.dim):
            exp_p[u, d] += 0.3 * (err * float(q0[i, d]) - 0.05 * float(p0[u, d]))
            exp_q[i, d] += 0.3 * (err * float(p0[u, d]) - 0.05 * float(q0[i, d]))
    torch.testing.assert_close(task.p, exp_p, rtol=0, atol=1e-5)
    torch.testing.assert_close(task.q, exp_q, rtol=0, atol=1e-5)
    assert not torch.equal(task.p, p0)


async def test_recovers_a_planted_low_rank_matrix(tmp_path: Path) -> None:
    task = GraphSGD(**SMALL, dim=8)
    await run_alone(task, steps=60, ctx=cpu_context(tmp_path))
    m = task.metrics()
    assert m["baseline_rmse"] > 0.9  # the planted entries spread about 1 around their mean
    assert m["test_rmse"] < 0.35 * m["baseline_rmse"]
    # Predictions of held-out cells agree with the planted values, not just on average.
    p, q, mu = task.factors()
    u, i = task.edges[task.test_idx, 0], task.edges[task.test_idx, 1]
    pred = mu + (p[u] * q[i]).sum(1)
    assert torch.corrcoef(torch.stack([pred, task.values[task.test_idx]]))[0, 1] > 0.9


async def test_training_error_goes_down(tmp_path: Path) -> None:
    task = GraphSGD(**SMALL)
    seen: list[float] = []
    for _ in range(6):
        await run_alone(task, steps=10, ctx=cpu_context(tmp_path))
        seen.append(task.metrics()["train_rmse"])
    assert seen[-1] < 0.5 * seen[0]
    assert all(b < a for a, b in itertools.pairwise(seen[1:]))


async def test_resume_from_disk_is_bit_identical(tmp_path: Path) -> None:
    straight = GraphSGD(**SMALL)
    await run_alone(straight, steps=12, ctx=cpu_context(tmp_path))

    first = GraphSGD(**SMALL)
    await run_alone(first, steps=5, ctx=cpu_context(tmp_path))
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    second = GraphSGD(**SMALL)
    second.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    await run_alone(second, steps=7, ctx=cpu_context(tmp_path))

    assert torch.equal(second.p, straight.p) and torch.equal(second.q, straight.q)
    assert second.metrics() == straight.metrics()


async def test_steps_option_ends_the_task(tmp_path: Path) -> None:
    task = GraphSGD(**SMALL, steps=4)
    durations = await run_alone(task, steps=100, ctx=cpu_context(tmp_path))
    assert len(durations) == 4 + 1 and task.done()  # 4 training steps, then the evaluation
    assert not math.isnan(task.metrics()["test_rmse"])  # evaluated when done


def test_planted_ratings_are_distinct_cells() -> None:
    edges, values = planted_ratings(50, 40, rank=3, ratings=500, noise=0.0, seed=1)
    assert len({tuple(e) for e in edges.tolist()}) == 500
    assert values.mean().item() == pytest.approx(3.0, abs=0.2)


async def test_ratings_file(tmp_path: Path) -> None:
    path = tmp_path / "r.txt"
    path.write_text("# user item rating\n7 100 4.0\n7::200::2.5\n9,100,1\n9 300 5 % trailing\n")
    edges, values, users, items = read_ratings(path)
    assert (users, items) == (2, 3)
    assert edges.tolist() == [[0, 0], [0, 1], [1, 0], [1, 2]]
    assert values.tolist() == [4.0, 2.5, 1.0, 5.0]
    task = GraphSGD(ratings_file=str(path), holdout=0.25, dim=2)
    await run_alone(
        task, steps=6, ctx=cpu_context(tmp_path)
    )  # every step ends an epoch: 3 training steps, 3 evaluations
    assert (task.users, task.items) == (2, 3) and task.metrics()["steps"] == 3.0


@pytest.mark.parametrize(
    ("option", "value"),
    [("density", 0.0), ("lr", -1.0), ("holdout", 1.0), ("batch_edges", 0), ("dim", 0), ("target_ms", -1.0)],
)
def test_bad_options_name_the_field(option: str, value: Any) -> None:
    kwargs: dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=option):
        GraphSGD(**kwargs)


def _estimates(known: dict[str, int]) -> Any:
    return lambda kind: known.get(kind, -1)


def test_packing_takes_the_whole_mini_batch_if_it_fits_else_the_largest_share_that_does() -> None:
    task = GraphSGD(**SMALL)  # 1024 edges a mini-batch
    est = _estimates({"": 1000, "e512": 520, "e256": 270})
    assert task.fit_piece(1000, est) == "" and task.step_kind() == ""
    assert task.fit_piece(600, est) == "e512" and task.step_kind() == "e512"
    assert task.fit_piece(300, est) == "e256"
    # a share not measured yet: estimated at 1.5x its part of a whole step (128 edges: 188 units)
    assert task.fit_piece(200, est) == "e128"
    assert task.fit_piece(80, est) is None  # 64 edges, the smallest share, need ~94
    assert task.fit_piece(300, _estimates({})) == ""  # nothing measured: the whole step, to learn it


async def test_pieces_add_up_to_mini_batches_and_resume_exactly(tmp_path: Path) -> None:
    whole = GraphSGD(**SMALL, steps=3)
    await run_alone(whole, steps=10, ctx=cpu_context(tmp_path))
    split = GraphSGD(**SMALL, steps=3)
    await split.setup(cpu_context(tmp_path))
    halves = _estimates({"": 1000, "e512": 500})
    for _ in range(3):  # one and a half mini-batches, in halves
        assert split.fit_piece(600, halves) == "e512"
        split.step()
    assert (split.edges_done, split.done_steps) == (1536, 1)
    state = split.state_dict()
    resumed = GraphSGD(**SMALL, steps=3)
    await resumed.setup(cpu_context(tmp_path))
    resumed.load_state_dict(state)
    assert (resumed.edges_done, resumed.done_steps) == (1536, 1)
    while not resumed.done():
        resumed.step()
    # exactly the requested steps' worth of edges, the same edges as whole steps, in the same order
    assert resumed.edges_done == 3 * 1024 and resumed.cursor.position == whole.cursor.position
    assert resumed.done_steps == whole.done_steps == 3
    assert math.isfinite(resumed.metrics()["test_rmse"])


def test_step_cost_is_the_edges_a_step_touches() -> None:
    task = GraphSGD(**SMALL)
    assert task.step_cost("") == 1024 and task.step_cost("e256") == 256
    assert task.step_cost("eval") == len(task.test_idx)
    assert task.step_cost("other") is None


def test_packing_joins_mini_batches_that_fit_up_to_the_target() -> None:
    est = _estimates({"": 1000, "b2": 2000, "b4": 4000})
    task = GraphSGD(**SMALL)  # target_ms 5: the room bounds these
    assert task.fit_piece(10_000, est) == "b4" and task.step_kind() == "b4"  # b8 not measured nor estimated
    assert task.fit_piece(3000, est) == "b2"  # b4's 4000 would not fit
    assert task.fit_piece(1500, est) == ""
    assert task.step_cost("b4") == 4 * 1024
    narrow = GraphSGD(**SMALL, target_ms=0.003)  # 3000 ns: b4, judged on twice b2 (not run yet), is past it
    assert narrow.fit_piece(10_000, est) == "b2"
    assert GraphSGD(**SMALL, target_ms=0.0).fit_piece(10_000, est) == ""
    assert GraphSGD(**SMALL, steps=3).fit_piece(10_000, est) == "b2"  # never past the requested steps


async def test_joined_mini_batches_are_the_same_updates_as_one_step_each(tmp_path: Path) -> None:
    plain = GraphSGD(**SMALL, steps=7)
    await run_alone(plain, steps=100, ctx=cpu_context(tmp_path))
    joined = GraphSGD(**SMALL, steps=7)
    await joined.setup(cpu_context(tmp_path))
    est = _estimates({"": 1000, "b2": 2000, "b4": 4000})
    kinds = []
    while not joined.done():
        joined.fit_piece(10_000, est)
        kinds.append(joined.step_kind())
        joined.step()
    assert kinds == ["b4", "b2", "", "eval"]  # 4 + 2 + 1 mini-batches, then the final evaluation
    assert joined.done_steps == plain.done_steps == 7 and joined.cursor.position == plain.cursor.position
    assert torch.equal(joined.p, plain.p) and torch.equal(joined.q, plain.q)
    assert joined.test_rmse == plain.test_rmse


async def test_a_due_evaluation_ends_a_joined_step(tmp_path: Path) -> None:
    task = GraphSGD(**SMALL, eval_every=3)
    await task.setup(cpu_context(tmp_path))
    assert task.fit_piece(10_000, _estimates({"": 1000, "b2": 2000, "b4": 4000})) == "b4"
    task.step()
    assert task.done_steps == 3 and task.step_kind() == "eval"  # the fourth mini-batch waits for a later step
