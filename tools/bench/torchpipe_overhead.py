"""What side tasks in a torch.distributed.pipelining job's bubbles cost the job, and how much of the bubbles they use.

For each schedule (default: 1F1B, interleaved 1F1B, ZBV), runs the same 2-stage
training (``tools/train/torchpipe_gpt.py``, torchtitan-style, unmodified) for N
steps, alternately alone (no FreeRide at all) and under ``freeride launch`` with
one iterative side task per stage in its bubbles::

    python tools/bench/torchpipe_overhead.py --pairs 8 --steps 25 -- --hidden 256 --seq 64
"""

from __future__ import annotations

import sys

from _pipeline_bench import bench, bench_schedules  # tools/bench is the script's directory

__all__ = ["SCHEDULE_ARGS", "main"]

SCHEDULE_ARGS = {
    "1f1b": ("--schedule", "1f1b"),
    "gpipe": ("--schedule", "gpipe"),
    "interleaved": ("--schedule", "interleaved", "--vpp", "2"),
    "looped-bfs": ("--schedule", "looped-bfs", "--vpp", "2"),
    "interleaved-zb": ("--schedule", "interleaved-zb", "--vpp", "2"),
    "zbv": ("--schedule", "zbv"),
    "dualpipev": ("--schedule", "dualpipev"),
}
"""``--schedules`` names -> the training script's flags (2 ranks; the multi-stage ones with 2 stages per rank)."""
DEFAULT_SCHEDULES = "1f1b,interleaved,zbv"


def main(argv: list[str] | None = None) -> int:
    return bench_schedules(
        bench,
        argv,
        doc=__doc__,
        bench_script="torchpipe_overhead.py",
        framework="torch.distributed.pipelining",
        train_script="torchpipe_gpt.py",
        schedule_args=SCHEDULE_ARGS,
        default=DEFAULT_SCHEDULES,
    )


if __name__ == "__main__":
    sys.exit(main())
