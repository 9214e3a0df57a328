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

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from freeride.observe.timeline import Span, Trace, load_trace

__all__ = ["main", "render"]

_BUBBLE = "#f4a259"
_COMPUTE = "#9e9e9e"


def _window(trace: Trace, start_step: int | None, steps: int | None) -> Span:
    spans = [
        span
        for d in trace.devices.values()
        for step, span in d.steps.items()
        if (start_step is None or step >= start_step) and (steps is None or step < (start_step or 0) + steps)
    ]
    if not spans and not any(d.steps for d in trace.devices.values()):  # no steps recorded: the whole trace
        spans = [b for d in trace.devices.values() for b in d.bubbles]
        spans += [(g.start_ns, g.end_ns) for t in trace.tasks.values() for g in t.grants]
    if not spans:
        raise ValueError("nothing to draw: the trace has no steps, bubbles or side-task work in that range")
    return min(s for s, _ in spans), max(e for _, e in spans)


def _clip(spans: list[Span], window: Span) -> list[tuple[float, float]]:
    """Spans inside ``window`` as matplotlib (start ms, width ms) pairs, relative to its start."""
    lo, hi = window
    out = []
    for start, end in spans:
        s, e = max(start, lo), min(end, hi)
        if e > s:
            out.append(((s - lo) / 1e6, (e - s) / 1e6))
    return out


def _compute(steps: list[Span], bubbles: list[Span]) -> list[Span]:
    out: list[Span] = []
    for start, end in sorted(steps):
        cursor = start
        for b0, b1 in bubbles:
            if b1 <= cursor or b0 >= end:
                continue
            if b0 > cursor:
                out.append((cursor, b0))
            cursor = max(cursor, b1)
        if end > cursor:
            out.append((cursor, end))
    return out


def render(trace: Trace, out: Path, *, start_step: int | None = None, steps: int | None = None) -> None:
    """Draw ``trace`` (optionally only steps ``start_step`` .. ``start_step + steps - 1``) into ``out``.

    Raises:
        ValueError: nothing to draw in that range.
    """
    window = _window(trace, start_step, steps)
    devices = sorted(trace.devices.values(), key=lambda d: (d.stage, d.device))
    rows = {d.device: i for i, d in enumerate(devices)}
    fig = Figure(figsize=(14, 1.2 + 0.9 * max(len(devices), 1)))  # no pyplot: no global backend state
    ax = fig.add_subplot()
    colours = matplotlib.colormaps["tab10"]
    handles = [Patch(color=_COMPUTE, label="training compute"), Patch(color=_BUBBLE, alpha=0.5, label="bubble")]
    for d in devices:
        y = rows[d.device]
        ax.broken_barh(_clip(_compute(list(d.steps.values()), d.bubbles), window), (y - 0.3, 0.6), color=_COMPUTE)
        ax.broken_barh(_clip(d.bubbles, window), (y - 0.4, 0.8), color=_BUBBLE, alpha=0.5)
    for i, task in enumerate(sorted(trace.tasks.values(), key=lambda t: t.task_id)):
        colour = colours(i % 10)
        drawn = False
        for device, y in rows.items():
            spans = [(g.start_ns, g.end_ns) for g in task.grants if g.device == device]
            bars = _clip(spans, window)
            if bars:
                ax.broken_barh(bars, (y - 0.18, 0.36), color=colour)
                drawn = True
        if drawn:
            handles.append(Patch(color=colour, label=f"{task.name} (task {task.task_id})"))
    ax.set_yticks(range(len(devices)), [f"stage {d.stage}\n{d.device}" for d in devices])
    ax.set_ylim(len(devices) - 0.5, -0.5)
    ax.set_xlim(0, (window[1] - window[0]) / 1e6)
    ax.set_xlabel("time (ms)")
    what = "" if start_step is None else f", steps {start_step}..{start_step + (steps or 1) - 1}"
    ax.set_title(f"FreeRide timeline{what}")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, frameon=False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


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
