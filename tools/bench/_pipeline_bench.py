"""The harness both pipeline benchmarks share: profile, serve, submit, then alone/with runs.

A :class:`Job` is one training command (a script printing one JSON line per step
with ``rank`` and ``step_ms``). :func:`bench` profiles it with ``freeride
profile``, starts ``freeride serve --profile``, submits one side task pinned to
each profiled device, then runs the job ``pairs`` times alone (no FreeRide at
all), optionally under the hooks with no manager listening, and under ``freeride
launch``, interleaved in time, and returns a markdown section.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from freeride import protocol as p
from freeride.profile import Profile, load_profile
from freeride.transport import ControlClient, Endpoints, ManagerUnreachable
from freeride.units import parse_duration_ns
from sidetasks import resolve

__all__ = ["SKIP_STEPS", "TASK_DEFAULTS", "Job", "RunResult", "SideTask", "add_side_task_args", "bench", "side_task"]

ROOT = Path(__file__).resolve().parents[2]
SKIP_STEPS = 3
"""Leading steps of every run left out of its median."""
PROFILE_STEPS = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    title: str
    """Heading of the markdown section."""
    script: Path
    args: tuple[str, ...]
    """Arguments of the training script (besides ``--spawn`` and ``--steps``)."""

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


TASK_DEFAULTS: dict[str, tuple[str, ...]] = {
    # the default batch steps far longer than a small job's bubbles
    "sidetasks.graph_sgd:GraphSGD": ("batch_edges=2048",),
}
"""Options a benchmark gives a side task (``module:Class``) unless ``--opt`` sets them; other tasks get none."""


def add_side_task_args(ap: argparse.ArgumentParser) -> None:
    """The ``--task``, ``--opt`` and ``--step-time`` flags both benchmarks take (see :func:`side_task`)."""
    ap.add_argument("--task", default="graph-sgd", help="a side task from `freeride submit --list`, or module:Class")
    ap.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="side-task option (repeatable); graph-sgd defaults to batch_edges=2048",
    )
    ap.add_argument("--step-time", default="2ms", help="the side task's expected step time, until measured")


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


@dataclass(slots=True)
class RunResult:
    kind: str
    median_step_ms: float
    wall_s: float
    bubble_ns: int = 0
    used_ns: int = 0
    overruns: int = 0
    overrun_ns: int = 0
    task_steps: dict[str, int] = field(default_factory=dict)


def _freeride(*args: str) -> list[str]:
    return [sys.executable, "-m", "freeride.cli", *args]


def _median_step_ms(stdout: str) -> float:
    times = [
        float(record["step_ms"])
        for record in (json.loads(line) for line in stdout.splitlines() if line.startswith("{"))
        if "step_ms" in record and record["rank"] == 0
    ]
    if len(times) <= SKIP_STEPS:
        raise RuntimeError(f"training printed {len(times)} steps")
    return statistics.median(times[SKIP_STEPS:])


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_") and k != "PYTHONPATH"}


def _run(cmd: list[str]) -> tuple[str, float]:
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=_plain_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return done.stdout, time.monotonic() - t0


def _status(endpoints: Endpoints) -> p.StatusReply:
    with ControlClient(endpoints.control, timeout_s=10) as client:
        reply = client.request(p.StatusRequest())
    if not isinstance(reply, p.StatusReply):
        raise RuntimeError(f"unexpected status reply {reply!r}")
    return reply


def _wait_for(what: str, timeout_s: float, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except ManagerUnreachable:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _tasks_running(endpoints: Endpoints, count: int) -> bool:
    tasks = _status(endpoints).tasks
    failed = [t for t in tasks if t.state == "failed"]
    if failed:
        raise RuntimeError(f"side task {failed[0].name} failed: {failed[0].error}")
    return sum(t.state == "running" for t in tasks) == count


def _with_run(job: Job, steps: int, runtime: Path, endpoints: Endpoints) -> RunResult:
    before = _status(endpoints)
    stdout, wall = _run(_freeride("launch", "--runtime-dir", str(runtime), "--", *job.cmd(steps)))
    after = _status(endpoints)
    result = RunResult("with", _median_step_ms(stdout), wall)
    old = {d.device: d for d in before.devices}
    for d in after.devices:
        o = old.get(d.device)
        result.bubble_ns += d.bubble_ns - (o.bubble_ns if o else 0)
        result.used_ns += d.used_ns - (o.used_ns if o else 0)
        result.overruns += d.overruns - (o.overruns if o else 0)
        result.overrun_ns += d.overrun_ns - (o.overrun_ns if o else 0)
    old_tasks = {t.task_id: t.steps for t in before.tasks}
    for t in after.tasks:
        result.task_steps[t.device] = result.task_steps.get(t.device, 0) + t.steps - old_tasks.get(t.task_id, 0)
    return result


def _report(job: Job, steps: int, task: SideTask, profile: Profile, runs: list[RunResult], final: p.StatusReply) -> str:
    alone = [r.median_step_ms for r in runs if r.kind == "alone"]
    hooked = [r.median_step_ms for r in runs if r.kind == "hooked"]
    with_ = [r for r in runs if r.kind == "with"]
    ratios = [w.median_step_ms / a for a, w in zip(alone, with_, strict=True)]
    slowdown = statistics.median(w.median_step_ms for w in with_) / statistics.median(alone) - 1
    bubble = sum(r.bubble_ns for r in with_)
    used = sum(r.used_ns for r in with_)
    overrun = sum(r.overrun_ns for r in with_)
    train_s = sum(r.wall_s for r in with_)
    steps_by_device: dict[str, int] = {}
    for r in with_:
        for device, n in r.task_steps.items():
            steps_by_device[device] = steps_by_device.get(device, 0) + n
    lines = [
        job.title,
        "",
        f"Training: `{job.shown(steps)}`; side task `{task.target}` "
        f"({', '.join(task.options) or 'defaults'}) pinned to each stage's device.",
        "",
        "| stage | device | step (profile) | bubbles/step | bubble share |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in profile.stages:
        lines.append(
            f"| {s.stage} | {s.device} | {s.step_time_ns / 1e6:.1f} ms | {len(s.bubbles)} "
            f"({', '.join(f'{b.key} {b.duration_ns / 1e6:.1f} ms' for b in s.bubbles)}) | {s.bubble_fraction:.1%} |"
        )
    lines += ["", "| run | kind | median step (ms) | bubble use | overruns |", "| --- | --- | --- | --- | --- |"]
    for i, r in enumerate(runs):
        use = f"{r.used_ns / r.bubble_ns:.1%}" if r.bubble_ns else "-"
        over = f"{r.overruns} ({r.overrun_ns / 1e6:.1f} ms)" if r.kind == "with" else "-"
        lines.append(f"| {i} | {r.kind} | {r.median_step_ms:.2f} | {use} | {over} |")
    lines += [
        "",
        "| metric | value | goal |",
        "| --- | --- | --- |",
        f"| training slowdown (median with / median alone - 1) | {slowdown:+.2%} | <= 0.5% |",
        f"| slowdown per pair (median, min..max) | {statistics.median(ratios) - 1:+.2%} "
        f"({min(ratios) - 1:+.2%}..{max(ratios) - 1:+.2%}) | |",
        *(
            [
                f"| hooks alone, no manager (median hooked / median alone - 1) | "
                f"{statistics.median(hooked) / statistics.median(alone) - 1:+.2%} | |"
            ]
            if hooked
            else []
        ),
        f"| bubble time used by side-task steps | {used / bubble:.1%} of {bubble / 1e9:.2f} s | >= 85% |"
        if bubble
        else "| bubble time used by side-task steps | no bubbles seen | >= 85% |",
        f"| side-task steps past a bubble's end | {overrun / 1e6:.1f} ms total | |",
        f"| side-task throughput | {sum(steps_by_device.values()) / train_s:.1f} steps/s "
        f"({', '.join(f'{d}: {n / train_s:.1f}' for d, n in sorted(steps_by_device.items()))}) | |",
        f"| bubble start -> side-task step start | p50 {final.latency.p50_ns / 1e6:.2f} ms, "
        f"p99 {final.latency.p99_ns / 1e6:.2f} ms ({final.latency.count} grants) | p99 <= 1 ms |",
    ]
    return "\n".join(lines)


def _stop(serve: subprocess.Popen[bytes]) -> None:
    if serve.poll() is None:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def bench(job: Job, task: SideTask, *, pairs: int, steps: int, hooked: bool = False, keep: bool = False) -> str:
    """Profile, serve, submit and run the alone/(hooked/)with rounds of ``job``; its markdown section."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    if steps <= SKIP_STEPS:
        raise ValueError(f"steps must be > {SKIP_STEPS}, got {steps}")
    runtime = Path(tempfile.mkdtemp(prefix="frbench-", dir="/tmp"))
    endpoints = Endpoints.ipc(runtime)
    serve: subprocess.Popen[bytes] | None = None
    try:
        profile_path = runtime / "profile.json"
        _run(
            _freeride(
                "profile", "--runtime-dir", str(runtime), "--out", str(profile_path), "--", *job.cmd(PROFILE_STEPS)
            )
        )
        profile = load_profile(profile_path)
        with open(runtime / "serve.log", "wb") as log:
            serve = subprocess.Popen(
                _freeride("serve", "--runtime-dir", str(runtime), "--profile", str(profile_path)),
                env=_plain_env(),
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        _wait_for("the manager", 60, lambda: bool(_status(endpoints)))
        opts = [x for opt in task.options for x in ("--opt", opt)]
        for device in profile.devices:
            submit = _freeride("submit", "--runtime-dir", str(runtime), task.target, *opts)
            _run([*submit, "--step-time", task.step_time, "--device", device])
        _wait_for("side tasks to start", 120, lambda: _tasks_running(endpoints, len(profile.devices)))
        runs: list[RunResult] = []
        nobody = runtime / "nobody"  # no manager there: the adapter's emits all drop
        for i in range(pairs):
            stdout, wall = _run(job.cmd(steps))
            runs.append(RunResult("alone", _median_step_ms(stdout), wall))
            if hooked:
                stdout, wall = _run(_freeride("launch", "--runtime-dir", str(nobody), "--", *job.cmd(steps)))
                runs.append(RunResult("hooked", _median_step_ms(stdout), wall))
            runs.append(_with_run(job, steps, runtime, endpoints))
            print(
                f"round {i}: "
                + ", ".join(f"{r.kind} {r.median_step_ms:.2f} ms" for r in runs[-(3 if hooked else 2) :]),
                file=sys.stderr,
            )
        return _report(job, steps, task, profile, runs, _status(endpoints))
    finally:
        if serve is not None:
            _stop(serve)
        if keep:
            print(f"runtime dir kept: {runtime}", file=sys.stderr)
        else:
            shutil.rmtree(runtime, ignore_errors=True)
