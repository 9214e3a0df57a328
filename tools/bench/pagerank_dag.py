"""Write a random DAG as an edge list: a PageRank graph that converges slowly, for long benchmarks.

PageRank on the packaged random graphs reaches an exact fixed point within about
80-110 iterations (less than one benchmark run), so a benchmark of it would
measure side tasks that have finished. On a DAG whose edges all point forward a
short distance, rank mass travels along paths and, with a damping factor near 1,
the iteration keeps changing the ranks far longer (the default graph: ~6,000-8,000
iterations at ``alpha=0.999``; 11,352 at ``alpha=0.9999`` with ``tol=1e-300``,
where the change reaches exactly 0), each iteration costing what one on a random
graph of the same size does. The longest path bounds how long the ranks keep
changing: ``--reach 8`` makes it about 3.7 times longer (71,552 iterations at
``alpha=0.9999``), enough for a 200-step benchmark in which side tasks take
every bubble::

    python tools/bench/pagerank_dag.py /tmp/pagerank-dag.txt [--reach 8]
    python tools/bench/deepspeed_overhead.py --task pagerank --opt graph_file=/tmp/pagerank-dag.txt \\
        --opt alpha=0.9999 --opt tol=1e-300 --opt max_iters=100000000
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

__all__ = ["dag_edges", "main"]


def dag_edges(nodes: int, degree: int, reach: int, seed: int) -> list[tuple[int, int]]:
    """``degree`` edges from each node ``i`` to ``i + 1 .. i + reach`` (drawn with ``seed``), those inside the graph."""
    rng = random.Random(seed)
    edges = []
    for i in range(nodes):
        for _ in range(degree):
            j = i + rng.randint(1, reach)
            if j < nodes:
                edges.append((i, j))
    return edges


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the edge list to write (`src dst` per line)")
    ap.add_argument("--nodes", type=int, default=20_000)
    ap.add_argument("--degree", type=int, default=8, help="edges drawn per node (default 8)")
    ap.add_argument("--reach", type=int, default=64, help="an edge goes at most this many nodes ahead (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    if ns.nodes < 2 or ns.degree < 1 or ns.reach < 1:
        ap.error("nodes must be >= 2, degree and reach >= 1")
    edges = dag_edges(ns.nodes, ns.degree, ns.reach, ns.seed)
    ns.out.write_text("".join(f"{i} {j}\n" for i, j in edges), encoding="utf-8")
    print(f"{len(edges)} edges over {ns.nodes} nodes written to {ns.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
