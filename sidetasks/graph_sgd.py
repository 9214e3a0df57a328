"""Matrix factorisation by SGD over the edges of a bipartite rating graph.

This is the SGD kernel of GPU graph-analytics suites (Gardenia's ``sgd``, the
Lonestar/Galois collaborative filtering): users and items are the two sides of
a bipartite graph, each edge ``(u, i, r)`` is an observed rating, and every
edge pulls the embeddings of its two ends towards explaining it::

    e   = r - (mu + p_u . q_i)
    p_u += lr * (e * q_i - l2 * p_u)
    q_i += lr * (e * p_u - l2 * q_i)

A step applies these updates for a mini-batch of edges at once (the updates of
one row are summed, as the edge-parallel GPU kernels do). ``mu`` is the mean
training rating.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from freeride.sidetask import TaskContext
from freeride.sidetasks._common import DeviceTask, ShuffledCursor, check_fingerprint, joinable, sample_seed
from freeride.sidetasks._options import check_at_least, check_positive, target_ns

__all__ = ["GraphSGD", "planted_ratings", "read_ratings"]

logger = logging.getLogger(__name__)

_EMA = 0.9
_MIN_PIECE = 64
"""The fewest edges a split step processes: below this its fixed cost dominates."""
_UNSEEN_PIECE = 1.5
"""A piece size not measured yet is estimated at this many times its share of a whole step."""


def planted_ratings(
    users: int, items: int, *, rank: int, ratings: int, noise: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Observed entries of a random rank-``rank`` matrix plus Gaussian noise.

    The matrix is ``3 + P Q^T / sqrt(rank)`` with standard normal factors, so
    the entries have mean 3 and unit spread around it before noise.

    Returns:
        ``(edges, values)``: ``(E, 2)`` int64 distinct ``(user, item)`` pairs and
        their float32 ratings.
    """
    g = torch.Generator().manual_seed(sample_seed(seed, -3, 0))
    p = torch.randn(users, rank, generator=g)
    q = torch.randn(items, rank, generator=g)
    cells = torch.randperm(users * items, generator=g)[:ratings]
    u, i = cells // items, cells % items
    values = 3.0 + (p[u] * q[i]).sum(1) / math.sqrt(rank) + noise * torch.randn(len(cells), generator=g)
    return torch.stack([u, i], dim=1), values


