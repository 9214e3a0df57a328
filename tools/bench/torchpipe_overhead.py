"""What side tasks in a torch.distributed.pipelining job's bubbles cost the job, and how much of the bubbles they use.

For each schedule (default: 1F1B, interleaved 1F1B, ZBV), runs the same 2-stage
training (``tools/train/torchpipe_gpt.py``, torchtitan-style, unmodified) for N
steps, alternately alone (no FreeRide at all) and under ``freeride launch`` with
one iterative side task per stage, each pinned to its stage's device (on CPU: the
stage's core, shared with the side task as a GPU would be). Before that, the job
is profiled with ``freeride profile`` and a manager is started with the profile::

    python tools/bench/torchpipe_overhead.py --pairs 8 --steps 25 -- --hidden 256 --seq 64

Per schedule, a warm-up run of each kind comes first and is left out; then
``--pairs`` pairs (alone and with side tasks, the order alternating) and
``--controls`` A/A pairs (alone and alone: the noise floor), interleaved in
time. Side tasks run at the stage's own priority (``--side-priority same``)
unless ``--side-priority low`` is given.

Reports, as markdown: the training slowdown per pair (step time, and the
training ranks' CPU time per step) as a median with a bootstrap 95 % interval,
the A/A floor beside it and whether the interval lies below the 0.5 % goal;
interference, the share of bubble time the side tasks spent in steps (from
``freeride status``), their throughput, grant latency and overruns. A pair whose
side tasks finished, failed or did no steps is named and left out.
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

__all__ = ["SCHEDULE_ARGS", "main"]

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "torchpipe_gpt.py"
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
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(ap, steps=25)
    ap.add_argument(
        "--schedules", default=DEFAULT_SCHEDULES, help=f"comma-separated, among: {', '.join(SCHEDULE_ARGS)}"
    )
    add_side_task_args(ap)
    ap.add_argument("train_args", nargs="*", help="after --: arguments for tools/train/torchpipe_gpt.py")
    ns = ap.parse_args(argv)
    schedules = tuple(s.strip() for s in ns.schedules.split(",") if s.strip())
    unknown = set(schedules) - SCHEDULE_ARGS.keys()
    if not schedules or unknown:
        ap.error(f"schedules must be among {sorted(SCHEDULE_ARGS)}, got {schedules}")
    command = shlex.join(["python", "tools/bench/torchpipe_overhead.py", *argv])
    try:
        task = side_tasks(ns)
        options = bench_options(ns)
    except ValueError as exc:
        ap.error(str(exc))
    sections = ["## torch.distributed.pipelining: training with side tasks in its bubbles"]
    for schedule in schedules:
        job = Job(
            title=f"### torch.distributed.pipelining {schedule}: training with side tasks in its bubbles",
            script=SCRIPT,
            args=(*SCHEDULE_ARGS[schedule], *ns.train_args),
        )
        sections.append(bench(job, task, options, command=command))
    print("\n\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
