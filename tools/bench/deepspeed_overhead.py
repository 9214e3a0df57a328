"""What side tasks in a DeepSpeed job's bubbles cost the job, and how much of the bubbles they use.

Runs the same 2-stage DeepSpeed training (``tools/train/deepspeed_gpt.py``) for N
steps, alternately alone (no FreeRide at all) and under ``freeride launch`` with
one iterative side task per stage, each pinned to its stage's device (on CPU: the
stage's core, shared with the side task as a GPU would be). Before that, the job
is profiled with ``freeride profile`` and the manager started with the profile::

    python tools/bench/deepspeed_overhead.py --pairs 8 --steps 25 -- --hidden 256 --seq 64 --micro-batch-size 8

A warm-up run of each kind comes first and is left out; then ``--pairs`` pairs
(alone and with side tasks, the order alternating) and ``--controls`` A/A pairs
(alone and alone: the noise floor), interleaved in time. Side tasks run at the
stage's own priority (``--side-priority same``: an overrun delays training as it
would on a GPU) unless ``--side-priority low`` is given.

Reports, as markdown: the training slowdown per pair (step time, and the
training ranks' CPU time per step) as a median with a bootstrap 95 % interval,
the A/A floor beside it and whether the interval lies below the 0.5 % goal;
interference (side-task compute while the stage trained), the share of bubble
time the side tasks spent in steps, their throughput, grant latency and
overruns. A pair whose side tasks finished, failed or did no steps is named and
left out.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from _pipeline_bench import (  # tools/bench is the script's directory
    Job,
    add_bench_args,
    add_side_task_args,
    bench,
    bench_options,
    side_tasks,
)

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "deepspeed_gpt.py"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(ap, steps=25)
    add_side_task_args(ap)
    ap.add_argument("train_args", nargs="*", help="after --: arguments for tools/train/deepspeed_gpt.py")
    ns = ap.parse_args(argv)
    command = shlex.join(["python", "tools/bench/deepspeed_overhead.py", *argv])
    try:
        task = side_tasks(ns)
        options = bench_options(ns)
    except ValueError as exc:
        ap.error(str(exc))
    job = Job(title="## DeepSpeed: training with side tasks in its bubbles", script=SCRIPT, args=tuple(ns.train_args))
    print(bench(job, task, options, command=command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
