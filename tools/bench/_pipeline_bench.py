"""The harness the pipeline benchmarks share: profile, serve, submit, then paired runs.

A :class:`Job` is one training command (a script printing one JSON line per step
with ``rank`` and ``step_ms``, and ``cpu_ms`` where it measures its CPU time).
:func:`bench` profiles it, starts ``freeride serve --profile`` (side tasks at
the priority :class:`BenchOptions` names), submits one side task pinned to each
profiled device, and runs the job as :func:`plan` lays out:

* one warm-up run alone and one with side tasks, left out of every figure;
* ``pairs`` pairs of a run alone and a run under ``freeride launch`` (with
  side tasks), the order alternating from pair to pair (ABBA);
* ``controls`` A/A pairs (alone and alone), spread among them: the noise floor.

After each run with side tasks it reads the manager's status, so a pair whose
side tasks did no steps or finished is flagged rather than counted. The
markdown section comes from :mod:`_bench_report`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from _bench_report import Role, RunKind, RunResult, Section, render  # tools/bench is the script's directory

from freeride import protocol as p
from freeride.profile import load_profile
from freeride.serve.guard import describe as describe_guard
from freeride.serve.holdback import HoldbackSchedule
from freeride.tasks.targets import resolve
from freeride.transport import ControlClient, Endpoints, ManagerUnreachable
from freeride.units import parse_duration_ns

__all__ = [
    "ManagerFailed",
    "SKIP_STEPS",
    "TASK_DEFAULTS",
    "HOW_IT_RUNS",
    "BenchOptions",
    "Job",
    "PlannedRun",
    "RunKind",
    "RunResult",
    "SideTask",
    "StepFigures",
    "add_bench_args",
    "add_side_task_args",
    "side_tasks",
    "bench",
    "bench_options",
    "bench_parser",
    "parse_bench_args",
    "parse_schedules",
    "parse_steps",
    "plan",
    "serve_cmd",
    "side_task",
    "with_figures",
]

ROOT = Path(__file__).resolve().parents[2]
SKIP_STEPS = 3
"""Leading steps of every run left out of its medians."""
PROFILE_STEPS = 8
_NO_SIDE_PRIORITY = "this `freeride serve` has no --side-priority: side tasks ran at nice 19"

SidePriority = Literal["same", "low"]

HOW_IT_RUNS = """\
How the runs go (the same in every pipeline benchmark):

Before the runs, the job is profiled (by ``freeride profile``, or by itself for
the simulated job) and ``freeride serve --profile`` is started with the profile;
one iterative side task is submitted per stage, pinned to its stage's device (on
CPU: the stage's core, shared with the side task as a GPU would be).

A warm-up run of each kind comes first (per schedule, where there are several)
and is left out; then ``--pairs`` pairs (alone and with side tasks, the order
alternating) and ``--controls`` A/A pairs (alone and alone: the noise floor),
interleaved in time. Side tasks run at the stage's own priority
(``--side-priority same``: an overrun delays training as it would on a GPU)
unless ``--side-priority low`` is given.

