"""``freeride cluster ...``: the cluster-wide side-job queue on Ray, from the command line.

:func:`add_parsers` adds them to the ``freeride`` parser; everything else about
the commands lives here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec

from freeride import auth
from freeride import protocol as p
from freeride.auth import shared_dir_problem
from freeride.cli import common
from freeride.cli.common import Subparsers
from freeride.cluster import messages as m
from freeride.cluster import signing
from freeride.cluster.offer import OfferPolicy
from freeride.cluster.queue import ClusterQueue, QueueUnreachable, RayMissing
from freeride.units import parse_bytes, parse_duration_ns, parse_share

__all__ = ["add_parsers"]

logger = logging.getLogger(__name__)

_ADDRESS_HELP = "the Ray cluster (default: $RAY_ADDRESS, else `auto`: the one started on this host by `ray start`)"


def _address(args: argparse.Namespace) -> str:
    return str(args.address or os.environ.get("RAY_ADDRESS") or "auto")


def _queue_call(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn Ray's absence and an unreachable queue into one line and exit status 3."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (RayMissing, QueueUnreachable) as exc:
            print(f"freeride: {exc}", file=sys.stderr)
            return 3

    return run


def _job_specs(args: argparse.Namespace) -> list[p.TaskSpec]:
    from freeride.cli.submission import check_submission
    from freeride.tasks.targets import resolve

    if not args.name:
        raise SystemExit("freeride: give the jobs a --name (job NAME-I for shard I; names key checkpoints)")
    if args.shards < 1:
        raise SystemExit(f"freeride: --shards must be >= 1, got {args.shards}")
    if args.checkpoint_dir and not os.path.isdir(args.checkpoint_dir):
        raise SystemExit(
            f"freeride: --checkpoint-dir {args.checkpoint_dir} is not a directory; create it on storage every node"
            " mounts at the same path"
        )
    if args.checkpoint_dir and (problem := shared_dir_problem(Path(args.checkpoint_dir), what="--checkpoint-dir")):
        raise SystemExit(f"freeride: {problem}")
    try:
        target = resolve(args.target)
    except ValueError as exc:
        raise SystemExit(f"freeride: {exc}") from None
    options = common.parse_opts(args.opt)
    specs: list[p.TaskSpec] = []
    for shard in range(args.shards):
        sharded = {**options, "shard": shard, "shards": args.shards} if args.shards > 1 else options
        spec = p.IterativeSpec(
            target=target,
            name=f"{args.name}-{shard}" if args.shards > 1 else args.name,
            options=sharded,
            step_time_ns=parse_duration_ns(args.step_time) if args.step_time else -1,
            max_restarts=args.max_restarts,
            checkpoint_dir=str(Path(args.checkpoint_dir).resolve()) if args.checkpoint_dir else "",
            fill=args.fill,
        )
        spec = check_submission(spec)  # options against the class, here, before any node sees them
        if args.peak_memory:
            spec = msgspec.structs.replace(spec, peak_memory=parse_bytes(args.peak_memory))
        specs.append(spec)
    return specs


@_queue_call
def cmd_cluster_submit(args: argparse.Namespace) -> int:
    specs = _job_specs(args)
    keys_dir = common.keys_dir(args)
    secret = signing.load_secret(keys_dir)
    signatures = [signing.sign(spec, secret) for spec in specs] if secret is not None else []
    with ClusterQueue(_address(args), create=True, timeout_s=args.timeout) as queue:
        reply = queue.request(m.SubmitJobs(specs=specs, max_attempts=args.max_attempts, signatures=signatures))
    match reply:
        case m.Submitted(job_ids=ids):
            shown = f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else str(ids[0])
            print(f"{len(ids)} job(s) queued: {shown}; `freeride cluster status` follows them")
            if secret is None:
                print(
                    f"freeride: the jobs are unsigned (no {signing.SECRET_FILE} in {keys_dir}):"
                    " nodes that hold the cluster's secret will not run them",
                    file=sys.stderr,
                )
            return 0
        case m.Refused(reason=reason):
            print(f"freeride: rejected: {reason}", file=sys.stderr)
            return 2
        case _:
            print(f"freeride: unexpected reply {reply!r}", file=sys.stderr)
            return 1


def _status(args: argparse.Namespace) -> m.QueueStatus:
    with ClusterQueue(_address(args), timeout_s=args.timeout) as queue:
        reply = queue.request(m.QueueStatusRequest())
    if not isinstance(reply, m.QueueStatus):
        raise QueueUnreachable(f"the queue answered a status request with {reply!r}")
    return reply


@_queue_call
def cmd_cluster_status(args: argparse.Namespace) -> int:
    from freeride.cluster.view import format_cluster_status

    status = _status(args)
    print(msgspec.json.encode(status).decode() if args.json else format_cluster_status(status, jobs=not args.nodes))
    return 0


@_queue_call
def cmd_cluster_report(args: argparse.Namespace) -> int:
    from freeride.cluster.view import cluster_report, format_report

    report = cluster_report(_status(args))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


@_queue_call
def cmd_cluster_cancel(args: argparse.Namespace) -> int:
    worst = 0
    with ClusterQueue(_address(args), timeout_s=args.timeout) as queue:
        for job_id in args.job_ids:
            match queue.request(m.CancelJob(job_id=job_id)):
                case m.Accepted(duplicate=True):
                    print(f"job {job_id}: already cancelled (or its cancel is under way)")
                case m.Accepted():
                    print(f"job {job_id}: cancelled (a leased one stops at its node's next renewal, checkpointed)")
                case m.Refused(reason=reason):
                    print(f"freeride: job {job_id}: {reason}", file=sys.stderr)
                    worst = 2
                case reply:
                    print(f"freeride: job {job_id}: unexpected reply {reply!r}", file=sys.stderr)
                    worst = max(worst, 1)
    return worst


@_queue_call
def cmd_cluster_stop(args: argparse.Namespace) -> int:
    with ClusterQueue(_address(args), timeout_s=args.timeout) as queue:
        queue.destroy()
    print("freeride: the cluster queue is gone, with every job in it")
    return 0


@_queue_call
def cmd_cluster_join(args: argparse.Namespace) -> int:
    from freeride.cluster.agent import Agent, AgentConfig

    keys_dir = common.keys_dir(args)
    secret = signing.load_secret(keys_dir)
    config = AgentConfig(
        secret=secret,
        node=args.node or socket.gethostname(),
        lease_s=parse_duration_ns(args.lease) / 1e9,
        poll_s=parse_duration_ns(args.poll) / 1e9,
        policy=OfferPolicy(jobs_per_device=args.jobs_per_device, min_share=parse_share(args.min_share)),
        allow_programs=args.allow_programs,
    )
    stop = threading.Event()
    # the manager's socket first: a runtime dir another user planted is refused before Ray is touched
    with common.control(args) as control, ClusterQueue(_address(args), create=True, timeout_s=args.timeout) as queue:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"freeride: node {config.node} joined the cluster queue", flush=True)
        if secret is None:
            print(
                f"freeride: node {config.node} runs jobs any Ray driver queues (no {signing.SECRET_FILE}"
                f" in {keys_dir}); `freeride keys --cluster` makes one: copy it to every node and submitter"
                " (docs/cluster.md)",
                file=sys.stderr,
                flush=True,
            )
        Agent(config, queue, control).run(stop)
    return 0


def add_parsers(subs: Subparsers) -> None:
    """Add ``freeride cluster`` and its subcommands to the ``freeride`` parser."""
    cluster = subs.add_parser(
        "cluster",
        help="a side-job queue for the whole job, on Ray (needs freeride-runtime[ray]): submit, status, report, join",
        description="One queue of side jobs for every node of a job; each node's `cluster join` takes what fits"
        " its bubbles (docs/cluster.md).",
    )
    commands = cluster.add_subparsers(dest="cluster_cmd", required=True, metavar="COMMAND")

    def queue_options(sub: argparse.ArgumentParser, timeout: float = 30.0) -> None:
        sub.add_argument("--address", metavar="ADDR", help=_ADDRESS_HELP)
        sub.add_argument("--timeout", type=float, default=timeout, help="seconds to wait for the queue")

    s = commands.add_parser("submit", help="queue side jobs (many shards at once) for every node")
    queue_options(s)
    s.add_argument("target", help="module:Class of an iterative task, or a name from `freeride submit --list`")
    s.add_argument("--name", help="job name; with --shards N the jobs are NAME-0 .. NAME-(N-1)")
    s.add_argument("--shards", type=int, default=1, help="queue N jobs, job I with options shard=I shards=N")
    s.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="task option (repeatable)")
    s.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where the jobs checkpoint: a directory every node mounts at the same path, so that a job resumes on"
        " another node (default: each node's state dir: a job then restarts from scratch elsewhere)",
    )
    s.add_argument("--peak-memory", metavar="SIZE", help="peak device memory, e.g. 2G (nodes only lease jobs that fit)")
    s.add_argument("--step-time", metavar="DURATION", help="expected step time, e.g. 5ms, until measured")
    s.add_argument("--max-restarts", type=int, default=3, help="restarts from checkpoint on one node after a crash")
    s.add_argument("--max-attempts", type=int, default=3, help="failed attempts (on any node) before a job fails")
    s.add_argument("--fill", action="store_true", help="fill the ends of bubbles (see `freeride submit --fill`)")
    s.add_argument(
        "--keys-dir",
        metavar="DIR",
        help=f"where the cluster's {signing.SECRET_FILE} is, to sign the jobs with (default ${auth.KEYS_ENV} or"
        f" {auth.default_keys_dir()}); see `freeride keys --cluster`",
    )
    s.set_defaults(fn=cmd_cluster_submit)

    s = commands.add_parser("status", help="jobs by state, every node's leases and bubbles, each job")
    queue_options(s)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--nodes", action="store_true", help="nodes only, no job table")
    s.set_defaults(fn=cmd_cluster_status)

    s = commands.add_parser("report", help="bubble time, harvested share and interference of every node, summed")
    queue_options(s)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_cluster_report)

    s = commands.add_parser(
        "cancel", help="cancel jobs: a queued one at once, a leased one at its node (it checkpoints)"
    )
    queue_options(s)
    s.add_argument("job_ids", type=int, nargs="+", metavar="JOB", help="job ids, as `freeride cluster status` shows")
    s.set_defaults(fn=cmd_cluster_cancel)

    s = commands.add_parser("stop", help="end the queue (every job in it is forgotten)")
    queue_options(s)
    s.set_defaults(fn=cmd_cluster_stop)

    s = commands.add_parser(
        "join",
        help="run this node's agent beside its `freeride serve`: lease jobs that fit, run them, report them",
    )
    queue_options(s)
    common.add_runtime(s)
    s.add_argument("--node", help="this node's name in the queue (default: the host name)")
    s.add_argument(
        "--lease",
        default="30s",
        metavar="DURATION",
        help="a job whose lease this node stops renewing goes back to the queue after this long (default 30s)",
    )
    s.add_argument("--poll", default="1s", metavar="DURATION", help="seconds between two looks at the manager")
    s.add_argument("--jobs-per-device", type=int, default=1, help="side tasks per device before it takes no more")
    s.add_argument(
        "--allow-programs",
        action="store_true",
        help="also run imperative jobs (command lines) from the queue, as the manager's user: whoever can reach"
        " the Ray cluster can queue them (docs/cluster.md, access control)",
    )
    s.add_argument(
        "--min-share",
        default="2%",
        metavar="SHARE",
        help="a device whose bubbles are under this share of its time takes no jobs (default 2%%)",
    )
    s.set_defaults(fn=cmd_cluster_join)
