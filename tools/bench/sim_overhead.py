"""What side tasks in a simulated pipeline's bubbles cost it, and how much of the bubbles they use.

Runs the simulated 2-stage job of ``freeride.backends.sim`` (``tools/bench/_sim_job.py``:
real processes blocked on each other over pipes, each pinned to its core,
compute ``cpu`` burning that core until the stage has had its compute time) for N steps, alone and under ``freeride
launch`` with one iterative side task per stage pinned to the stage's core, on
the same harness as the DeepSpeed and megatron benchmarks::

    python tools/bench/sim_overhead.py --pairs 8 --steps 40

What it shows: with ``--compute cpu`` (the default) a stage's compute lasts
until it has had its CPU time, so a side-task step running past a bubble's end
at the stage's priority delays the stage by the core time it takes, as a side
kernel would hold up a GPU; ``--compute spin`` ends each compute at a wall-clock
deadline however much of the core it got (an overrun then shows only through the
stage's wake-up). The job reports the stages' CPU time per step.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from _pipeline_bench import Job, bench, bench_parser, parse_bench_args  # tools/bench is the script's directory

from freeride.cli.sim import add_pipeline_options, pipeline_argv

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parent / "_sim_job.py"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = bench_parser(__doc__, steps=40)
    add_pipeline_options(ap, compute="cpu")
    ns, task, options = parse_bench_args(ap, argv)
    command = shlex.join(["python", "tools/bench/sim_overhead.py", *argv])
    if ns.microbatches < 1:
        ap.error(f"microbatches must be >= 1, got {ns.microbatches}")
    job = Job(
        title="## Simulated pipeline: side tasks in its bubbles",
        script=SCRIPT,
        args=pipeline_argv(ns),
        profiles_itself=True,
    )
    print(bench(job, task, options, command=command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
