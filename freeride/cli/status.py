"""``freeride status``: devices, bubbles, the job's cost and side tasks, as a table or JSON."""

from __future__ import annotations

import argparse

import msgspec

from freeride import protocol as p
from freeride.cli import common
from freeride.cli.common import Subparsers
from freeride.cli.submission import task_details
from freeride.observe.cost import cost_lines
from freeride.serve.guard import describe as describe_guard
from freeride.units import format_ns, printable

__all__ = ["add_parsers", "cmd_status", "format_status"]


def _sm_shown(percent: int) -> str:
    return f"{percent}%" if percent > 0 else "-"


def _liveness_shown(t: p.TaskStatus) -> str:
    """Restarts, hung steps, checkpoint and memory cap of a task ("" when there is nothing to say)."""
    parts = []
    if t.restarts:
        why = f": {printable(t.restart_reason)}" if t.restart_reason else ""
        lost = f"; {t.lost_steps} steps done again" if t.lost_steps else ""
        parts.append(f"restarts {t.restarts} (the last after {t.backoff_s:g}s{why}{lost})")
    if t.hangs:
        parts.append(f"hung steps {t.hangs}")
    if t.checkpointed_steps >= 0:
        bounds = [f"{t.max_loss_steps} steps"] if t.max_loss_steps else []
        bounds += [f"{format_ns(t.max_loss_ns)} of steps"] if t.max_loss_ns else []
        bound = f"; a crash loses at most {' or '.join(bounds)}" if bounds else ""
        unsaved = max(0, t.steps - t.checkpointed_steps)
        parts.append(f"checkpoint at step {t.checkpointed_steps} ({unsaved} unsaved{bound})")
    if t.checkpoint_error:
        parts.append(f"checkpoint failing, retried: {printable(t.checkpoint_error)}")
    if t.memory_cap > 0:
        parts.append(f"memory cap {t.memory_cap >> 20} MiB ({t.memory_cap_by})")
    if t.moves:
        parts.append(f"moved {t.moves}x to more bubble time")
    return "; ".join(parts)


WARM_UP = (
    "no bubble announced yet: a rank announces none in its first training step (warm-up: it measures that step's"
    " waits to predict the next ones)"
)


def _warming_up(d: p.DeviceStatus) -> bool:
    """A live rank trains here, in its first step as far as the manager knows, and no bubble came yet."""
    return d.alive and d.bubbles == 0 and d.steps <= 1 and not d.no_bubbles


def _guard_line(d: p.DeviceStatus) -> str:
    """What the device's interference guard set, and why."""
    return f"{printable(d.device):10} guard: {describe_guard(d)} ({printable(d.guard_reason) or 'no reason given'})"


def format_status(status: p.StatusReply, *, verbose: bool = False) -> str:
    """The status table; ``verbose`` adds each device's guard settings and typical bubble, and a legend."""
    lines = [
        f"{'device':10} {'stage':>5} {'alive':>5} {'bubbles':>8} {'bubble time':>12} {'used':>7} {'overruns':>8}"
        f" {'interference':>13} {'of training':>11}"
    ]
    for d in status.devices:
        share = d.used_ns / d.offered_ns if d.offered_ns else 0.0
        taken = f"{d.interference_ns / d.train_ns:.2%}" if d.train_ns else "-"
        lines.append(
            f"{printable(d.device):10} {d.stage:>5} {'yes' if d.alive else 'no':>5} {d.bubbles:>8} "
            f"{format_ns(d.bubble_ns):>12} {share:>6.1%} {d.overruns:>8} {format_ns(d.interference_ns):>13} {taken:>11}"
        )
    if verbose:
        lines.extend(_guard_line(d) for d in status.devices if d.margin_ns >= 0)
        lines.extend(
            f"{printable(d.device):10} typical bubble: {d.typical_bubble_ns / 1e6:.1f} ms (half the bubble time lies"
            " in bubbles at least this long; side tasks that size their steps size them for it)"
            for d in status.devices
            if d.typical_bubble_ns > 0
        )
    lines.extend(f"{printable(d.device):10} {printable(d.no_bubbles)}" for d in status.devices if d.no_bubbles)
    lines.extend(f"{printable(d.device):10} released by the {printable(d.gate)}" for d in status.devices if d.gate)
    lines.extend(f"{printable(d.device):10} {WARM_UP}" for d in status.devices if _warming_up(d))
    lines.extend(printable(line) for line in cost_lines(status.costs, status.devices))
    lines.append("")
    lines.append(
        f"{'task':>4} {'name':28} {'state':10} {'device':10} {'steps':>8} {'busy':>10} {'interference':>13}"
        f" {'sm':>4}  metrics"
    )
    for t in status.tasks:
        metrics = " ".join(f"{printable(k)}={v:.4g}" for k, v in sorted(t.metrics.items()))
        name = printable(t.name) + (" (fill)" if t.fill else "")
        lines.append(
            f"{t.task_id:>4} {name[:28]:28} {t.state:10} {printable(t.device) or '-':10} {t.steps:>8} "
            f"{format_ns(t.busy_ns):>10} {format_ns(t.interference_ns):>13} {_sm_shown(t.sm_share):>4}  {metrics}"
            f"{('  error: ' + printable(t.error)) if t.error else ''}"
        )
        liveness = _liveness_shown(t)
        if liveness:
            lines.append(f"{'':>4} {liveness}")
        lines += [f"{'':>4} {line}" for line in task_details(t)]
    if verbose:
        lines.append("")
        lines.append(
            "bubbles, bubble time: those the manager followed, a device's first ones and then those while side"
            " work is placed there (a rank's bubbles that nothing would use cost the manager no wake-up); used:"
            " side-task compute inside bubbles, as a share of the bubble time offered to side tasks (not held"
            " back to measure the job's cost); interference: side-task compute after bubble ends (what a GPU would"
            " take from training), and its share of the stage's training time"
        )
    lat = status.latency
    lines.append("")
    lines.append(
        f"bubble start -> side-task step: p50 {format_ns(lat.p50_ns)}, p99 {format_ns(lat.p99_ns)} "
        f"over {lat.count} grants; {status.events} events, {status.rejected_frames} rejected frames"
    )
    if status.manager_cores:
        lines.append(printable(status.manager_cores))
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    with common.control(args) as client:

        def fetch() -> p.StatusReply:
            reply = client.request(p.StatusRequest())
            if not isinstance(reply, p.StatusReply):
                raise ValueError(f"unexpected reply {reply!r}")
            return reply

        if args.watch:
            from freeride.observe.watch import watch

            return watch(fetch, interval_s=args.interval, count=args.count)
        reply = fetch()
    if args.json:
        print(msgspec.json.encode(reply).decode())
    else:
        print(format_status(reply, verbose=args.verbose))
    return 0


def add_parsers(subs: Subparsers) -> None:
    s = subs.add_parser("status", help="show devices, bubbles and side tasks")
    common.add_runtime(s)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument(
        "-v", "--verbose", action="store_true", help="also each device's guard settings and typical bubble, a legend"
    )
    s.add_argument("--watch", action="store_true", help="live view, redrawn every --interval seconds (Ctrl-C ends)")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between redraws of --watch (default 1)")
    s.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the manager")
    s.set_defaults(fn=cmd_status)
