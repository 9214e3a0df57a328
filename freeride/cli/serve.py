"""``freeride serve``: the manager, configured once from its options."""

from __future__ import annotations

import argparse
import asyncio
import signal
import tomllib
from pathlib import Path
from typing import get_args

from freeride import protocol as p
from freeride.cli import common
from freeride.cli.common import Subparsers
from freeride.serve.config import DEFAULT_METRICS_PORT, ServeConfig
from freeride.units import parse_duration_ns, parse_share

__all__ = ["add_parsers", "cmd_serve", "config_defaults", "serve_config"]


def serve_config(args: argparse.Namespace) -> ServeConfig:
    runtime_dir = common.runtime_dir(args)
    return ServeConfig(
        endpoints=common.endpoints(args),
        state_dir=Path(args.state_dir) if args.state_dir else runtime_dir / "state",
        margin_ns=parse_duration_ns(args.margin),
        checkpoint_every_s=parse_duration_ns(args.checkpoint_every) / 1e9,
        backend_timeout_s=parse_duration_ns(args.backend_timeout) / 1e9,
        profile=Path(args.profile) if args.profile else None,
        mps=args.mps,
        device_gate=args.device_gate,
        own_process=True,
        trace=Path(args.trace) if args.trace else None,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        side_priority=args.side_priority,
        keys_dir=common.keys_dir(args) if getattr(args, "tcp", None) else None,
        hang_after_s=parse_duration_ns(args.hang_after) / 1e9,
        hang_factor=args.hang_factor,
        restart_backoff_s=parse_duration_ns(args.restart_backoff) / 1e9,
        restart_backoff_max_s=parse_duration_ns(args.restart_backoff_max) / 1e9,
        max_loss_s=parse_duration_ns(args.max_loss) / 1e9,
        max_loss_steps=args.max_loss_steps,
        settle_s=parse_duration_ns(args.settle) / 1e9,
        move_every_s=parse_duration_ns(args.move_every) / 1e9,
        interference_target=parse_share(args.interference_target),
        holdback=p.Holdback(
            block_steps=args.holdback_block, every=args.holdback_every, max_every=4 * args.holdback_every
        ),
        slowdown_budget=0.0 if args.slowdown_budget in ("off", "0") else parse_share(args.slowdown_budget),
    )


