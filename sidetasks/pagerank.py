"""PageRank by power iteration over a sparse matrix (a graph-analytics side task).

The graph is either generated (seeded; in- and out-degrees both heavy-tailed,
so there are hubs and many dangling nodes) or read from an edge-list file.
Semantics are those of ``networkx.pagerank`` with default arguments: uniform
teleport, the rank of dangling nodes (no out-edges) spread uniformly, duplicate
edges counted once.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from freeride.sidetask import GraphApi, StepGraph, TaskContext
from freeride.sidetasks._common import DeviceTask, check_fingerprint, joinable, synchronize
from freeride.sidetasks._options import check_at_least, check_file, target_ns

__all__ = ["PageRank", "generate_graph", "read_edge_list"]

logger = logging.getLogger(__name__)

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def generate_graph(nodes: int, avg_degree: float, *, skew: float = 0.8, seed: int = 0) -> torch.Tensor:
    """A random directed graph with heavy-tailed degrees.

    ``nodes * avg_degree`` edges are drawn; each end is picked with probability
    proportional to ``rank ** -skew`` over its own random ranking of the nodes,
    so a few nodes collect most edges and many send none. Duplicates are
    dropped, self-loops kept.

    Returns:
        ``(E, 2)`` int64 tensor of ``(src, dst)`` pairs, sorted.
    """
    g = torch.Generator().manual_seed(seed)
    draws = max(1, round(nodes * avg_degree))
    weights = torch.arange(1, nodes + 1, dtype=torch.float64).pow(-skew)
    ends = []
    for _ in range(2):
        ranking = torch.randperm(nodes, generator=g)
        ends.append(ranking[torch.multinomial(weights, draws, replacement=True, generator=g)])
    keys = torch.unique(ends[0] * nodes + ends[1])
    return torch.stack([keys // nodes, keys % nodes], dim=1)


def read_edge_list(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``src dst`` pairs, one per line (whitespace or commas; ``#``/``%`` comments).

    Extra columns (weights) are ignored. Node ids may be any integers; they
    are renumbered ``0..N-1`` in increasing order.

    Returns:
        ``(edges, labels)``: ``(E, 2)`` int64 renumbered pairs and the ``(N,)``
        original id of each node.

    Raises:
        ValueError: if a line has fewer than two integers or there are no edges.
    """
    pairs: list[int] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.split("#", 1)[0].split("%", 1)[0].replace(",", " ").split()
            if not text:
                continue
            try:
                pairs += (int(text[0]), int(text[1]))
            except (IndexError, ValueError):
                raise ValueError(f"{path}:{lineno}: expected 'src dst', got {line.strip()!r}") from None
    if not pairs:
        raise ValueError(f"{path}: no edges")
    labels, ids = torch.unique(torch.tensor(pairs, dtype=torch.int64), return_inverse=True)
    return ids.view(-1, 2), labels