Reports, as markdown: the training slowdown per pair (step time, and the
training ranks' CPU time per step) as a median with a distribution-free 95 %
interval of it (two order statistics; with too few pairs, the whole range and
what it covers), the A/A floor beside it and whether the interval lies below
the 0.5 % goal;
interference (side-task compute while the stage trained), the share of bubble
time the side tasks spent in steps (from ``freeride status``), their
throughput, grant latency and overruns. A pair whose side tasks finished,
failed or did no steps is named and left out.
"""
"""The ``--help`` epilog of every benchmark on this harness: what :func:`bench` does, said once."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    title: str
    """Heading of the markdown section."""
    script: Path
    args: tuple[str, ...]
    """Arguments of the training script (besides ``--spawn`` and ``--steps``)."""
    profiles_itself: bool = False
    """The script writes its own bubble profile with ``--profile-out FILE`` (the simulated job);
    otherwise the harness runs it under ``freeride profile``."""

    def cmd(self, steps: int) -> list[str]:
        return [sys.executable, str(self.script), "--spawn", "2", "--steps", str(steps), *self.args]

    def shown(self, steps: int) -> str:
        return shlex.join(["python", str(self.script.relative_to(ROOT)), *self.cmd(steps)[2:]])


@dataclass(frozen=True, kw_only=True, slots=True)
class SideTask:
    target: str
    """``module:Class``."""
    options: tuple[str, ...]
    step_time: str
    """Expected step time until measured."""
    fill: bool = False
    """Submitted as a filler of the ends of bubbles (``freeride submit --fill``)."""


TASK_DEFAULTS: dict[str, tuple[str, ...]] = {
    # the default batch steps far longer than a small job's bubbles
    "freeride.sidetasks.graph_sgd:GraphSGD": ("batch_edges=2048",),
}
"""Options a benchmark gives a side task (``module:Class``) unless ``--opt`` sets them; other tasks get none."""


def add_side_task_args(ap: argparse.ArgumentParser) -> None:
    """The ``--task``, ``--opt`` and ``--step-time`` flags the benchmarks take (see :func:`side_task`)."""
    ap.add_argument("--task", default="graph-sgd", help="a side task from `freeride submit --list`, or module:Class")
    ap.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="side-task option (repeatable); graph-sgd defaults to batch_edges=2048",
    )
    ap.add_argument("--step-time", default="2ms", help="the side task's expected step time, until measured")
    ap.add_argument(
        "--fill",
        metavar="TASK",
        default="",
        help="a second side task per device that fills the ends of bubbles the first leaves (a mix)",
    )
    ap.add_argument(
        "--fill-opt", action="append", default=[], metavar="KEY=VALUE", help="option of the --fill task (repeatable)"
    )
    ap.add_argument("--fill-step-time", default="1ms", help="the --fill task's expected step time, until measured")


def side_tasks(ns: argparse.Namespace) -> list[SideTask]:
    """The side tasks :func:`add_side_task_args`' flags name: the task, and its filler if ``--fill`` is given.

    Raises:
        ValueError: as :func:`side_task`.
    """
    tasks = [side_task(ns.task, ns.opt, ns.step_time)]
    if ns.fill:
        fill = side_task(ns.fill, ns.fill_opt, ns.fill_step_time)
        tasks.append(SideTask(target=fill.target, options=fill.options, step_time=fill.step_time, fill=True))
    elif ns.fill_opt:
        raise ValueError("--fill-opt without --fill")
    return tasks


def side_task(task: str, opts: Sequence[str], step_time: str) -> SideTask:
    """The side task to submit: ``task``'s defaults from :data:`TASK_DEFAULTS`, overridden key by key by ``opts``.

    Raises:
        ValueError: ``task`` is no side task name, an option is not ``KEY=VALUE`` or ``step_time`` no duration.
    """
    parse_duration_ns(step_time)
    target = resolve(task)
    options: dict[str, str] = {}
    for pair in (*TASK_DEFAULTS.get(target, ()), *opts):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--opt expects KEY=VALUE, got {pair!r}")
        options[key.replace("-", "_")] = value  # as `freeride submit` spells the key
    return SideTask(target=target, options=tuple(f"{k}={v}" for k, v in options.items()), step_time=step_time)


# --------------------------------------------------------------------------
# options and the plan of runs
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOptions:
    """How many runs of what, validated."""

    pairs: int = 8
    """Pairs of a run alone and a run with side tasks."""
    controls: int = 4
    """A/A control pairs (alone and alone)."""
    steps: int = 25
    """Training steps per run (the first :data:`SKIP_STEPS` are left out)."""
    hooked: bool = False
    """Also pairs of alone and the hooks with no manager listening (as many as ``controls``)."""
    side_priority: SidePriority = "same"
    """``same``: side tasks at the stage's priority (an overrun delays training, as on a GPU); ``low``: nice 19."""
    keep: bool = False
    """Keep the runtime directory (logs, profile)."""
    with_only: int = 0
    """Instead of pairs: this many runs with side tasks and nothing else (bubble use, interference and
    latency; no slowdown). 0: pairs as ``pairs`` and ``controls`` say."""
    holdback_every: int = 8
    """``serve --holdback-every``: one block of steps in this many gets no side work, so that the
    manager measures the job's cost on its own steps (its figure is reported beside the pairs')."""

    def __post_init__(self) -> None:
        if self.with_only < 0:
            raise ValueError(f"with_only must be >= 0, got {self.with_only}")
        if self.pairs < 1 and not self.with_only:
            raise ValueError(f"pairs must be >= 1, got {self.pairs}")
        if self.controls < 0:
            raise ValueError(f"controls must be >= 0, got {self.controls}")
        if self.steps <= SKIP_STEPS:
            raise ValueError(f"steps must be > {SKIP_STEPS}, got {self.steps}")
        if self.holdback_every < 0 or self.holdback_every % 2:
            raise ValueError(f"holdback_every must be 0 or an even number, got {self.holdback_every}")
        if self.side_priority not in ("same", "low"):
            raise ValueError(f"side_priority must be 'same' or 'low', got {self.side_priority!r}")


