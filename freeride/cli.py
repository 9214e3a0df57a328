"""The ``freeride`` command: builds configuration once and hands it down."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, get_args

import msgspec

import freeride
from freeride import auth
from freeride import protocol as p
from freeride.gpu.mps import MpsError
from freeride.observe.cost import cost_lines
from freeride.plan_cli import add_plan_parser
from freeride.profile_task import DEFAULT_SAMPLES, DEFAULT_STEPS
from freeride.program_cli import PROGRAM_OPTIONS, add_program_options, cancel_outcome, program_spec
from freeride.serve.config import ServeConfig
from freeride.serve.guard import describe as describe_guard
from freeride.submission import await_start, check_submission, report_start, task_details
from freeride.transport import ControlClient, Endpoints, ManagerUnreachable, curve_keypair, default_runtime_dir
from freeride.units import format_ns, parse_bytes, parse_duration_ns, parse_share, printable

if TYPE_CHECKING:
    from freeride.backends.sim import SimConfig

__all__ = ["build_parser", "main"]

logger = logging.getLogger("freeride")

_EPILOG = """\
typical use:
  freeride serve &                                   # one per node, beside the training job
  freeride launch -- torchrun --nproc_per_node 4 train.py ...   # unmodified training script
  freeride submit freeride.sidetasks.pagerank:PageRank --opt nodes=200000
  freeride status
try it without a training job: freeride demo
"""


def _runtime_dir(args: argparse.Namespace) -> Path:
    return Path(args.runtime_dir) if args.runtime_dir else default_runtime_dir()


def _endpoints(args: argparse.Namespace) -> Endpoints:
    runtime_dir = _runtime_dir(args)
    if getattr(args, "tcp", None):
        host, _, port = args.tcp.rpartition(":")
        return Endpoints.tcp(host or "127.0.0.1", int(port), runtime_dir)
    return Endpoints.ipc(runtime_dir)


def _add_runtime(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--runtime-dir",
        metavar="DIR",
        help=f"where the manager's sockets live (default {default_runtime_dir()}); must match `freeride serve`",
    )
    sub.add_argument(
        "--tcp",
        metavar="HOST:PORT",
        help="use tcp:// (events on PORT, control on PORT+1) instead of ipc; needs CURVE keys (`freeride keys`)",
    )
    sub.add_argument(
        "--keys-dir",
        metavar="DIR",
        help=f"CURVE keys for --tcp (default ${auth.KEYS_ENV} or {auth.default_keys_dir()}); see `freeride keys`",
    )


def _keys_dir(args: argparse.Namespace) -> Path:
    return Path(args.keys_dir) if getattr(args, "keys_dir", None) else auth.default_keys_dir()


def _export_keys_dir(args: argparse.Namespace, env: MutableMapping[str, str]) -> None:
    """Let child processes' event emitters find the keys of --keys-dir (they read the default place)."""
    if getattr(args, "keys_dir", None):
        env[auth.KEYS_ENV] = str(Path(args.keys_dir).resolve())


def _control(args: argparse.Namespace) -> ControlClient:
    endpoint = _endpoints(args).control
    curve = auth.load_client_keys(_keys_dir(args)) if endpoint.startswith("tcp://") else None
    return ControlClient(endpoint, timeout_s=args.timeout, curve=curve)


# -- keys ------------------------------------------------------------------------


def cmd_keys(args: argparse.Namespace) -> int:
    keys_dir = _keys_dir(args)
    auth.create_keys(keys_dir, keypair=curve_keypair, force=args.force)
    print(f"freeride: CURVE keys written to {keys_dir} (mode 0700)")
    print("  serve --tcp and clients on this host use them; for another host copy the directory (keep it 0700)")
    print(f"  more clients: put their public *.key files in {keys_dir / 'authorized'}")
    return 0


