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
markdown section comes from :mod:`_bench_report`. :func:`bench_schedules` is the
``main`` of a benchmark that runs one training script under several schedules.

The harness's parts live beside it, each with one job: :mod:`_bench_tasks`
(the job and its side tasks), :mod:`_bench_options` (how many runs of what,
their flags, and the runs in time order), :mod:`_bench_figures` (what a run
measured) and :mod:`_bench_commands` (the commands it runs). This module runs
the benchmark and talks to the manager; it re-exports the parts' names, which
the benchmark scripts import from here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

# tools/bench is the script's directory: the harness's parts import by their bare names
from _bench_commands import freeride_cmd, plain_env, profile_job, run_cmd, serve_cmd
from _bench_figures import StepFigures, holdback_of, parse_steps, with_figures
from _bench_options import (
    HOW_IT_RUNS,
    SKIP_STEPS,
    BenchOptions,
    PlannedRun,
    add_bench_args,
    bench_options,
    bench_parser,
    parse_bench_args,
    parse_schedules,
    plan,
)
from _bench_report import RunKind, RunResult, Section, render
from _bench_tasks import ROOT, TASK_DEFAULTS, Job, SideTask, add_side_task_args, side_task, side_tasks

from freeride import protocol as p
from freeride.host.procs import descendants, process_cpu_ns
from freeride.profile import load_profile
from freeride.serve.guard import describe as describe_guard
from freeride.transport import ControlClient, Endpoints, ManagerUnreachable

__all__ = [
    "Benched",
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
    "bench_runs",
    "bench_options",
    "bench_schedules",
    "bench_parser",
    "parse_bench_args",
    "parse_schedules",
    "parse_steps",
    "plan",
    "serve_cmd",
    "side_task",
    "manager_status",
    "stop_serve",
    "wait_for_serve",
    "with_figures",
]

_NO_SIDE_PRIORITY = "this `freeride serve` has no --side-priority: side tasks ran at nice 19"


def manager_status(endpoints: Endpoints) -> p.StatusReply:
    """The manager's status (raises ``ManagerUnreachable`` if it does not answer within 10 s)."""
    with ControlClient(endpoints.control, timeout_s=10) as client:
        reply = client.request(p.StatusRequest())
    if not isinstance(reply, p.StatusReply):
        raise RuntimeError(f"unexpected status reply {reply!r}")
    return reply


class ManagerFailed(RuntimeError):
    """``freeride serve`` exited or never answered; the message ends with its log's tail."""


def wait_for_serve(
    what: str, timeout_s: float, check: Callable[[], bool], serve: subprocess.Popen[bytes], log: Path
) -> None:
    """Wait until ``check()`` holds (a manager not answering yet counts as not yet).

    Raises:
        ManagerFailed: ``serve`` exited, or ``timeout_s`` passed; the message ends with ``log``'s tail.
    """
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
    tasks = manager_status(endpoints).tasks
    failed = [t for t in tasks if t.state == "failed"]
    if failed:
        raise RuntimeError(f"side task {failed[0].name} failed: {failed[0].error}")
    return sum(t.state == "running" for t in tasks) == count


def _serve_knows_side_priority() -> bool:
    help_text, _ = run_cmd(freeride_cmd("serve", "--help"))
    return "--side-priority" in help_text


def stop_serve(serve: subprocess.Popen[bytes]) -> None:
    """SIGTERM to ``freeride serve``, SIGKILL to its process group if it is not gone within 30 s."""
    if serve.poll() is None:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def _freeride_cpu_ns(serve_pid: int) -> tuple[int, int]:
    """CPU time so far of the manager, and of every process under it (its side tasks' workers and programs)."""
    under = sum(max(0, process_cpu_ns(pid)) for pid in descendants(serve_pid))
    return max(0, process_cpu_ns(serve_pid)), under


def _one_run(
    job: Job, planned: PlannedRun, steps: int, runtime: Path, endpoints: Endpoints, holdback_every: int, serve_pid: int
) -> RunResult:
    before = manager_status(endpoints) if planned.kind == "with" else None
    cpu_before = _freeride_cpu_ns(serve_pid) if planned.kind == "with" else (0, 0)
    match planned.kind:
        case "alone":
            cmd = job.cmd(steps)
        case "hooked":  # no manager, and none started: the adapter's emits all drop
            nobody = str(runtime / "nobody")
            cmd = freeride_cmd("launch", "--no-manager", "--runtime-dir", nobody, "--", *job.cmd(steps))
        case "with":
            cmd = freeride_cmd("launch", "--runtime-dir", str(runtime), "--", *job.cmd(steps))
    # each run its own job for the manager's meter: its held-back steps are drawn anew
    name = f"bench-{planned.kind}-{planned.pair_kind}-{planned.pair}-{planned.role}"
    stdout, wall = run_cmd(cmd, job=name)
    figures = parse_steps(stdout, holdback_of(name, holdback_every) if planned.kind == "with" else None)
    result = RunResult(
        planned.kind, planned.role, planned.pair, planned.pair_kind, figures.step_ms, figures.cpu_ms, wall
    )
    result.trained_ns = figures.trained_ns
    result.held_step_ms = figures.held_step_ms
    if before is not None:
        manager, under = _freeride_cpu_ns(serve_pid)
        result.manager_cpu_ns = manager - cpu_before[0]
        result.freeride_cpu_ns = result.manager_cpu_ns + under - cpu_before[1]
        result.steps = steps
        with_figures(result, before, manager_status(endpoints))
    return result


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
    return bench_runs(
        job, task, options, command=command, cpu_note=cpu_note, serve_args=serve_args, submit_args=submit_args
    ).markdown


