"""What side tasks in a megatron-core job's bubbles cost the job, and how much of the bubbles they use.

For each schedule (1F1B, interleaved 1F1B), runs the same 2-stage training
(``tools/train/megatron_gpt.py``) for N steps, alternately alone (no FreeRide at
all) and under ``freeride launch`` with one iterative side task per stage in its
bubbles::

    python tools/bench/megatron_overhead.py --pairs 8 --steps 25 -- --hidden 256 --seq 64
"""

from __future__ import annotations

import sys

from _pipeline_bench import bench, bench_schedules  # tools/bench is the script's directory

__all__ = ["SCHEDULE_ARGS", "main"]

SCHEDULE_ARGS = {"1f1b": ("--schedule", "1f1b"), "interleaved": ("--schedule", "interleaved", "--vpp", "2")}
"""``--schedules`` names -> the training script's flags (2 ranks; interleaved with 2 chunks per rank)."""


def main(argv: list[str] | None = None) -> int:
    return bench_schedules(
        bench,
        argv,
        doc=__doc__,
        bench_script="megatron_overhead.py",
        framework="megatron-core",
        train_script="megatron_gpt.py",
        schedule_args=SCHEDULE_ARGS,
        default="1f1b,interleaved",
    )


if __name__ == "__main__":
    sys.exit(main())
