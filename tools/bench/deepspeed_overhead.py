"""What side tasks in a DeepSpeed job's bubbles cost the job, and how much of the bubbles they use.

Runs the same 2-stage DeepSpeed training (``tools/train/deepspeed_gpt.py``) for N
steps, alternately alone (no FreeRide at all) and under ``freeride launch`` with
one iterative side task per stage, each pinned to its stage's device (on CPU: the
stage's core, shared with the side task as a GPU would be). Before that, the job
is profiled with ``freeride profile`` and the manager started with the profile::

    python tools/bench/deepspeed_overhead.py --pairs 4 --steps 40 -- --hidden 256 --seq 64

Reports, as markdown: the training slowdown (ratio of median step times, with
over alone), the share of bubble time the side tasks spent in steps (from the
manager's status), their throughput, grant latency and overruns.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from _pipeline_bench import Job, add_side_task_args, bench, side_task  # tools/bench is the script's directory

__all__ = ["main"]

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "deepspeed_gpt.py"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="alone/with rounds, interleaved in time")
    ap.add_argument("--steps", type=int, default=30, help="training steps per run")
    add_side_task_args(ap)
    ap.add_argument("--keep", action="store_true", help="keep the runtime directory (logs, profile)")
    ap.add_argument("--hooked", action="store_true", help="also time the hooks with no manager listening")
    ap.add_argument("train_args", nargs="*", help="after --: arguments for tools/train/deepspeed_gpt.py")
    ns = ap.parse_args(argv)
    try:
        task = side_task(ns.task, ns.opt, ns.step_time)
        job = Job(
            title="## DeepSpeed: training with side tasks in its bubbles", script=SCRIPT, args=tuple(ns.train_args)
        )
        section = bench(job, task, pairs=ns.pairs, steps=ns.steps, hooked=ns.hooked, keep=ns.keep)
    except ValueError as exc:
        ap.error(str(exc))
    command = shlex.join(["python", "tools/bench/deepspeed_overhead.py", *argv])
    print(section.replace("\n\n", f"\n\nCommand: `{command}`\n\n", 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
