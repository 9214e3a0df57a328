"""What side tasks in a DeepSpeed job's bubbles cost the job, and how much of the bubbles they use.

Runs the same 2-stage DeepSpeed training (``tools/train/deepspeed_gpt.py``) for N
steps, alternately alone (no FreeRide at all) and under ``freeride launch`` with
one iterative side task per stage in its bubbles::

    python tools/bench/deepspeed_overhead.py --pairs 8 --steps 25 -- --hidden 256 --seq 64 --micro-batch-size 8
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from _pipeline_bench import Job, bench, bench_parser, parse_bench_args  # tools/bench is the script's directory

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "deepspeed_gpt.py"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = bench_parser(__doc__, steps=25)
    ap.add_argument("train_args", nargs="*", help="after --: arguments for tools/train/deepspeed_gpt.py")
    ns, task, options = parse_bench_args(ap, argv)
    command = shlex.join(["python", "tools/bench/deepspeed_overhead.py", *argv])
    job = Job(title="## DeepSpeed: training with side tasks in its bubbles", script=SCRIPT, args=tuple(ns.train_args))
    print(bench(job, task, options, command=command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