# -- serve ---------------------------------------------------------------------


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    runtime_dir = _runtime_dir(args)
    return ServeConfig(
        endpoints=_endpoints(args),
        state_dir=Path(args.state_dir) if args.state_dir else runtime_dir / "state",
        margin_ns=parse_duration_ns(args.margin),
        checkpoint_every_s=parse_duration_ns(args.checkpoint_every) / 1e9,
        backend_timeout_s=parse_duration_ns(args.backend_timeout) / 1e9,
        profile=Path(args.profile) if args.profile else None,
        mps=args.mps,
        trace=Path(args.trace) if args.trace else None,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        side_priority=args.side_priority,
        keys_dir=_keys_dir(args) if getattr(args, "tcp", None) else None,
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


def cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from freeride.serve.manager import Manager

    config = _serve_config(args)

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
        from freeride.jobs import JobWatch

        # the watch's lock outlives the manager: no launch registers with it while it closes
        with JobWatch(_runtime_dir(args)) as watch:
            async with Manager(config) as manager, asyncio.TaskGroup() as tg:
                print(
                    f"freeride: serving until the launched jobs end; backends send to {config.endpoints.events}",
                    flush=True,
                )
                tg.create_task(watch.stop_when_done(stop), name="serve-jobs")
                await manager.run(stop)

    uvloop.run(serve())
    return 0


# -- control commands ------------------------------------------------------------


def _parse_opts(pairs: Sequence[str]) -> dict[str, str | int | float | bool]:
    opts: dict[str, str | int | float | bool] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"freeride: --opt expects key=value, got {pair!r}")
        value: str | int | float | bool = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    continue
        opts[key.replace("-", "_")] = value
    return opts


def _sm_share(percent: int) -> int:
    if percent != -1 and not 1 <= percent <= 100:
        raise SystemExit(f"freeride: --sm-share must be a percentage in 1..100, got {percent}")
    return percent


def cmd_submit(args: argparse.Namespace) -> int:
    from freeride.tasks import catalog, program_command, programs, resolve

    if args.list:
        from freeride.sidetasks import DESCRIPTIONS

        rows = [*catalog().items(), *((name, f"(program) python -m {m}") for name, m in programs().items())]
        width = max((len(what) for _, what in rows), default=0)
        for name, what in rows:
            print(f"{name:16} {what:{width}} {DESCRIPTIONS.get(name, '')}".rstrip())
        return 0
    if args.target in programs():  # a registered plain program: run it as an imperative task
        args.imperative, args.command = True, program_command(args.target) + list(args.command)
    if args.imperative:
        if not args.command:
            raise SystemExit("freeride: give the program after --, e.g. freeride submit --imperative -- python x.py")
        spec = program_spec(args)
    else:
        given = [o for o in PROGRAM_OPTIONS if getattr(args, o.lstrip("-").replace("-", "_"))]
        if given:
            raise SystemExit(f"freeride: {', '.join(given)} only apply to --imperative programs")
        if not args.target:
            raise SystemExit("freeride: give a side task as module:Class (see freeride submit --list)")
        try:
            target = resolve(args.target)
        except ValueError as exc:
            raise SystemExit(f"freeride: {exc}") from None
        spec = p.TaskSpec(
            kind="iterative",
            target=target,
            name=args.name or "",
            options=_parse_opts(args.opt),
            step_time_ns=parse_duration_ns(args.step_time) if args.step_time else -1,
        )
        spec = check_submission(spec)
    spec = msgspec.structs.replace(
        spec,
        peak_memory=parse_bytes(args.peak_memory) if args.peak_memory else spec.peak_memory,
        device=args.device or "",
        max_restarts=args.max_restarts,
        sm_share=_sm_share(args.sm_share),
        fill=args.fill,
    )
    with _control(args) as client:
        reply = client.request(p.Submit(spec=spec))
        started = await_start(client, reply.task_id, args.wait) if isinstance(reply, p.Submitted) else None
    match reply:
        case p.Submitted(task_id=tid, device=device):
            print(f"task {tid} submitted; " + (f"placed on {device}" if device else "waiting for a device"))
            return report_start(started)
        case p.Rejected(reason=reason):
            print(f"freeride: rejected: {reason}", file=sys.stderr)
            return 2
        case _:
            print(f"freeride: unexpected reply {reply!r}", file=sys.stderr)
            return 1


