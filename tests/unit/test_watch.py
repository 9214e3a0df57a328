"""The live status view: shares and rates come from the last interval."""

from __future__ import annotations

from rich.console import Console

from freeride import protocol as p
from freeride.observe.watch import render

S = 1_000_000_000


def status(uptime_ns: int, bubble_ns: int, used_ns: int, steps: int) -> p.StatusReply:
    device = p.DeviceStatus(
        device="cuda:3",
        stage=1,
        rank=1,
        framework="sim",
        alive=True,
        bubbles=4,
        bubble_ns=bubble_ns,
        used_ns=used_ns,
        overruns=0,
        overrun_ns=0,
        spare_memory=-1,
        steps=2,
    )
    task = p.TaskStatus(
        task_id=9,
        name="pagerank-x",
        kind="iterative",
        state="running",
        device="cuda:3",
        steps=steps,
        busy_ns=used_ns,
        metrics={"residual": 0.25},
    )
    latency = p.LatencySummary(count=3, p50_ns=120_000, p99_ns=900_000, max_ns=2_000_000)
    return p.StatusReply(
        devices=[device], tasks=[task], latency=latency, events=10, rejected_frames=0, uptime_ns=uptime_ns
    )


def draw(now: p.StatusReply, before: p.StatusReply | None) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(render(now, before))
    return console.export_text()


def test_shares_and_rates_over_the_last_interval() -> None:
    before = status(10 * S, 2 * S, 1 * S, 100)
    now = status(12 * S, 2 * S + S // 2, 1 * S + S // 5, 500)
    text = draw(now, before)
    assert "25.0%" in text  # 0.5 s of bubbles in the last 2 s
    assert "40.0%" in text  # 0.2 s used of those 0.5 s
    assert "200.0" in text  # 400 steps in 2 s
    assert "residual=0.25" in text and "p99 0.90 ms" in text


def test_first_frame_shows_totals_since_start() -> None:
    text = draw(status(10 * S, 2 * S, 1 * S, 100), None)
    assert "20.0%" in text and "50.0%" in text and "10.0" in text


def test_names_from_other_processes_cannot_drive_the_terminal() -> None:
    """An escape sequence or Rich markup in a task's name is shown, not obeyed."""
    import io

    from rich.console import Console

    from freeride import protocol as p
    from freeride.observe.watch import render

    status = p.StatusReply(
        devices=[],
        tasks=[
            p.TaskStatus(
                task_id=1,
                name="evil\x1b[2J[bold red]x",
                kind="iterative",
                state="running",
                device="cpu:0",
                steps=1,
                busy_ns=1,
                metrics={"\x1b]0;title\x07": 1.0},
            )
        ],
        latency=p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0),
        events=0,
        rejected_frames=0,
        uptime_ns=1,
    )
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False, color_system=None).print(render(status))
    text = out.getvalue()
    assert "\x1b" not in text and "\\x1b[2J" in text and "[bold red]x" in text
