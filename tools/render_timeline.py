"""Render a FreeRide trace as a timeline picture: bubbles per stage, side-task work over them.

One row per stage (device): training compute in grey, announced bubbles shaded,
and each side task's grants (first step start to last step end) drawn over the
bubbles of the device it ran on, one colour per task::

    python tools/render_timeline.py trace.json --out timeline.png --start-step 5 --steps 3

The trace is one written by ``freeride serve --trace`` (see freeride/observe/trace.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from freeride.observe.picture import render
from freeride.observe.timeline import load_trace

__all__ = ["main", "render"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="picture to write (.png, .svg, .pdf)")
    parser.add_argument("--start-step", type=int, help="first training step to draw")
    parser.add_argument("--steps", type=int, help="how many steps to draw")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    try:
        render(load_trace(args.trace), args.out, start_step=args.start_step, steps=args.steps)
    except (OSError, ValueError) as exc:
        print(f"render_timeline: {exc}", file=sys.stderr)
        return 2
    print(f"render_timeline: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
