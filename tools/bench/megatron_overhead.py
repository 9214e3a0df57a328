"""What side tasks in a megatron-core job's bubbles cost the job, and how much of the bubbles they use.

For each schedule (1F1B, interleaved 1F1B), runs the same 2-stage training
(``tools/train/megatron_gpt.py``) for N steps, alternately alone (no FreeRide at
all) and under ``freeride launch`` with one iterative side task per stage, each
pinned to its stage's device (on CPU: the stage's core, shared with the side task
as a GPU would be). Before that, the job is profiled with ``freeride profile``
and a manager is started with the profile::

    python tools/bench/megatron_overhead.py --pairs 3 --steps 30 -- --hidden 256 --seq 64

Reports, as markdown: the training slowdown (ratio of median step times, with
over alone), the share of bubble time the side tasks spent in steps (from
``freeride status --json``), their throughput, grant latency and overruns.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from _pipeline_bench import Job, add_side_task_args, bench, side_task  # tools/bench is the script's directory

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "megatron_gpt.py"
SCHEDULE_ARGS = {"1f1b": ("--schedule", "1f1b"), "interleaved": ("--schedule", "interleaved", "--vpp", "2")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="alone/with pairs per schedule, interleaved in time")
    ap.add_argument("--steps", type=int, default=30, help="training steps per run")
    ap.add_argument("--schedules", default="1f1b,interleaved", help="comma-separated: 1f1b, interleaved")
    add_side_task_args(ap)
    ap.add_argument("--keep", action="store_true", help="keep the runtime directories (logs, profiles)")
    ap.add_argument("train_args", nargs="*", help="after --: arguments for tools/train/megatron_gpt.py")
    ns = ap.parse_args(argv)
    schedules = tuple(s.strip() for s in ns.schedules.split(",") if s.strip())
    unknown = set(schedules) - SCHEDULE_ARGS.keys()
    if not schedules or unknown:
        ap.error(f"schedules must be among {sorted(SCHEDULE_ARGS)}, got {schedules}")
    sections = []
    try:
        task = side_task(ns.task, ns.opt, ns.step_time)
        for schedule in schedules:
            job = Job(
                title=f"### megatron-core {schedule}: training with side tasks in its bubbles",
                script=SCRIPT,
                args=(*SCHEDULE_ARGS[schedule], *ns.train_args),
            )
            sections.append(bench(job, task, pairs=ns.pairs, steps=ns.steps, keep=ns.keep))
    except ValueError as exc:
        ap.error(str(exc))
    command = shlex.join(["python", "tools/bench/megatron_overhead.py", *argv])
    header = f"## megatron-core: training with side tasks in its bubbles\n\nCommand: `{command}`"
    print("\n\n".join([header, *sections]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