def cmd_cancel(args: argparse.Namespace) -> int:
    with _control(args) as client:
        reply = client.request(p.Cancel(task_id=args.task_id))
    if isinstance(reply, p.Cancelled):
        print(f"task {reply.task_id} cancelled ({cancel_outcome(reply.kind)})")
        return 0
    print(f"freeride: {getattr(reply, 'reason', reply)}", file=sys.stderr)
    return 2


def _sm_shown(percent: int) -> str:
    return f"{percent}%" if percent > 0 else "-"


def _liveness_shown(t: p.TaskStatus) -> str:
    """Restarts, hung steps, checkpoint and memory cap of a task ("" when there is nothing to say)."""
    parts = []
    if t.restarts:
        parts.append(f"restarts {t.restarts} (the last after {t.backoff_s:g}s)")
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
            "used: side-task compute inside bubbles, as a share of the bubble time offered to side tasks (not held"
            " back to measure the job's cost); interference: side-task compute after bubble ends (what a GPU would"
            " take from training), and its share of the stage's training time"
        )
    lat = status.latency
    lines.append("")
    lines.append(
        f"bubble start -> side-task step: p50 {format_ns(lat.p50_ns)}, p99 {format_ns(lat.p99_ns)} "
        f"over {lat.count} grants; {status.events} events, {status.rejected_frames} rejected frames"
    )
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    with _control(args) as client:

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


def cmd_report(args: argparse.Namespace) -> int:
    import json

    from freeride.observe.report import Prices, ReportOptions, build_report, parse_throughputs
    from freeride.observe.timeline import load_trace, merge_traces

    options = ReportOptions(
        prices=Prices(
            train_gpu_per_hour=args.train_gpu_price, side_gpu_per_hour=args.side_gpu_price, train_gpus=args.train_gpus
        ),
        throughputs=parse_throughputs(args.side_throughput),
        warmup_steps=args.warmup,
    )
    paths = [Path(t) for t in args.trace]
    try:
        traces = [load_trace(path) for path in paths]
        baseline = load_trace(Path(args.baseline)) if args.baseline else None
    except OSError as exc:
        print(f"freeride: cannot read trace: {exc}", file=sys.stderr)
        return 2
    if len(traces) == 1:
        trace = traces[0]
    else:  # one job's nodes: each named by its file, or by its folder where the files share a name
        names = [path.stem for path in paths]
        if len(set(names)) < len(names):
            names = [path.parent.name or path.stem for path in paths]
        if len(set(names)) < len(names):
            names = [f"node{i}" for i in range(len(paths))]
        trace = merge_traces(list(zip(names, traces, strict=True)))
    report = build_report(trace, options, baseline)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0


# -- launch / profile / sim / demo ------------------------------------------------


