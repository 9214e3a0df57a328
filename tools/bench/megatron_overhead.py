"""What side tasks in a megatron-core job's bubbles cost the job, and how much of the bubbles they use.

For each schedule (1F1B, interleaved 1F1B), runs the same 2-stage training
(``tools/train/megatron_gpt.py``) for N steps, alternately alone (no FreeRide at
all) and under ``freeride launch`` with one iterative side task per stage in its
bubbles::

    python tools/bench/megatron_overhead.py --pairs 8 --steps 25 -- --hidden 256 --seq 64
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from _pipeline_bench import (  # tools/bench is the script's directory
    Job,
    bench,
    bench_parser,
    parse_bench_args,
    parse_schedules,
)

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "megatron_gpt.py"
SCHEDULE_ARGS = {"1f1b": ("--schedule", "1f1b"), "interleaved": ("--schedule", "interleaved", "--vpp", "2")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = bench_parser(__doc__, steps=25)
    ap.add_argument("--schedules", default="1f1b,interleaved", help="comma-separated: 1f1b, interleaved")
    ap.add_argument("train_args", nargs="*", help="after --: arguments for tools/train/megatron_gpt.py")
    ns, task, options = parse_bench_args(ap, argv)
    schedules = parse_schedules(ap, ns.schedules, SCHEDULE_ARGS)
    command = shlex.join(["python", "tools/bench/megatron_overhead.py", *argv])
    sections = ["## megatron-core: training with side tasks in its bubbles"]
    for schedule in schedules:
        job = Job(
            title=f"### megatron-core {schedule}: training with side tasks in its bubbles",
            script=SCRIPT,
            args=(*SCHEDULE_ARGS[schedule], *ns.train_args),
        )
        sections.append(bench(job, task, options, command=command))
    print("\n\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