def config_defaults(path: str, parser: argparse.ArgumentParser) -> dict[str, object]:
    """The options a TOML file sets, as defaults for ``parser`` (the command line still overrides them).

    Keys are the command's long options without their dashes (``hang-after``
    or ``hang_after``); values are written as on the command line (``"10s"``)
    or as TOML numbers and booleans.

    Raises:
        SystemExit: an unreadable file, bad TOML, an unknown option or a value of the wrong kind.
    """
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SystemExit(f"freeride: cannot read --config {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SystemExit(f"freeride: --config {path} is not TOML: {exc}") from None
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    values: dict[str, object] = {}
    for key, value in data.items():
        action = actions.get(key.replace("-", "_"))
        if action is None:
            known = ", ".join(sorted(dest.replace("_", "-") for dest in actions))
            raise SystemExit(f"freeride: --config {path}: unknown option {key!r}; the options are: {known}")
        flag = isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
        if flag != isinstance(value, bool) or isinstance(value, dict | list):
            kind = "true or false" if flag else "a value as on the command line"
            raise SystemExit(f"freeride: --config {path}: {key} must be {kind}, got {value!r}")
        if not flag and action.type is None:
            value = str(value)  # parsed later as the option's text: "10s", "2%", a path
        if action.choices is not None and value not in action.choices:
            raise SystemExit(f"freeride: --config {path}: {key} must be one of {sorted(action.choices)}, got {value!r}")
        values[action.dest] = value
    return values


def cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from freeride.serve.manager import Manager

    config = serve_config(args)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if not args.exit_with_jobs:
            async with Manager(config) as manager:
                print(f"freeride: serving; backends send to {config.endpoints.events}", flush=True)
                await manager.run(stop)
            return
        from freeride.host.jobs import JobWatch

        # the watch's lock outlives the manager: no launch registers with it while it closes
        with JobWatch(common.runtime_dir(args)) as watch:
            async with Manager(config) as manager, asyncio.TaskGroup() as tg:
                print(
                    f"freeride: serving until the launched jobs end; backends send to {config.endpoints.events}",
                    flush=True,
                )
                tg.create_task(watch.stop_when_done(stop), name="serve-jobs")
                await manager.run(stop)

    uvloop.run(serve())
    return 0


def add_parsers(subs: Subparsers) -> None:
    s = subs.add_parser("serve", help="run the manager (one per node, beside the training job)")
    common.add_runtime(s)
    s.add_argument("--state-dir", metavar="DIR", help="logs and checkpoints (default RUNTIME_DIR/state)")
    s.add_argument(
        "--margin",
        default="0.3ms",
        help="time kept free before a bubble's expected end, to start with (each device's guard adapts it;"
        " default 0.3ms)",
    )
    s.add_argument(
        "--interference-target",
        default="0.5%",
        metavar="SHARE",
        help="side work past bubble ends each device's guard keeps under, as a share of training time (default 0.5%%)",
    )
    s.add_argument(
        "--slowdown-budget",
        default="0.5%",
        metavar="SHARE",
        help="the slowdown side work may cost each training job, measured on its own step times; past it harvesting"
        " backs off until it holds (default 0.5%%; off: measured, never enforced)",
    )
    s.add_argument(
        "--holdback-every",
        type=int,
        default=8,
        metavar="BLOCKS",
        help="one block of steps in this many gets no side work, to measure what side work costs the job (an even"
        " number, default 8 at first, sparser as the job goes on; 0: never, and nothing is measured)",
    )
    s.add_argument(
        "--holdback-block", type=int, default=4, metavar="STEPS", help="steps per held-back block (default 4)"
    )
    s.add_argument("--checkpoint-every", default="30s", help="how often running tasks checkpoint (default 30s)")
    s.add_argument("--backend-timeout", default="30s", help="silence after which an unwatchable rank is dead")
    s.add_argument("--profile", metavar="FILE", help="bubble profile from `freeride profile`")
    s.add_argument("--mps", action="store_true", help="cap side tasks' GPU memory with NVIDIA MPS (GPU only)")
    s.add_argument(
        "--device-gate",
        action="store_true",
        help="let each GPU release side work itself: an armed side task queues its next step behind a gate the "
        "training stream opens where the device reaches a bubble (GPU only; off: released through the host)",
    )
    s.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of bubbles and side-task work")
    s.add_argument(
        "--metrics-port",
        type=int,
        nargs="?",
        const=DEFAULT_METRICS_PORT,
        metavar="PORT",
        help=f"serve Prometheus metrics on METRICS_HOST:PORT (PORT {DEFAULT_METRICS_PORT} if not given; 0: a free one)",
    )
    s.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the metrics bind (default 127.0.0.1; another one lets other hosts read them, unauthenticated)",
    )
    s.add_argument("--exit-with-jobs", action="store_true", help=argparse.SUPPRESS)  # what launch starts
    s.add_argument(
        "--side-priority",
        choices=get_args(p.SidePriority),
        default="low",
        help="CPU priority of side tasks: low (nice 19, default) or the stage's own; 'same' makes a side step"
        " that runs past a bubble's end delay the stage on CPU as it would on a GPU (benchmarks use it)",
    )
    s.add_argument(
        "--hang-after",
        default="10s",
        metavar="DURATION",
        help="a step still running this long after its bubble ended (and --hang-factor estimates) is slow if it"
        " still computes (it then runs on in bubbles only) and hung if not: its worker is killed and the task"
        " restarts from its checkpoint (default 10s)",
    )
    s.add_argument("--hang-factor", type=float, default=10.0, help="... and this many step estimates (default 10)")
    s.add_argument("--restart-backoff", default="1s", metavar="DURATION", help="delay before the first restart")
    s.add_argument("--restart-backoff-max", default="60s", metavar="DURATION", help="longest delay between restarts")
    s.add_argument(
        "--max-loss",
        default="120s",
        metavar="DURATION",
        help="step time a crash may lose: past it a checkpoint is forced even if none fits a bubble (0: no bound)",
    )
    s.add_argument("--max-loss-steps", type=int, default=0, help="steps a crash may lose, likewise (0: no bound)")
    s.add_argument(
        "--settle",
        default="10s",
        metavar="DURATION",
        help="an unpinned task submitted before every stage reported and showed its bubbles waits this long at most,"
        " then goes where the bubbles are known to be (default 10s; not needed with --profile)",
    )
    s.add_argument(
        "--move-every",
        default="60s",
        metavar="DURATION",
        help="a task moves (checkpoint, resume) to a device giving it 1.5x its bubble time at most this often",
    )
    s.add_argument(
        "--config",
        metavar="FILE",
        help='a TOML file of these options (keys without their dashes: hang-after = "30s"); the command'
        " line overrides it",
    )
    s.set_defaults(fn=cmd_serve, config_parser=s)