@dataclass(frozen=True, slots=True)
class Benched:
    """One section of a benchmark: its markdown and the runs it measured (its own, not those shown from another)."""

    title: str
    markdown: str
    runs: list[RunResult]

    def controls(self) -> list[RunResult]:
        """Its A/A pairs, for a later section of the same job to show (:func:`bench_runs`' ``shown``)."""
        return [replace(r, shown_from=self.title) for r in self.runs if r.pair_kind == "alone" and r.role != "warmup"]


def bench_runs(
    job: Job,
    task: SideTask | Sequence[SideTask],
    options: BenchOptions,
    *,
    command: str = "",
    cpu_note: str = "",
    serve_args: Sequence[str] = (),
    submit_args: Sequence[str] = (),
    profile_path: Path | None = None,
    shown: Sequence[RunResult] = (),
) -> Benched:
    """:func:`bench`, for a benchmark of one job with several side tasks in turn (the GPU check's workloads).

    ``profile_path``: the job's profile, made once for every side task (``None``: profile it here).
    ``shown``: runs of an earlier section of the same job to show and count with this one's, renumbered
    after its own pairs: its A/A pairs (:meth:`Benched.controls`), since the job alone does not depend on the
    side task. The manager and its state are this section's own.
    """
    tasks = [task] if isinstance(task, SideTask) else list(task)
    load_before, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M %Z")
    runtime = Path(tempfile.mkdtemp(prefix="frbench-", dir="/tmp"))
    endpoints = Endpoints.ipc(runtime)
    serve: subprocess.Popen[bytes] | None = None
    try:
        if profile_path is None:
            profile_path = profile_job(job, runtime)
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
                env=plain_env(),
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        wait_for_serve("the manager", 60, lambda: bool(manager_status(endpoints)), serve, runtime / "serve.log")
        for side in tasks:
            opts = [x for opt in side.options for x in ("--opt", opt)]
            role = ["--fill"] if side.fill else []
            for device in profile.devices:
                submit = freeride_cmd("submit", "--runtime-dir", str(runtime), side.target, *opts, *role)
                run_cmd([*submit, "--step-time", side.step_time, "--device", device, *submit_args])
        count = len(tasks) * len(profile.devices)
        wait_for_serve(
            "side tasks to start", 120, lambda: _tasks_running(endpoints, count), serve, runtime / "serve.log"
        )
        runs: list[RunResult] = []
        for planned in plan(options):
            result = _one_run(job, planned, options.steps, runtime, endpoints, options.holdback_every, serve.pid)
            runs.append(result)
            cpu = f", cpu {result.cpu_ms:.2f} ms" if result.cpu_ms is not None else ""
            flags = f" [{'; '.join(result.flags)}]" if result.flags else ""
            label = "warm-up" if planned.pair < 0 else f"pair {planned.pair}"
            print(f"{label} {result.kind}: step {result.step_ms:.2f} ms{cpu}{flags}", file=sys.stderr)
            if result.kind == "with":  # where each device's interference guard stands, and why
                for d in manager_status(endpoints).devices:
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
            runs=[*runs, *_renumbered(shown, after=runs)],
            final=manager_status(endpoints),
            cpu_note=cpu_note,
        )
        return Benched(job.title, render(section), runs)
    finally:
        if serve is not None:
            stop_serve(serve)
        if options.keep:
            print(f"runtime dir kept: {runtime}", file=sys.stderr)
        else:
            shutil.rmtree(runtime, ignore_errors=True)


def _renumbered(shown: Sequence[RunResult], *, after: Sequence[RunResult]) -> list[RunResult]:
    """Copies of ``shown``'s paired runs with pair numbers following those of ``after`` (warm-ups are left)."""
    start = max((r.pair for r in after), default=-1) + 1
    base = min((r.pair for r in shown if r.pair >= 0), default=0)
    return [replace(r, pair=start + r.pair - base) for r in shown if r.pair >= 0]


def bench_schedules(
    run: Callable[..., str],
    argv: Sequence[str] | None,
    *,
    doc: str | None,
    bench_script: str,
    framework: str,
    train_script: str,
    schedule_args: Mapping[str, tuple[str, ...]],
    default: str,
) -> int:
    """The ``main`` of a benchmark that runs ``tools/train/<train_script>`` under each schedule it is given.

    Args:
        run: benchmarks one job and returns its section, called as :func:`bench` is; the script passes the
            ``bench`` it imports, so that a stand-in put in the script's namespace serves instead.
        argv: the benchmark's arguments (``sys.argv[1:]`` if None); those after ``--`` go to the training script.
        doc: the benchmark's description (its ``--help``).
        bench_script: the benchmark's file name in tools/bench, for the command line its report shows.
        framework: the framework's name in the report's headings.
        train_script: the training script's file name in tools/train.
        schedule_args: ``--schedules`` names -> the training script's flags that select each.
        default: the ``--schedules`` default (comma-separated).

    Returns:
        0, once the report (markdown, one section per schedule) is printed; a bad option exits as a usage error.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = bench_parser(doc, steps=25)
    ap.add_argument("--schedules", default=default, help=f"comma-separated, among: {', '.join(schedule_args)}")
    ap.add_argument("train_args", nargs="*", help=f"after --: arguments for tools/train/{train_script}")
    ns, task, options = parse_bench_args(ap, argv)
    schedules = parse_schedules(ap, ns.schedules, schedule_args)
    command = shlex.join(["python", f"tools/bench/{bench_script}", *argv])
    sections = [f"## {framework}: training with side tasks in its bubbles"]
    for schedule in schedules:
        job = Job(
            title=f"### {framework} {schedule}: training with side tasks in its bubbles",
            script=ROOT / "tools" / "train" / train_script,
            args=(*schedule_args[schedule], *ns.train_args),
        )
        sections.append(run(job, task, options, command=command))
    print("\n\n".join(sections))
    return 0