def add_bench_args(ap: argparse.ArgumentParser, *, steps: int = 25) -> None:
    """The flags of :class:`BenchOptions` (``steps``: this benchmark's default steps per run)."""
    ap.add_argument("--pairs", type=int, default=8, help="alone/with pairs, order alternating (default 8)")
    ap.add_argument("--controls", type=int, default=4, help="A/A pairs (alone/alone): the noise floor (default 4)")
    ap.add_argument("--steps", type=int, default=steps, help=f"training steps per run (default {steps})")
    ap.add_argument("--hooked", action="store_true", help="also pairs with the hooks but no manager listening")
    ap.add_argument(
        "--side-priority",
        choices=("same", "low"),
        default="same",
        help="side tasks at the stage's own CPU priority, so an overrun delays training as on a GPU "
        "(same, default), or at nice 19, the production default on CPU (low)",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the runtime directory (logs, profile, and trace.json: every bubble and grant)",
    )
    ap.add_argument(
        "--holdback-every",
        type=int,
        default=8,
        metavar="BLOCKS",
        help="serve --holdback-every: one block of 4 steps in this many runs without side work, for the manager's"
        " own measure of the job's cost, reported beside the pairs' (default 8, serve's; 2 measures the most)",
    )
    ap.add_argument(
        "--with-only",
        type=int,
        default=0,
        metavar="N",
        help="only N runs with side tasks, no warm-up and no runs alone: bubble use, interference and latency "
        "(no slowdown figure); --pairs and --controls are then ignored",
    )


