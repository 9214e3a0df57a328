"""``freeride status --watch``: a live terminal view of a manager.

Every refresh asks the manager for its status and draws, with rich: per device
the share of the last interval spent in bubbles and the share of that bubble
time side tasks used (bars), per task its progress and recent throughput, and
the bubble start -> first step latency. Rates come from the difference between
two consecutive status replies; the first frame shows totals since start.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from freeride import protocol as p
from freeride.units import format_bytes, format_ns, printable

__all__ = ["render", "watch"]

_BLOCKS = " ▏▎▍▌▋▊▉█"


def _bar(fraction: float | None, width: int = 20, style: str = "cyan") -> Text:
    if fraction is None:
        return Text("-".center(width + 7), style="dim")
    f = min(max(fraction, 0.0), 1.0)
    eighths = round(f * width * 8)
    full, part = divmod(eighths, 8)
    cells = "█" * full + (_BLOCKS[part] if part else "")
    text = Text(cells.ljust(width), style=style)
    text.append(f" {fraction:6.1%}", style="bold")
    return text


def _share(num: int, den: int) -> float | None:
    return num / den if den > 0 else None


def _devices(now: p.StatusReply, before: p.StatusReply | None, bar: int) -> Table:
    dt = now.uptime_ns - before.uptime_ns if before is not None else now.uptime_ns
    old = {d.device: d for d in before.devices} if before is not None else {}
    caption = None if now.devices else "no training rank has reported yet"
    table = Table(title="devices", title_justify="left", caption=caption, caption_justify="left")
    for col in ("device", "stage", "rank", "bubble share", "used by side tasks", "bubbles", "steps", "overruns"):
        table.add_column(col, justify="right" if col in ("stage", "rank", "bubbles", "steps", "overruns") else "left")
    table.add_column("interference", justify="right")
    table.add_column("dropped", justify="right")
    table.add_column("spare", justify="right")
    for d in sorted(now.devices, key=lambda d: (d.stage, d.device)):
        prev = old.get(d.device)
        bubble = d.bubble_ns - (prev.bubble_ns if prev else 0)
        used = d.used_ns - (prev.used_ns if prev else 0)
        table.add_row(
            Text(printable(d.device), style="bold" if d.alive else "dim"),
            str(d.stage),
            str(d.rank),
            _bar(_share(bubble, dt), bar, style="yellow"),
            _bar(_share(used, bubble), bar, style="green"),
            str(d.bubbles),
            str(d.steps),
            Text(str(d.overruns), style="red" if d.overruns else ""),
            Text(
                f"{format_ns(d.interference_ns)} ({d.interference_ns / d.train_ns:.2%})" if d.train_ns else "-",
                style="red" if d.train_ns and d.interference_ns > 0.005 * d.train_ns else "",
            ),
            str(d.dropped),
            format_bytes(d.spare_memory),
        )
    return table


def _tasks(now: p.StatusReply, before: p.StatusReply | None) -> Table:
    dt = now.uptime_ns - before.uptime_ns if before is not None else now.uptime_ns
    old = {t.task_id: t for t in before.tasks} if before is not None else {}
    table = Table(title="side tasks", title_justify="left")
    for col in ("task", "name", "kind", "state", "device", "steps", "steps/s", "busy", "metrics"):
        table.add_column(col, justify="right" if col in ("task", "steps", "steps/s", "busy") else "left")
    styles = {"running": "green", "failed": "red", "pending": "yellow", "starting": "yellow"}
    for t in now.tasks:
        prev = old.get(t.task_id)
        rate = (t.steps - (prev.steps if prev else 0)) / (dt / 1e9) if dt > 0 else 0.0
        metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(t.metrics.items()))
        if t.error:
            metrics += f" error: {t.error}"
        # Text(), not str: names come from other processes, and Rich reads markup in a plain string
        table.add_row(
            str(t.task_id),
            Text(printable(t.name)),
            t.kind,
            Text(t.state, style=styles.get(t.state, "")),
            Text(printable(t.device or "-")),
            str(t.steps),
            f"{rate:.1f}",
            format_ns(t.busy_ns),
            Text(printable(metrics)),
        )
    return table


def render(now: p.StatusReply, before: p.StatusReply | None = None, *, bar_width: int = 20) -> RenderableType:
    """One frame: devices, tasks and latency; rates over ``before`` -> ``now``."""
    lat = now.latency
    footer = Text.assemble(
        ("bubble start -> side-task step ", "bold"),
        f"p50 {format_ns(lat.p50_ns)}  p99 {format_ns(lat.p99_ns)}  max {format_ns(lat.max_ns)}  ({lat.count} grants)",
        f"\n{now.events} events, {now.rejected_frames} rejected frames, up {format_ns(now.uptime_ns)}",
    )
    return Group(_devices(now, before, bar_width), _tasks(now, before), footer)


def watch(
    fetch: Callable[[], p.StatusReply],
    *,
    interval_s: float = 1.0,
    count: int = 0,
    console: Console | None = None,
) -> int:
    """Redraw the status every ``interval_s`` until Ctrl-C (or ``count`` frames, if > 0).

    Returns:
        The exit code: 0 after ``count`` frames, 130 on Ctrl-C.

    Raises:
        ManagerUnreachable: the manager stopped answering.
    """
    if interval_s <= 0:
        raise ValueError(f"interval must be > 0, got {interval_s}")
    console = console or Console()
    bar_width = max(6, min(20, (console.width - 100) // 2))
    before: p.StatusReply | None = None
    frames = 0
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                now = fetch()
                live.update(render(now, before, bar_width=bar_width), refresh=True)
                before, frames = now, frames + 1
                if count and frames >= count:
                    break
                time.sleep(interval_s)  # the refresh period of a terminal view
    except KeyboardInterrupt:
        return 130
    if not console.is_terminal:
        console.line()
    return 0