def read_ratings(path: Path) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Read ``user item rating`` lines (whitespace, commas or ``::``; ``#``/``%`` comments).

    User and item ids are renumbered ``0..N-1`` separately, in increasing order.

    Returns:
        ``(edges, values, users, items)``.

    Raises:
        ValueError: for a line without three numbers, or a file without ratings.
    """
    us: list[int] = []
    its: list[int] = []
    rs: list[float] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split("%", 1)[0].replace("::", " ").replace(",", " ").split()
            if not fields:
                continue
            try:
                us.append(int(fields[0]))
                its.append(int(fields[1]))
                rs.append(float(fields[2]))
            except (IndexError, ValueError):
                raise ValueError(f"{path}:{lineno}: expected 'user item rating', got {line.strip()!r}") from None
    if not rs:
        raise ValueError(f"{path}: no ratings")
    user_ids, u = torch.unique(torch.tensor(us), return_inverse=True)
    item_ids, i = torch.unique(torch.tensor(its), return_inverse=True)
    return torch.stack([u, i], dim=1), torch.tensor(rs, dtype=torch.float32), len(user_ids), len(item_ids)


class GraphSGD(DeviceTask):
    """Matrix factorisation by edge-parallel SGD; one step is one mini-batch of edges.

    Options: a planted problem (``users`` 2000, ``items`` 1000, ``rank`` 8,
    ``density`` 0.05 of the cells observed, ``noise`` 0.1) or ``ratings_file``
    (see :func:`read_ratings`); ``dim`` (16, embedding width), ``lr`` (0.1),
    ``l2`` (0.01), ``batch_edges`` (4096), ``holdout`` (0.1 of the edges kept
    for testing), ``steps`` (0: until stopped), ``seed`` (0), ``eval_every``
    (0: the test RMSE is computed once per epoch; else every that many steps),
    each evaluation a task step of its own (kind ``"eval"``); ``steps`` counts
    training steps.

    Packing: where a whole mini-batch does not fit in what is left of a
    bubble, the next step takes the largest power-of-two share of it that
    does (kind ``"e<edges>"``, at least 64 edges); training steps count
    mini-batches' worth of edges. Where several fit, one step runs that many
    mini-batches one after the other (kind ``"b<count>"``, a power of two),
    as many as fit and take at most ``target_ms`` (5.0; 0: never) by their
    estimate: the same updates as that many steps, with the runtime's own work
    between two steps paid once (see ``PageRank``, which joins iterations).

    Metrics: ``train_rmse`` (smoothed, on batches before their update),
    ``test_rmse`` (held-out edges), ``baseline_rmse`` (predicting the mean
    training rating for the held-out edges), ``epoch``, ``steps``.
    """

    def __init__(
        self,
        *,
        users: int = 2000,
        items: int = 1000,
        rank: int = 8,
        density: float = 0.05,
        noise: float = 0.1,
        ratings_file: str = "",
        dim: int = 16,
        lr: float = 0.1,
        l2: float = 0.01,
        batch_edges: int = 4096,
        holdout: float = 0.1,
        steps: int = 0,
        seed: int = 0,
        eval_every: int = 0,
        target_ms: float = 5.0,
    ) -> None:
        super().__init__()
        check_at_least(1, users=users, items=items, rank=rank, dim=dim)
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        check_positive(lr=lr)
        check_at_least(0, l2=l2, noise=noise)
        check_at_least(1, batch_edges=batch_edges)
        if not 0 < holdout < 1:
            raise ValueError(f"holdout must be in (0, 1), got {holdout}")
        check_at_least(0, steps=steps, eval_every=eval_every)
        self._target_ns = target_ns(target_ms)
        if ratings_file:
            edges, values, users, items = read_ratings(Path(ratings_file).expanduser())
        else:
            count = max(2, round(users * items * density))
            edges, values = planted_ratings(users, items, rank=rank, ratings=count, noise=noise, seed=seed)
        if len(edges) < 2:
            raise ValueError("need at least two ratings")
        self.users, self.items, self.dim = users, items, dim
        self.lr, self.l2, self.batch_edges, self.steps, self.seed = lr, l2, batch_edges, steps, seed
        self.eval_every = eval_every
        g = torch.Generator().manual_seed(sample_seed(seed, -4, 0))
        order = torch.randperm(len(edges), generator=g)
        n_test = min(len(edges) - 1, max(1, round(len(edges) * holdout)))
        test, train = order[:n_test], order[n_test:]
        self.edges, self.values = edges, values
        self.train_idx, self.test_idx = train, test
        self.mu = float(values[train].mean())
        self.baseline_rmse = float((values[test] - self.mu).square().mean().sqrt())
        self.cursor = ShuffledCursor(len(train), seed=seed)
        self.done_steps = 0
        self.edges_done = 0
        """Training edges processed: ``done_steps`` is this in whole mini-batches."""
        self._piece = 0
        """Edges of the next step when it is a piece of a mini-batch (0: a whole one)."""
        self._join = 1
        """Mini-batches the next step runs one after the other (1: one, or a piece of one)."""
        self._joined: set[int] = set()
        """Counts of joined mini-batches run in this process, which the runtime has measured since."""
        self.train_rmse = math.nan
        self.test_rmse = math.nan
        self._eval_due = False
        self.p = torch.empty(0)
        self.q = torch.empty(0)

    def _build(self, ctx: TaskContext) -> None:
        g = torch.Generator().manual_seed(sample_seed(self.seed, -5, 0))
        scale = 0.1
        self.p = (scale * torch.randn(self.users, self.dim, generator=g)).to(self.device)
        self.q = (scale * torch.randn(self.items, self.dim, generator=g)).to(self.device)
        self.edges = self.edges.to(self.device)
        self.values = self.values.to(self.device)
        self.train_idx = self.train_idx.to(self.device)
        self.test_idx = self.test_idx.to(self.device)
        logger.info(
            "[setup] graph-sgd: %d users, %d items, %d ratings on %s",
            self.users,
            self.items,
            len(self.edges),
            self.device,
        )

    def _rmse(self, idx: torch.Tensor) -> torch.Tensor:
        u, i = self.edges[idx, 0], self.edges[idx, 1]
        err = self.values[idx] - self.mu - (self.p[u] * self.q[i]).sum(1)
        return err.square().mean().sqrt()

    def step_kind(self) -> str:
        if self._eval_due:
            return "eval"
        if self._join > 1:
            return f"b{self._join}"
        return f"e{self._piece}" if self._piece else ""

    def step_cost(self, kind: str) -> float | None:
        """Edges a step of ``kind`` touches (the evaluation: the held-out ones)."""
        if kind == "eval":
            return float(len(self.test_idx))
        if kind.startswith("e") and kind[1:].isdigit():
            return float(int(kind[1:]))
        if kind.startswith("b") and kind[1:].isdigit():
            return float(int(kind[1:]) * self.batch_edges)
        return float(self.batch_edges) if kind == "" else None

    def fit_piece(self, room_ns: int, estimate_ns: Callable[[str], int]) -> str | None:
        """Joined mini-batches, a whole one, or the largest power-of-two share of one that fits in ``room_ns``.

        Joined ones only up to ``target_ms`` by their estimate; a count not run
        yet in this process is judged on twice the count below it (the
        runtime's estimate of it, scaled from every kind measured, is still
        what must fit the room).
        """
        if self._eval_due:
            return None
        whole = estimate_ns("")
        self._join = 1
        if whole < 0 or whole <= room_ns:
            self._piece = 0
            self._join = self._joinable(room_ns, whole, estimate_ns) if whole >= 0 else 1
            return self.step_kind()
        n = self.batch_edges // 2
        while n >= _MIN_PIECE:
            need = estimate_ns(f"e{n}")
            if need < 0:
                need = int(_UNSEEN_PIECE * whole * n / self.batch_edges)
            if need <= room_ns:
                self._piece = n
                return f"e{n}"
            n //= 2
        return None

    def _joinable(self, room_ns: int, whole: int, estimate_ns: Callable[[str], int]) -> int:
        """How many mini-batches (a power of two) the next step may run one after the other."""
        left = 1 << 30  # until stopped
        if self.steps:
            left = math.ceil((self.steps * self.batch_edges - self.edges_done) / self.batch_edges)
        return joinable(room_ns, self._target_ns, whole, estimate_ns, lambda n: f"b{n}", ran=self._joined, most=left)

    def step(self) -> None:
        if self._eval_due:  # a step of its own: it takes many training steps' time
            self.test_rmse = float(self._rmse(self.test_idx))
            self._eval_due = False
            return
        count, self._join = self._join, 1
        if count > 1:
            self._joined.add(count)
        for _ in range(count):
            self._train()
            if self._eval_due:
                break  # the evaluation is a step of its own: the rest waits for a later step

    def _train(self) -> None:
        n = self._piece or self.batch_edges
        self._piece = 0
        if self.steps > 0:  # the last piece stops at the requested steps' worth of edges
            n = max(1, min(n, self.steps * self.batch_edges - self.edges_done))
        epoch, before = self.cursor.epoch, self.done_steps
        batch = torch.tensor(self.cursor.take(n), device=self.device)
        idx = self.train_idx[batch]
        u, i = self.edges[idx, 0], self.edges[idx, 1]
        pu, qi = self.p[u], self.q[i]
        err = self.values[idx] - self.mu - (pu * qi).sum(1)
        self.p.index_add_(0, u, self.lr * (err[:, None] * qi - self.l2 * pu))
        self.q.index_add_(0, i, self.lr * (err[:, None] * pu - self.l2 * qi))
        rmse = float(err.square().mean().sqrt())  # also waits for the step's kernels
        weight = (1 - _EMA) * n / self.batch_edges
        self.train_rmse = rmse if math.isnan(self.train_rmse) else (1 - weight) * self.train_rmse + weight * rmse
        self.edges_done += n
        self.done_steps = self.edges_done // self.batch_edges
        if self.eval_every:
            due = self.done_steps // self.eval_every != before // self.eval_every
        else:
            due = self.cursor.epoch != epoch
        self._eval_due = due or (self.steps > 0 and self.done_steps >= self.steps)

    def done(self) -> bool:
        return self.steps > 0 and self.done_steps >= self.steps and not self._eval_due

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The learned ``(user, item)`` embeddings and the mean; prediction is ``mu + p_u . q_i``."""
        return self.p, self.q, self.mu

    def metrics(self) -> dict[str, float]:
        return {
            "train_rmse": self.train_rmse,
            "test_rmse": self.test_rmse,
            "baseline_rmse": self.baseline_rmse,
            "epoch": float(self.cursor.epoch),
            "steps": float(self.done_steps),
        }

    def _fingerprint(self) -> dict[str, Any]:
        return {"users": self.users, "items": self.items, "dim": self.dim, "ratings": len(self.edges)}

    def _capture(self) -> dict[str, Any]:
        return {
            "fingerprint": self._fingerprint(),
            "p": self.p,
            "q": self.q,
            "position": self.cursor.position,
            "steps": self.done_steps,
            "edges_done": self.edges_done,
            "train_rmse": self.train_rmse,
            "test_rmse": self.test_rmse,
            "eval_due": self._eval_due,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        check_fingerprint(state, self._fingerprint())
        self.p = state["p"].to(self.device, torch.float32).clone()
        self.q = state["q"].to(self.device, torch.float32).clone()
        self.cursor.position = int(state["position"])
        self.done_steps = int(state["steps"])
        self.edges_done = int(state.get("edges_done", self.done_steps * self.batch_edges))
        self.train_rmse = float(state["train_rmse"])
        self.test_rmse = float(state["test_rmse"])
        self._eval_due = bool(state.get("eval_due", False))