def _find_command(command: Sequence[str], env: dict[str, str]) -> str:
    from freeride.backends.launch import CommandNotFound, find_command

    try:
        return find_command(command[0], env)
    except CommandNotFound as exc:
        print(f"freeride: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


def cmd_launch(args: argparse.Namespace) -> int:
    from freeride.backends.launch import launch_env

    if not args.command:
        raise SystemExit("freeride: give the training command after --, e.g. freeride launch -- torchrun ...")
    env = launch_env(os.environ, events=_endpoints(args).events)
    _export_keys_dir(args, env)
    path = _find_command(args.command, env)
    if not args.no_manager:
        _node_manager(args)
    try:
        os.execve(path, list(args.command), env)
    except OSError as exc:  # found but not runnable, e.g. a script with a bad #! line
        print(f"freeride: cannot run {args.command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 126


def _node_manager(args: argparse.Namespace) -> None:
    """Find the node's manager or start one; the training runs whatever happens to it."""
    from freeride.node_manager import ManagerNotStarted, StartOptions, ensure_manager

    endpoints = _endpoints(args)
    curve = auth.load_client_keys(_keys_dir(args)) if endpoints.control.startswith("tcp://") else None
    options = StartOptions(
        endpoints=endpoints,
        runtime_dir=_runtime_dir(args),
        serve_argv=tuple(_launch_serve_argv(args)),
        keep=args.keep_manager,
        start_timeout_s=args.manager_timeout,
    )
    try:
        found = ensure_manager(options, lambda t: ControlClient(endpoints.control, timeout_s=t, curve=curve))
    except ManagerNotStarted as exc:
        print(f"freeride: no manager: {exc}; training runs without FreeRide", file=sys.stderr)
        return
    for note in found.notes:
        print(f"freeride: {note}", file=sys.stderr)
    if found.started:
        after = "stays after the job" if args.keep_manager else "exits when the jobs launched here have ended"
        print(f"freeride: started a manager (pid {found.pid}, log {found.log}); it {after}", file=sys.stderr)
    else:
        print(f"freeride: using the manager (pid {found.pid or '?'}) of {options.runtime_dir}", file=sys.stderr)


def _launch_serve_argv(args: argparse.Namespace) -> list[str]:
    """``freeride serve`` as launch would start it, checked now: bad options fail before the job starts."""
    import shlex

    extra = shlex.split(args.serve_args)
    given = sorted({a.partition("=")[0] for a in extra} & {"--runtime-dir", "--tcp", "--keys-dir", "--exit-with-jobs"})
    if given:
        raise ValueError(f"--serve-args: give {', '.join(given)} to launch itself, which passes it to serve")
    own = ["--runtime-dir", str(_runtime_dir(args))]
    if args.tcp:
        own += ["--tcp", args.tcp, "--keys-dir", str(_keys_dir(args))]
    serve = [*own, *([] if args.keep_manager else ["--exit-with-jobs"]), *extra]
    try:
        _serve_config(build_parser().parse_args(["serve", *serve]))
    except SystemExit:  # argparse printed what is wrong
        print("freeride: --serve-args: not options of `freeride serve` (see freeride serve --help)", file=sys.stderr)
        raise SystemExit(2) from None
    return [sys.executable, "-P", "-m", "freeride", "--log-level", args.log_level, "serve", *serve]


def _add_profile_options(s: argparse.ArgumentParser) -> None:
    from freeride.profile_run import DEFAULT_PROFILE_STEPS

    s.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_PROFILE_STEPS,
        help=f"stop the job once every rank ran this many steps (default {DEFAULT_PROFILE_STEPS}; 0: to its end)",
    )
    s.add_argument("--picture", metavar="PNG", help="also draw where each stage's bubbles fall in one step")


def cmd_profile(args: argparse.Namespace) -> int:
    from freeride.observe.picture import require_matplotlib
    from freeride.profile_run import ProfileOptions, run_profile

    if not args.command:
        raise SystemExit("freeride: give the training command after --")
    if args.picture:
        try:
            require_matplotlib()  # before the job runs, not after
        except ImportError as exc:
            print(f"freeride: --picture: {exc}", file=sys.stderr)
            return 2
    env = dict(os.environ)
    _export_keys_dir(args, env)
    _find_command(args.command, env)
    events = _endpoints(args).events
    outcome = run_profile(
        ProfileOptions(command=args.command, out=Path(args.out), events=events, steps=args.steps, env=env)
    )
    print(f"freeride: {outcome.message}", file=sys.stderr if outcome.exit_code else sys.stdout)
    if outcome.profile is not None and args.picture:
        from freeride.observe.picture import render_profile

        render_profile(outcome.profile, Path(args.picture))
        print(f"freeride: picture of one step written to {args.picture}")
    return outcome.exit_code


def _cores(text: str) -> tuple[int, ...]:
    """``0-3,8`` as (0, 1, 2, 3, 8)."""
    cores: list[int] = []
    try:
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise SystemExit(f"freeride: --cores expects a list like 0-3,8, got {text!r}") from None
    return tuple(cores)


def cmd_profile_task(args: argparse.Namespace) -> int:
    from freeride.auth import ensure_private_dir
    from freeride.profile_task import ProfileTaskOptions, profile_task  # imports torch only to run the task

    # by default where `freeride serve` keeps its state
    state_dir = Path(args.state_dir) if args.state_dir else ensure_private_dir(_runtime_dir(args)) / "state"
    options = ProfileTaskOptions(
        target=args.target,
        options=_parse_opts(args.opt),
        state_dir=state_dir,
        device=args.device,
        cores=_cores(args.cores),
        samples=args.samples,
        steps=args.steps,
        bubble_ms=args.bubble_ms,
    )
    ensure_private_dir(state_dir, what="state dir", strict=False)
    result = profile_task(options)
    print(result.table())
    if result.finished:
        print("freeride: the task finished before every step kind was measured enough", file=sys.stderr)
    return 0


def _sim_config(args: argparse.Namespace, endpoint: str) -> SimConfig:
    """The simulated job of ``freeride sim`` and ``freeride demo``, from their shared flags."""
    from freeride.backends.sim import SimConfig

    return SimConfig(
        endpoint=endpoint,
        schedule=args.schedule,
        num_stages=args.stages,
        num_microbatches=args.microbatches,
        num_chunks=args.chunks,
        forward_s=parse_duration_ns(args.forward) / 1e9,
        backward_s=parse_duration_ns(args.backward) / 1e9,
        steps=args.steps,
        compute=args.compute,
    )


def cmd_sim(args: argparse.Namespace) -> int:
    from freeride.backends.sim import SimPipeline

    _export_keys_dir(args, os.environ)  # the simulated ranks' emitters read it
    with SimPipeline(_sim_config(args, _endpoints(args).events)) as sim:
        results = sim.join()
    for r in results:
        med = sorted(r.step_ns)[len(r.step_ns) // 2] if r.step_ns else 0
        print(f"stage {r.stage}: {len(r.step_ns)} steps, median {format_ns(med)}, {r.dropped} events dropped")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from freeride.demo import DemoOptions, run_demo

    # the demo runs its own manager, which fills in the endpoint
    options = DemoOptions(sim=_sim_config(args, endpoint=""), task=args.task)
    if args.opt or args.task != "graph-sgd":  # the default options suit only the default task
        options = dataclasses.replace(options, task_options=_parse_opts(args.opt))
    report = run_demo(options)
    print(report.text())
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freeride",
        description="Run side tasks inside the pipeline bubbles of DeepSpeed, Megatron and PyTorch pipeline"
        " training jobs.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"freeride {freeride.__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    subs = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = subs.add_parser("serve", help="run the manager (one per node, beside the training job)")
    _add_runtime(s)
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
    s.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of bubbles and side-task work")
    s.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on 127.0.0.1:PORT")
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
        help="a step still running this long after its bubble ended (and --hang-factor estimates) is hung:"
        " its worker is killed and the task restarts from its checkpoint (default 10s)",
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
    s.set_defaults(fn=cmd_serve)

    s = subs.add_parser("submit", help="submit a side task", description="Submit a side task to a running manager.")
    _add_runtime(s)
    s.add_argument("target", nargs="?", help="module:Class of an iterative task, or a name from --list")
    s.add_argument("--list", action="store_true", help="list the packaged sample side tasks")
    s.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="task option (repeatable)")
    s.add_argument("--name", help="task name; a task submitted again under its name resumes from its checkpoint")
    s.add_argument("--peak-memory", metavar="SIZE", help="peak device memory, e.g. 2G (placement only fits it)")
    s.add_argument("--step-time", metavar="DURATION", help="expected step time, e.g. 5ms, until measured")
    s.add_argument("--device", help="pin to a device, e.g. cuda:1")
    s.add_argument("--max-restarts", type=int, default=3, help="restarts from checkpoint after a crash")
    s.add_argument(
        "--sm-share",
        type=int,
        default=-1,
        metavar="PCT",
        help="percent of the GPU's SMs the task may occupy under MPS (default 75: the rest stays free for "
        "the trainer's NCCL kernels)",
    )
    s.add_argument(
        "--fill",
        action="store_true",
        help="fill the ends of bubbles: the task gets a bubble only once its device's other tasks gave it back "
        "(e.g. PageRank beside ResNet-50 training)",
    )
    s.add_argument("--imperative", action="store_true", help="run an unmodified program (give it after --)")
    add_program_options(s)
    s.add_argument(
        "--wait",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="wait this long for the task to start, so that a failing setup shows here (0: do not wait)",
    )
    s.add_argument("--timeout", type=float, default=5.0, help=argparse.SUPPRESS)
    s.set_defaults(fn=cmd_submit)

    s = subs.add_parser("status", help="show devices, bubbles and side tasks")
    _add_runtime(s)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument(
        "-v", "--verbose", action="store_true", help="also each device's guard settings and typical bubble, a legend"
    )
    s.add_argument("--watch", action="store_true", help="live view, redrawn every --interval seconds (Ctrl-C ends)")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between redraws of --watch (default 1)")
    s.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the manager")
    s.set_defaults(fn=cmd_status)

    s = subs.add_parser(
        "report",
        help="bubble share, harvested share, slowdown and cost saving of a traced run",
        description="Read a trace of `freeride serve --trace`, or one per node of a multi-node job (and a baseline"
        " trace without side tasks).",
    )
    s.add_argument(
        "trace", metavar="TRACE", nargs="+", help="a trace; several: one job's traces from its nodes, one report of all"
    )
    s.add_argument("--baseline", metavar="TRACE", help="trace of the same job without side tasks (for the slowdown)")
    s.add_argument("--train-gpu-price", type=float, default=3.96, help="$ per hour of one training GPU")
    s.add_argument("--side-gpu-price", type=float, default=0.18, help="$ per hour of the cheap GPU for side tasks")
    s.add_argument("--train-gpus", type=int, default=0, help="training GPUs of the job (default: devices in TRACE)")
    s.add_argument(
        "--side-throughput",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=STEPS_PER_S",
        help="steps/s of a task (name or glob) alone on the cheap GPU (repeatable)",
    )
    s.add_argument("--warmup", type=int, default=1, help="steps left out at the start (default 1)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_report)

    s = subs.add_parser(
        "keys",
        help="make CURVE keys for --tcp (server, client, authorized clients)",
        description="Write a server and a client CURVE key pair into a private keys directory (see docs/security.md).",
    )
    s.add_argument("--keys-dir", metavar="DIR", help=f"where (default ${auth.KEYS_ENV} or {auth.default_keys_dir()})")
    s.add_argument("--force", action="store_true", help="replace existing keys (clients then need the new ones)")
    s.set_defaults(fn=cmd_keys)

    s = subs.add_parser("cancel", help="cancel a side task (an iterative task checkpoints first; a program is stopped)")
    _add_runtime(s)
    s.add_argument("task_id", type=int)
    s.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the manager")
    s.set_defaults(fn=cmd_cancel)

    s = subs.add_parser(
        "launch",
        help="run a training command with FreeRide's hooks in every rank",
        usage="freeride launch [--runtime-dir DIR] [--keep-manager] [--serve-args ARGS] -- COMMAND ...",
        description="Find the node's manager, or start one, then run COMMAND with FreeRide's hooks in every rank"
        " (docs/launchers.md).",
    )
    _add_runtime(s)
    s.add_argument(
        "--keep-manager",
        action="store_true",
        help="a manager this launch starts stays after the job (default: it checkpoints its side tasks and exits"
        " once every job launched on this runtime dir has ended)",
    )
    s.add_argument(
        "--serve-args",
        default="",
        metavar="ARGS",
        help="options for a manager this launch starts, as for `freeride serve`, e.g. '--side-priority same"
        " --profile job.json --state-dir DIR', or --serve-args=--mps (a running manager keeps its own)",
    )
    s.add_argument("--no-manager", action="store_true", help="neither look for nor start a manager")
    s.add_argument(
        "--manager-timeout", type=float, default=60.0, metavar="SECONDS", help="wait this long for a manager to answer"
    )
    s.set_defaults(fn=cmd_launch)

    s = subs.add_parser(
        "profile",
        help="run a few training steps and write a bubble profile",
        usage="freeride profile --out FILE [--steps N] [--picture PNG] [--runtime-dir DIR] -- COMMAND ...",
    )
    _add_runtime(s)
    s.add_argument("--out", required=True, metavar="FILE")
    _add_profile_options(s)
    s.set_defaults(fn=cmd_profile)

    s = subs.add_parser(
        "profile-task",
        help="measure a side task's step kinds alone, so that its first run under serve knows them",
        description="Run a side task alone and keep the measured time of each of its step kinds where"
        " `freeride serve` reads them (STATE_DIR/estimates); submit it later with the same options.",
    )
    s.add_argument("target", help="module:Class of an iterative task, or a name from `freeride submit --list`")
    s.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="task option (repeatable)")
    s.add_argument("--device", default="cpu:0", help="cpu:N or cuda:N (default cpu:0)")
    s.add_argument(
        "--cores",
        default="",
        metavar="LIST",
        help="CPU cores of the stage the task will share, e.g. 0-3 (default: none named, one thread)",
    )
    s.add_argument(
        "--samples",
        type=int,
        default=DEFAULT_SAMPLES,
        help=f"stop once every step kind ran this many times (default {DEFAULT_SAMPLES})",
    )
    s.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"stop after this many steps in any case ({DEFAULT_STEPS})"
    )
    s.add_argument(
        "--bubble-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="the typical bubble of the stage the task will share (`freeride status` shows it): a task that sizes"
        " its steps by the bubbles then measures the steps it will run (default 0: unknown)",
    )
    s.add_argument("--state-dir", metavar="DIR", help="the state dir of `freeride serve` (default RUNTIME_DIR/state)")
    s.add_argument(
        "--runtime-dir",
        metavar="DIR",
        help=f"the runtime dir of `freeride serve` (default {default_runtime_dir()}), if --state-dir is not given",
    )
    s.set_defaults(fn=cmd_profile_task)

    from freeride.cluster.cli import register as register_cluster

    register_cluster(subs, _add_runtime)

    add_plan_parser(subs)

    for name, helptext in (
        ("sim", "run a simulated pipeline job against a running manager"),
        ("demo", "serve + simulated pipeline + sample side tasks, then a report"),
    ):
        s = subs.add_parser(name, help=helptext)
        if name == "sim":
            _add_runtime(s)
        s.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
        s.add_argument("--stages", type=int, default=2)
        s.add_argument("--microbatches", type=int, default=4)
        s.add_argument("--chunks", type=int, default=1, help="model chunks per stage (interleaved)")
        s.add_argument("--steps", type=int, default=60 if name == "demo" else 100)
        s.add_argument("--forward", default="10ms", help="forward time per micro-batch and stage")
        s.add_argument("--backward", default="20ms", help="backward time per micro-batch and stage")
        s.add_argument(
            "--compute",
            default="sleep",
            choices=["sleep", "spin", "cpu"],
            help="spin burns the stage's core until a wall deadline; cpu until the stage had its compute time",
        )
        if name == "demo":
            s.add_argument("--task", default="graph-sgd", help="sample side task per stage (see submit --list)")
            s.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="side-task option")
        s.set_defaults(fn=cmd_sim if name == "sim" else cmd_demo)
    return parser


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # everything after the first `--` is a command to run, never our options
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    args.command = command
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.fn(args))
    except ManagerUnreachable as exc:
        print(f"freeride: {exc}", file=sys.stderr)
        return 3
    except auth.Refused as exc:
        print(f"freeride: {exc}", file=sys.stderr)
        return 2
    except MpsError as exc:  # serve --mps where MPS cannot start: what the control program said
        print(f"freeride: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"freeride: {exc}", file=sys.stderr)
        return 2


def _stdout_to_devnull() -> None:
    # Python flushes stdout again at exit; into a closed pipe that prints "Exception ignored ... BrokenPipeError"
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file (embedded use): nothing is flushed at exit
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``freeride`` command; returns its exit status.

    A reader that closes our stdout early (``freeride report trace.json | head``)
    ends the command quietly with 141, the status a shell gives a process ended
    by SIGPIPE; Ctrl-C ends it with 130, as a shell reports SIGINT, without a
    traceback.
    """
    try:
        try:
            return _run(argv)
        finally:
            # flush here, where a closed pipe can be caught, rather than at interpreter exit
            sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return 141
    except KeyboardInterrupt:  # Ctrl-C: what was started has been stopped on the way out
        print("freeride: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