class PageRank(DeviceTask):
    """PageRank by power iteration; one step is ``iters_per_step`` iterations.

    Options: ``nodes`` (100000) and ``avg_degree`` (8.0), ``skew`` (0.8) and
    ``seed`` (0) for a generated graph, or ``graph_file`` (an edge list; see
    :func:`read_edge_list`); ``alpha`` (0.85, the damping factor), ``tol``
    (1e-6: done once the L1 change of the rank vector in one iteration is
    below it), ``max_iters`` (200: done after this many iterations anyway),
    ``iters_per_step`` (1), ``target_ms`` (5.0, see below), ``dtype``
    ("float64" or "float32"), ``output`` ("": keep the result in memory only;
    else a file, relative to the task's work directory, that receives
    ``{"labels", "ranks"}`` via ``torch.save`` when done), ``cuda_graph``
    (True: on a CUDA device each step's iterations run as one captured CUDA
    graph, see below).

    Packing: iterations are independent units, so a step may join several
    (kinds ``i2``, ``i4``, ...: that many times ``iters_per_step``). Inside a
    grant the task runs the most that fit in the room left and take at most
    ``target_ms`` by their estimate, as a partitioned task's pieces do. The
    runtime's own work between two steps (reading its sockets, fitting the
    next step: 60-90 us on a CPU whose caches the step has just used) is then
    paid once per piece instead of once per iteration, while a bubble that
    ends early still finds at most a short step running. 0 keeps one step
    per ``iters_per_step`` iterations.

    CUDA graphs: on a GPU an iteration is a handful of small kernels and a
    host read of the residual, so an eager step is launch-bound. With
    ``cuda_graph`` a step of ``k`` iterations is one graph
    (:class:`~freeride.sidetask.graphs.StepGraph`, one per ``k``) that updates the
    rank vector in place and reads the residual once, at the step's end: a
    step may then run past convergence by the rest of its iterations (the
    ranks only converge further). Where capture fails the step runs eagerly
    and the log says why.

    Metrics: ``residual``, ``iterations``, ``converged``, ``max_rank``,
    ``nodes``, ``edges``.
    """

    warm_up = False
    """Its result is written when it converges, which no restored state would undo."""

    def __init__(
        self,
        *,
        nodes: int = 100_000,
        avg_degree: float = 8.0,
        skew: float = 0.8,
        seed: int = 0,
        graph_file: str = "",
        alpha: float = 0.85,
        tol: float = 1e-6,
        max_iters: int = 200,
        iters_per_step: int = 1,
        target_ms: float = 5.0,
        dtype: str = "float64",
        output: str = "",
        cuda_graph: bool = True,
    ) -> None:
        super().__init__()
        check_at_least(1, nodes=nodes)
        if not avg_degree > 0:
            raise ValueError(f"avg_degree must be > 0, got {avg_degree}")
        if not skew >= 0:
            raise ValueError(f"skew must be >= 0, got {skew}")
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if not tol > 0:
            raise ValueError(f"tol must be > 0, got {tol}")
        check_at_least(1, max_iters=max_iters, iters_per_step=iters_per_step)
        self._target_ns = target_ns(target_ms)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        check_file(graph_file=graph_file)
        self.nodes, self.avg_degree, self.skew, self.seed = nodes, avg_degree, skew, seed
        self.graph_file = graph_file
        self.alpha, self.tol, self.max_iters, self.iters_per_step = alpha, tol, max_iters, iters_per_step
        self._piece = 1
        """Units of ``iters_per_step`` iterations the next step runs (chosen by :meth:`fit_piece`)."""
        self._ran: set[int] = set()
        """Pieces (in units) run in this process, which the runtime has measured since."""
        self.dtype = _DTYPES[dtype]
        self.output = output
        self.iterations = 0
        self.residual = math.inf
        self.num_edges = 0
        self.labels = torch.empty(0, dtype=torch.int64)
        self.ranks = torch.empty(0, dtype=self.dtype)
        self._matrix = torch.empty(0)
        self._dangling = torch.empty(0)
        self._workdir = Path.cwd()
        self._saved = False
        self.cuda_graph = cuda_graph
        self.graph_api: GraphApi | None = None
        """The CUDA graph calls (None: ``torch.cuda``'s on a CUDA device); a stand-in runs the graphed path on CPU."""
        self._graphs: dict[int, StepGraph] = {}
        """One graph per count of iterations a step runs."""
        self._next = torch.empty(0)
        self._residual_dev = torch.empty(0)

    def _build(self, ctx: TaskContext) -> None:
        self._workdir = ctx.workdir
        if self.graph_file:
            edges, self.labels = read_edge_list(Path(self.graph_file).expanduser())
            edges = torch.unique(edges, dim=0)
        else:
            edges = generate_graph(self.nodes, self.avg_degree, skew=self.skew, seed=self.seed)
            self.labels = torch.arange(self.nodes)
        n = self.nodes = len(self.labels)
        self.num_edges = len(edges)
        src, dst = edges[:, 0], edges[:, 1]
        out_degree = torch.bincount(src, minlength=n)
        # Row dst of the transition matrix holds 1/outdeg(src) for each edge src->dst.
        order = torch.argsort(dst * n + src)
        src, dst = src[order], dst[order]
        crow = torch.zeros(n + 1, dtype=torch.int64)
        crow[1:] = torch.cumsum(torch.bincount(dst, minlength=n), 0)
        values = 1.0 / out_degree[src].to(self.dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
            matrix = torch.sparse_csr_tensor(crow, src, values, (n, n), check_invariants=False)
        self._matrix = matrix.to(self.device)
        self._dangling = (out_degree == 0).to(self.device, self.dtype)
        self.ranks = torch.full((n,), 1.0 / n, dtype=self.dtype, device=self.device)
        logger.info("[setup] pagerank: %d nodes, %d edges on %s", n, self.num_edges, self.device)

    def _iterate(self) -> None:
        n = self.nodes
        x = self.ranks
        dangling_mass = torch.dot(self._dangling, x)
        new = torch.mv(self._matrix, x).add_(dangling_mass / n).mul_(self.alpha).add_((1.0 - self.alpha) / n)
        self.residual = float(torch.sum(torch.abs(new - x)))
        self.ranks = new
        self.iterations += 1

    def step_kind(self) -> str:
        return f"i{self._piece}" if self._piece > 1 else ""

    def step_cost(self, kind: str) -> float | None:
        """Iterations a step of ``kind`` runs."""
        if kind == "":
            return float(self.iters_per_step)
        if kind.startswith("i") and kind[1:].isdigit():
            return float(int(kind[1:]) * self.iters_per_step)
        return None

    def fit_piece(self, room_ns: int, estimate_ns: Callable[[str], int]) -> str | None:
        """The most units (a power of two) that fit in ``room_ns`` and, by their estimate, in ``target_ms``.

        A piece not run yet in this process is judged on twice the piece below
        it (see :func:`~freeride.sidetasks._common.joinable`).
        """
        cap = min(room_ns, self._target_ns)
        one = estimate_ns("")
        if one < 0 or one > cap:
            self._piece = 1  # nothing joined fits (or nothing is known): a plain step, which the runtime fits
            return ""
        left = max(1, math.ceil((self.max_iters - self.iterations) / self.iters_per_step))
        units = joinable(room_ns, self._target_ns, one, estimate_ns, lambda n: f"i{n}", ran=self._ran, most=left)
        self._piece = units
        return self.step_kind()

    def _graphed(self) -> bool:
        return self.cuda_graph and (self.device.type == "cuda" or self.graph_api is not None)

    def _iterate_in_place(self, count: int, x: torch.Tensor, new: torch.Tensor, residual: torch.Tensor) -> None:
        """``count`` iterations on ``x``'s own storage (the rank vector), the residual left in ``residual``."""
        n = self.nodes
        for _ in range(count):
            dangling_mass = torch.dot(self._dangling, x)
            new.copy_(torch.mv(self._matrix, x)).add_(dangling_mass / n).mul_(self.alpha).add_((1.0 - self.alpha) / n)
            residual.copy_(torch.sum(torch.abs(new - x)))
            x.copy_(new)

    def _run_graphed(self, count: int) -> None:
        if self._next.shape != self.ranks.shape or self._next.device != self.ranks.device:
            self._next = torch.empty_like(self.ranks)
            self._residual_dev = torch.zeros((), dtype=self.ranks.dtype, device=self.ranks.device)
            self._graphs.clear()
        graph = self._graphs.get(count)
        if graph is None:
            # the buffers are bound now, as a capture fixes them: a graph works on these tensors for good
            buffers = (self.ranks, self._next, self._residual_dev)
            graph = self._graphs[count] = StepGraph(
                lambda: self._iterate_in_place(count, *buffers),
                device=self.device,
                name=f"pagerank step of {count} iterations",
                api=self.graph_api,
            )
        graph.run()
        self.iterations += count
        self.residual = float(self._residual_dev)  # the step's one host read: it waits for the device

    def step(self) -> None:
        units, self._piece = self._piece, 1
        self._ran.add(units)
        if self._graphed():
            count = min(units * self.iters_per_step, self.max_iters - self.iterations)
            if count > 0 and not self.done():
                self._run_graphed(count)
        else:
            for _ in range(units * self.iters_per_step):
                if self.done():
                    break
                self._iterate()
        synchronize(self.device)
        if self.done() and self.output and not self._saved:
            path = self._workdir / self.output
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"labels": self.labels, "ranks": self.ranks.cpu()}, path)
            self._saved = True
            logger.info(
                "[done] pagerank: %d iterations, residual %.3g, saved to %s", self.iterations, self.residual, path
            )

    def done(self) -> bool:
        return self.residual < self.tol or self.iterations >= self.max_iters

    def result(self) -> dict[int, float]:
        """Rank of each node by its original id (meant for small graphs)."""
        return dict(zip(self.labels.tolist(), self.ranks.cpu().tolist(), strict=True))

    def metrics(self) -> dict[str, float]:
        return {
            "residual": self.residual,
            "iterations": float(self.iterations),
            "converged": float(self.residual < self.tol),
            "max_rank": float(self.ranks.max()) if self.ranks.numel() else math.nan,
            "nodes": float(self.nodes),
            "edges": float(self.num_edges),
        }

    def _fingerprint(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "edges": self.num_edges, "alpha": self.alpha}

    def _capture(self) -> dict[str, Any]:
        return {
            "fingerprint": self._fingerprint(),
            # a graphed step updates the ranks in place: the checkpoint keeps its own copy
            "ranks": self.ranks.clone() if self._graphed() else self.ranks,
            "iterations": self.iterations,
            "residual": self.residual,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        check_fingerprint(state, self._fingerprint())
        # a copy: a graphed step updates the ranks in place, and the state stays the caller's
        self.ranks = state["ranks"].to(self.device, self.dtype, copy=True)
        self._graphs.clear()  # captured on the vector this one replaces
        self.iterations = int(state["iterations"])
        self.residual = float(state["residual"])
