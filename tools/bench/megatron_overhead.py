"""What side tasks in a megatron-core job's bubbles cost the job, and how much of the bubbles they use.

For each schedule (1F1B, interleaved 1F1B), runs the same 2-stage training
(``tools/train/megatron_gpt.py``) for N steps, alternately alone (no FreeRide at
all) and under ``freeride launch`` with one iterative side task per stage, each
pinned to its stage's device (on CPU: the stage's core, shared with the side task
as a GPU would be). Before that, the job is profiled with ``freeride profile``
and a manager is started with the profile::

    python tools/bench/megatron_overhead.py --pairs 3 --steps 30 -- --hidden 256 --seq 64

Reports, as markdown: the training slowdown (ratio of median step times, with
over alone), the share of bubble time the side tasks spent in steps (from
``freeride status --json``), their throughput, grant latency and overruns.
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
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from freeride import protocol as p
from freeride.profile import Profile, load_profile
from freeride.units import parse_duration_ns

__all__ = ["BenchArgs", "RunResult", "main"]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "train" / "megatron_gpt.py"
SKIP_STEPS = 3
"""Leading steps of every run left out of its median."""
SCHEDULE_ARGS = {"1f1b": ("--schedule", "1f1b"), "interleaved": ("--schedule", "interleaved", "--vpp", "2")}


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchArgs:
    pairs: int
    """Alone/with run pairs per schedule, interleaved in time."""
    steps: int
    """Training steps per run."""
    schedules: tuple[str, ...]
    task: str
    """Side task, ``module:Class``."""
    task_opts: tuple[str, ...]
    step_time: str
    """The side task's expected step time, until measured."""
    train_args: tuple[str, ...]
    """Extra arguments for the training script."""
    keep: bool
    """Keep the runtime directories (logs, profiles) for inspection."""

    def __post_init__(self) -> None:
        if self.pairs < 1:
            raise ValueError(f"pairs must be >= 1, got {self.pairs}")
        if self.steps <= SKIP_STEPS:
            raise ValueError(f"steps must be > {SKIP_STEPS}, got {self.steps}")
        unknown = set(self.schedules) - SCHEDULE_ARGS.keys()
        if not self.schedules or unknown:
            raise ValueError(f"schedules must be among {sorted(SCHEDULE_ARGS)}, got {self.schedules}")
        parse_duration_ns(self.step_time)


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


def _train_cmd(args: BenchArgs, schedule: str, steps: int) -> list[str]:
    cmd = [sys.executable, str(SCRIPT), "--spawn", "2", "--steps", str(steps)]
    return [*cmd, *SCHEDULE_ARGS[schedule], *args.train_args]


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


def _run(cmd: list[str], env: dict[str, str]) -> tuple[str, float]:
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return done.stdout, time.monotonic() - t0


def _status(runtime: Path) -> p.StatusReply:
    """What ``freeride status --json`` says."""
    stdout, _ = _run(_freeride("status", "--runtime-dir", str(runtime), "--json", "--timeout", "10"), _plain_env())
    data = json.loads(stdout)
    for task in data.get("tasks", []):  # JSON has no NaN: a NaN metric comes back as null
        task["metrics"] = {k: float("nan") if v is None else v for k, v in task.get("metrics", {}).items()}
    return msgspec.convert(data, p.StatusReply)


def _wait_for(what: str, timeout_s: float, check: object) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if callable(check) and check():
                return
        except RuntimeError:  # no manager yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.5)


class TaskFailed(Exception):
    """A side task failed before the benchmark could use it."""


def _tasks_running(runtime: Path, count: int) -> bool:
    tasks = _status(runtime).tasks
    failed = [t for t in tasks if t.state == "failed"]
    if failed:
        raise TaskFailed(f"side task {failed[0].name} failed: {failed[0].error}")
    return sum(t.state == "running" for t in tasks) == count


def _with_run(args: BenchArgs, schedule: str, runtime: Path) -> RunResult:
    before = _status(runtime)
    launch = _freeride("launch", "--runtime-dir", str(runtime), "--", *_train_cmd(args, schedule, args.steps))
    stdout, wall = _run(launch, _plain_env())
    after = _status(runtime)
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


