"""Pictures of FreeRide timelines: a trace's bubbles and side-task work per stage, or a profile's step.

One row per stage (device): training compute in grey, bubbles shaded, and each
side task's grants (first step start to last step end) drawn over the bubbles
of the device it ran on, one colour per task. :func:`render` draws a trace
(``tools/render_timeline.py``); :func:`render_profile` draws one step of a bubble
profile (``freeride profile --picture``), where each stage's bubbles sit at
their median place and length::

    render_profile(load_profile(Path("job.json")), Path("job.png"))

matplotlib is needed only here, and imported only when drawing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from freeride.observe.timeline import DeviceTimeline, Span, Trace
from freeride.profile import Profile

if TYPE_CHECKING:
    from matplotlib.figure import Figure as FigureType

__all__ = ["profile_trace", "render", "render_profile", "require_matplotlib"]

_INSTALL = "pip install 'matplotlib>=3.8' (FreeRide's plot extra: pip install 'freeride-runtime[plot]')"


def require_matplotlib() -> None:
    """Raise an :class:`ImportError` that says how to get matplotlib, if it cannot be imported."""
    _matplotlib()


def _matplotlib() -> tuple[Any, type[FigureType], Any]:
    try:
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(f"drawing needs matplotlib, which is not installed: {_INSTALL}") from exc
    return matplotlib, Figure, Patch


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


def render(
    trace: Trace,
    out: Path,
    *,
    start_step: int | None = None,
    steps: int | None = None,
    title: str = "",
    dpi: int = 120,
) -> FigureType:
    """Draw ``trace`` (optionally only steps ``start_step`` .. ``start_step + steps - 1``) into ``out``.

    Returns:
        The figure written.

    Raises:
        ValueError: nothing to draw in that range.
        ImportError: matplotlib is not installed (the message says how to get it).
    """
    window = _window(trace, start_step, steps)
    devices = sorted(trace.devices.values(), key=lambda d: (d.stage, d.device))
    rows = {d.device: i for i, d in enumerate(devices)}
    matplotlib, Figure, Patch = _matplotlib()
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
    ax.set_title(title or f"FreeRide timeline{what}")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, frameon=False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return fig


def profile_trace(profile: Profile) -> Trace:
    """One step of ``profile`` as a trace: per stage, a step of its median length with its bubbles."""
    trace = Trace()
    for s in profile.stages:
        bubbles: list[Span] = [(b.offset_ns, min(b.offset_ns + b.duration_ns, s.step_time_ns)) for b in s.bubbles]
        trace.devices[s.device] = DeviceTimeline(
            device=s.device, stage=s.stage, bubbles=bubbles, steps={0: (0, max(s.step_time_ns, 1))}
        )
    return trace


def render_profile(profile: Profile, out: Path, *, title: str = "", dpi: int = 120) -> FigureType:
    """Draw where each stage's bubbles fall in one step of ``profile`` into ``out`` (.png, .svg, .pdf).

    Returns:
        The figure written: one row (y tick) per stage.

    Raises:
        ValueError: The profile has no stages.
        ImportError: matplotlib is not installed (the message says how to get it).
    """
    if not profile.stages:
        raise ValueError("the profile has no stages to draw")
    first = profile.stages[0]
    share = sum(s.bubble_fraction for s in profile.stages) / len(profile.stages)
    title = title or (
        f"{first.framework}: {first.num_stages} stages, {first.num_microbatches} micro-batches,"
        f" bubbles {100 * share:.0f}% of a step (median step, median bubbles)"
    )
    return render(profile_trace(profile), out, start_step=0, steps=1, title=title, dpi=dpi)