def bench_parser(description: str | None, *, steps: int) -> argparse.ArgumentParser:
    """A benchmark's parser: its own ``description``, :data:`HOW_IT_RUNS` below the flags, and the shared flags.

    The flags are those of :func:`add_bench_args` (``steps``: this benchmark's default) and
    :func:`add_side_task_args`; the benchmark adds its own.
    """
    ap = argparse.ArgumentParser(
        description=description, epilog=HOW_IT_RUNS, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_bench_args(ap, steps=steps)
    add_side_task_args(ap)
    return ap


def parse_bench_args(
    ap: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.Namespace, list[SideTask], BenchOptions]:
    """``argv`` parsed by ``ap`` (from :func:`bench_parser`), with the side tasks and options it names.

    A side task or option that :func:`side_tasks` or :class:`BenchOptions` refuses exits as a usage error,
    as argparse's own errors do.
    """
    ns = ap.parse_args(argv)
    try:
        return ns, side_tasks(ns), bench_options(ns)
    except ValueError as exc:
        ap.error(str(exc))


def parse_schedules(ap: argparse.ArgumentParser, names: str, known: Collection[str]) -> tuple[str, ...]:
    """The comma-separated ``--schedules`` ``names``, each one of ``known``; anything else exits as a usage error."""
    schedules = tuple(s.strip() for s in names.split(",") if s.strip())
    if not schedules or set(schedules) - set(known):
        ap.error(f"schedules must be among {sorted(known)}, got {schedules}")
    return schedules


def bench_options(ns: argparse.Namespace) -> BenchOptions:
    """:class:`BenchOptions` from the flags of :func:`add_bench_args`.

    Raises:
        ValueError: a value out of range.
    """
    return BenchOptions(
        pairs=ns.pairs,
        controls=ns.controls,
        steps=ns.steps,
        hooked=ns.hooked,
        side_priority=ns.side_priority,
        keep=ns.keep,
        with_only=ns.with_only,
        holdback_every=ns.holdback_every,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedRun:
    kind: RunKind
    role: Role
    """``warmup`` (left out), or the ``a`` (alone) or ``b`` side of a pair."""
    pair: int
    """Index of the pair; -1 for a warm-up run."""
    pair_kind: RunKind
    """What the pair compares with alone: ``with``, ``hooked``, or ``alone`` (an A/A control)."""


def plan(options: BenchOptions) -> list[PlannedRun]:
    """The runs in time order: warm-ups, then the pairs, controls spread evenly among them, ABBA order.

    With ``with_only``: just that many runs with side tasks (the side tasks rehearse their steps before
    training starts, so no warm-up run is needed for them; none is left out).
    """
    if options.with_only:
        return [PlannedRun(kind="with", role="b", pair=i, pair_kind="with") for i in range(options.with_only)]
    runs = [PlannedRun(kind="alone", role="warmup", pair=-1, pair_kind="alone")]
    if options.hooked:
        runs.append(PlannedRun(kind="hooked", role="warmup", pair=-1, pair_kind="hooked"))
    runs.append(PlannedRun(kind="with", role="warmup", pair=-1, pair_kind="with"))
    groups: list[tuple[RunKind, int]] = [("with", options.pairs), ("alone", options.controls)]
    if options.hooked:
        groups.append(("hooked", options.controls))
    # each pair sits at the middle of its share of the sequence; ties keep the group order
    slots = sorted(
        ((i + 0.5) / count, g, kind) for g, (kind, count) in enumerate(groups) for i in range(count) if count
    )
    for index, (_, _, kind) in enumerate(slots):
        a = PlannedRun(kind="alone", role="a", pair=index, pair_kind=kind)
        b = PlannedRun(kind=kind, role="b", pair=index, pair_kind=kind)
        runs += [a, b] if index % 2 == 0 else [b, a]
    return runs


def serve_cmd(runtime: Path, profile: Path, side_priority: SidePriority, *, supported: bool = True) -> list[str]:
    """``freeride serve`` for the benchmark; ``supported``: whether this serve knows ``--side-priority``."""
    cmd = _freeride("serve", "--runtime-dir", str(runtime), "--profile", str(profile))
    if supported:
        cmd += ["--side-priority", side_priority]
    return cmd


# --------------------------------------------------------------------------
# what a run measured
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFigures:
    """What a run's JSON lines say."""

    step_ms: float
    """Rank 0's median step time (after :data:`SKIP_STEPS`)."""
    cpu_ms: float | None
    """Sum over ranks of each rank's median CPU time per step; None if the job does not report it."""
    trained_ns: int
    """Sum over ranks of all their step times: how long the stages trained."""
    held_step_ms: float | None = None
    """Rank 0's median over the measured steps held back from side work (None: none, or no schedule given)."""


def parse_steps(stdout: str, holdback: HoldbackSchedule | None = None) -> StepFigures:
    """The figures of a run from its JSON lines (one per rank and step, with ``step_ms`` and maybe ``cpu_ms``).

    With the manager's ``holdback`` schedule of the run's job, also the median of rank 0's steps
    that it held back from side work and measures (its ``step``, else the line's place in order).

    Raises:
        RuntimeError: rank 0 printed no more than :data:`SKIP_STEPS` steps.
    """
    steps: dict[int, list[float]] = {}
    cpu: dict[int, list[float]] = {}
    held: list[float] = []
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if "step_ms" not in record:
            continue
        rank = int(record["rank"])
        mine = steps.setdefault(rank, [])
        step = int(record.get("step", len(mine)))
        mine.append(float(record["step_ms"]))
        slot = holdback.slot(step) if holdback is not None and rank == 0 and step >= SKIP_STEPS else None
        if slot is not None and slot.role == "held" and slot.measured:
            held.append(float(record["step_ms"]))
        if "cpu_ms" in record:
            cpu.setdefault(rank, []).append(float(record["cpu_ms"]))
    times = steps.get(0, [])
    if len(times) <= SKIP_STEPS:
        raise RuntimeError(f"training printed {len(times)} steps of rank 0")
    cpu_ms = None
    if cpu and all(len(v) > SKIP_STEPS for v in cpu.values()):
        cpu_ms = sum(statistics.median(v[SKIP_STEPS:]) for v in cpu.values())
    trained_ns = round(sum(sum(v) for v in steps.values()) * 1e6)
    return StepFigures(
        step_ms=statistics.median(times[SKIP_STEPS:]),
        cpu_ms=cpu_ms,
        trained_ns=trained_ns,
        held_step_ms=statistics.median(held) if held else None,
    )


def with_figures(result: RunResult, before: p.StatusReply, after: p.StatusReply) -> None:
    """Fill ``result`` with what the manager counted between ``before`` and ``after``, and its flags."""
    old = {d.device: d for d in before.devices}
    for d in after.devices:
        o = old.get(d.device)
        result.bubble_ns += d.bubble_ns - (o.bubble_ns if o else 0)
        result.used_ns += d.used_ns - (o.used_ns if o else 0)
        result.overruns += d.overruns - (o.overruns if o else 0)
        result.overrun_ns += d.overrun_ns - (o.overrun_ns if o else 0)
        result.interference_ns += d.interference_ns - (o.interference_ns if o else 0)
        result.train_ns += d.train_ns - (o.train_ns if o else 0)
    old_steps = {t.task_id: t.steps for t in before.tasks}
    for t in after.tasks:
        done = t.steps - old_steps.get(t.task_id, 0)
        name = f"{t.name}@{t.device or '?'}"
        result.task_steps[name] = done
        if t.state in p.TERMINAL_STATES:
            why = f": {t.error}" if t.error else ""
            result.flags.append(f"{name} {t.state} after {done} steps in this run{why}")
        elif done == 0:
            result.flags.append(f"{name} did no steps in this run")
    if not after.tasks:
        result.flags.append("no side tasks")


# --------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------


def _freeride(*args: str) -> list[str]:
    return [sys.executable, "-m", "freeride.cli", *args]


def _plain_env() -> dict[str, str]:
    """The environment of every process the benchmark starts: none of ours, and this checkout's code.

    ``PYTHONPATH`` names this checkout: a job script run by path, and the workers
    ``serve`` starts with ``python -P``, would otherwise import ``freeride`` and
    ``backends`` from wherever the package is installed (an editable install of
    another checkout), not the code under test.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run(cmd: list[str], *, job: str = "") -> tuple[str, float]:
    t0 = time.monotonic()
    env = _plain_env() | ({"FREERIDE_JOB": job} if job else {})
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return done.stdout, time.monotonic() - t0


def _status(endpoints: Endpoints) -> p.StatusReply:
    with ControlClient(endpoints.control, timeout_s=10) as client:
        reply = client.request(p.StatusRequest())
    if not isinstance(reply, p.StatusReply):
        raise RuntimeError(f"unexpected status reply {reply!r}")
    return reply


class ManagerFailed(RuntimeError):
    """``freeride serve`` exited or never answered; the message ends with its log's tail."""


def _wait_for(
    what: str, timeout_s: float, check: Callable[[], bool], serve: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except ManagerUnreachable:
            pass
        if serve.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {serve.returncode}" if serve.returncode is not None else f"{timeout_s:.0f} s passed"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
            raise ManagerFailed(f"waiting for {what}: freeride serve {why}; its log ends:\n{tail}")
        time.sleep(0.2)


def _tasks_running(endpoints: Endpoints, count: int) -> bool:
    tasks = _status(endpoints).tasks
    failed = [t for t in tasks if t.state == "failed"]
    if failed:
        raise RuntimeError(f"side task {failed[0].name} failed: {failed[0].error}")
    return sum(t.state == "running" for t in tasks) == count


def _serve_knows_side_priority() -> bool:
    help_text, _ = _run(_freeride("serve", "--help"))
    return "--side-priority" in help_text


def _stop(serve: subprocess.Popen[bytes]) -> None:
    if serve.poll() is None:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def holdback_of(job: str, every: int) -> HoldbackSchedule | None:
    """The held-back steps ``serve --holdback-every every`` gives the job named ``job`` (None: none)."""
    if not every:
        return None
    return HoldbackSchedule(p.Holdback(job=job, every=every, max_every=4 * every))


def _one_run(
    job: Job, planned: PlannedRun, steps: int, runtime: Path, endpoints: Endpoints, holdback_every: int
) -> RunResult:
    before = _status(endpoints) if planned.kind == "with" else None
    match planned.kind:
        case "alone":
            cmd = job.cmd(steps)
        case "hooked":  # no manager there: the adapter's emits all drop
            cmd = _freeride("launch", "--runtime-dir", str(runtime / "nobody"), "--", *job.cmd(steps))
        case "with":
            cmd = _freeride("launch", "--runtime-dir", str(runtime), "--", *job.cmd(steps))
    # each run its own job for the manager's meter: its held-back steps are drawn anew
    name = f"bench-{planned.kind}-{planned.pair_kind}-{planned.pair}-{planned.role}"
    stdout, wall = _run(cmd, job=name)
    figures = parse_steps(stdout, holdback_of(name, holdback_every) if planned.kind == "with" else None)
    result = RunResult(
        planned.kind, planned.role, planned.pair, planned.pair_kind, figures.step_ms, figures.cpu_ms, wall
    )
    result.trained_ns = figures.trained_ns
    result.held_step_ms = figures.held_step_ms
    if before is not None:
        with_figures(result, before, _status(endpoints))
    return result


def _profile(job: Job, runtime: Path) -> Path:
    path = runtime / "profile.json"
    if job.profiles_itself:
        _run([*job.cmd(PROFILE_STEPS), "--profile-out", str(path)])
    else:
        _run(_freeride("profile", "--runtime-dir", str(runtime), "--out", str(path), "--", *job.cmd(PROFILE_STEPS)))
    return path


def bench(
    job: Job,
    task: SideTask | Sequence[SideTask],
    options: BenchOptions,
    *,
    command: str = "",
    cpu_note: str = "",
    serve_args: Sequence[str] = (),
    submit_args: Sequence[str] = (),
) -> str:
    """Profile, serve, submit and run :func:`plan`'s runs of ``job``; its markdown section.

    ``command`` is the benchmark's own command line, shown in the section; ``cpu_note`` says why the
    job reports no CPU time per step, if it does not. ``serve_args`` and ``submit_args`` are added to
    ``freeride serve`` and each ``freeride submit`` (``--mps``, ``--sm-share 50``). Each side task
    of ``task`` (one, or a task and its filler) is submitted pinned to every stage's device.
    """
    tasks = [task] if isinstance(task, SideTask) else list(task)
    load_before, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M %Z")
    runtime = Path(tempfile.mkdtemp(prefix="frbench-", dir="/tmp"))
    endpoints = Endpoints.ipc(runtime)
    serve: subprocess.Popen[bytes] | None = None
    try:
        profile_path = _profile(job, runtime)
        profile = load_profile(profile_path)
        supported = _serve_knows_side_priority()
        trace = ["--trace", str(runtime / "trace.json")] if options.keep else []
        with open(runtime / "serve.log", "wb") as log:
            serve = subprocess.Popen(
                [
                    *serve_cmd(runtime, profile_path, options.side_priority, supported=supported),
                    *trace,
                    "--holdback-every",
                    str(options.holdback_every),
                    *serve_args,
                ],
                env=_plain_env(),
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        _wait_for("the manager", 60, lambda: bool(_status(endpoints)), serve, runtime / "serve.log")
        for side in tasks:
            opts = [x for opt in side.options for x in ("--opt", opt)]
            role = ["--fill"] if side.fill else []
            for device in profile.devices:
                submit = _freeride("submit", "--runtime-dir", str(runtime), side.target, *opts, *role)
                _run([*submit, "--step-time", side.step_time, "--device", device, *submit_args])
        count = len(tasks) * len(profile.devices)
        _wait_for("side tasks to start", 120, lambda: _tasks_running(endpoints, count), serve, runtime / "serve.log")
        runs: list[RunResult] = []
        for planned in plan(options):
            result = _one_run(job, planned, options.steps, runtime, endpoints, options.holdback_every)
            runs.append(result)
            cpu = f", cpu {result.cpu_ms:.2f} ms" if result.cpu_ms is not None else ""
            flags = f" [{'; '.join(result.flags)}]" if result.flags else ""
            label = "warm-up" if planned.pair < 0 else f"pair {planned.pair}"
            print(f"{label} {result.kind}: step {result.step_ms:.2f} ms{cpu}{flags}", file=sys.stderr)
            if result.kind == "with":  # where each device's interference guard stands, and why
                for d in _status(endpoints).devices:
                    print(f"  guard {d.device}: {describe_guard(d)} ({d.guard_reason})", file=sys.stderr)
        section = Section(
            title=job.title,
            command=command,
            date=f"started {started}",
            load=f"{load_before:.2f} -> {os.getloadavg()[0]:.2f}",
            training=job.shown(options.steps),
            task_target=tasks[0].target,
            task_options=tasks[0].options,
            fill_target=tasks[1].target if len(tasks) > 1 else "",
            fill_options=tasks[1].options if len(tasks) > 1 else (),
            side_priority=options.side_priority if supported else "low",
            priority_note="" if supported else _NO_SIDE_PRIORITY,
            profile=profile,
            runs=runs,
            final=_status(endpoints),
            cpu_note=cpu_note,
        )
        return render(section)
    finally:
        if serve is not None:
            _stop(serve)
        if options.keep:
            print(f"runtime dir kept: {runtime}", file=sys.stderr)
        else:
            shutil.rmtree(runtime, ignore_errors=True)