def _report(args: BenchArgs, schedule: str, profile: Profile, runs: list[RunResult], final: p.StatusReply) -> str:
    alone = [r.median_step_ms for r in runs if r.kind == "alone"]
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
        f"### megatron-core {schedule}: training with side tasks in its bubbles",
        "",
        f"Training: `{shlex.join([str(SCRIPT.relative_to(ROOT)), *_train_cmd(args, schedule, args.steps)[2:]])}`; "
        f"side task `{args.task}` "
        f"({', '.join(args.task_opts) or 'defaults'}) pinned to each stage's device.",
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


def bench_schedule(args: BenchArgs, schedule: str) -> str:
    """Profile, serve, submit and run the alone/with pairs of one schedule; its markdown section."""
    runtime = Path(tempfile.mkdtemp(prefix="frmgb-", dir="/tmp"))
    serve: subprocess.Popen[bytes] | None = None
    try:
        profile_path = runtime / "profile.json"
        profile_cmd = _freeride("profile", "--runtime-dir", str(runtime), "--out", str(profile_path), "--")
        _run([*profile_cmd, *_train_cmd(args, schedule, 8)], _plain_env())
        profile = load_profile(profile_path)
        with open(runtime / "serve.log", "wb") as log:
            serve = subprocess.Popen(
                _freeride("serve", "--runtime-dir", str(runtime), "--profile", str(profile_path)),
                env=_plain_env(),
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        _wait_for("the manager", 60, lambda: bool(_status(runtime)))
        for device in profile.devices:
            opts = [x for opt in args.task_opts for x in ("--opt", opt)]
            submit = _freeride("submit", "--runtime-dir", str(runtime), args.task, *opts)
            _run([*submit, "--step-time", args.step_time, "--device", device], _plain_env())
        _wait_for("side tasks to start", 120, lambda: _tasks_running(runtime, len(profile.devices)))
        runs: list[RunResult] = []
        for i in range(args.pairs):
            stdout, wall = _run(_train_cmd(args, schedule, args.steps), _plain_env())
            runs.append(RunResult("alone", _median_step_ms(stdout), wall))
            runs.append(_with_run(args, schedule, runtime))
            print(
                f"{schedule} pair {i}: alone {runs[-2].median_step_ms:.2f} ms, with {runs[-1].median_step_ms:.2f} ms",
                file=sys.stderr,
            )
        return _report(args, schedule, profile, runs, _status(runtime))
    finally:
        if serve is not None:
            _stop(serve)
        if args.keep:
            print(f"runtime dir kept: {runtime}", file=sys.stderr)
        else:
            shutil.rmtree(runtime, ignore_errors=True)


def parse_args(argv: list[str]) -> BenchArgs:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--schedules", default="1f1b,interleaved", help="comma-separated: 1f1b, interleaved")
    ap.add_argument("--task", default="freeride.sidetasks.graph_sgd:GraphSGD")
    ap.add_argument("--opt", action="append", default=None, help="side-task option KEY=VALUE (repeatable)")
    ap.add_argument("--step-time", default="2ms")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("train_args", nargs="*", help="after --: arguments for tools/train/megatron_gpt.py")
    ns = ap.parse_args(argv)
    opts = ns.opt if ns.opt is not None else ["batch_edges=2048"]
    try:
        return BenchArgs(
            pairs=ns.pairs,
            steps=ns.steps,
            schedules=tuple(s.strip() for s in ns.schedules.split(",") if s.strip()),
            task=ns.task,
            task_opts=tuple(opts),
            step_time=ns.step_time,
            train_args=tuple(ns.train_args),
            keep=ns.keep,
        )
    except ValueError as exc:
        ap.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join(["python", "tools/bench/megatron_overhead.py", *argv])
    sections = [bench_schedule(args, schedule) for schedule in args.schedules]
    header = f"## megatron-core: training with side tasks in its bubbles\n\nCommand: `{command}`"
    print("\n\n".join([header, *sections]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
