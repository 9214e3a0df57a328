"""What side tasks in a DeepSpeed job's bubbles cost the job, and how much of the bubbles they use.

Runs the same 2-stage DeepSpeed training (``tools/train/deepspeed_gpt.py``) for N
steps, alternately alone (no FreeRide at all) and under ``freeride launch`` with
one iterative side task per stage, each pinned to its stage's device (on CPU: the
stage's core, shared with the side task as a GPU would be). Before that, the job
is profiled with ``freeride profile`` and the manager started with the profile::

    python tools/bench/deepspeed_overhead.py --pairs 4 --steps 40 -- --hidden 256 --seq 64

Reports, as markdown: the training slowdown (ratio of median step times, with
over alone), the share of bubble time the side tasks spent in steps (from the
manager's status), their throughput, grant latency and overruns.
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

from freeride import protocol as p
from freeride.profile import Profile, load_profile
from freeride.transport import ControlClient, Endpoints, ManagerUnreachable
from freeride.units import parse_duration_ns

__all__ = ["BenchArgs", "RunResult", "main"]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "train" / "deepspeed_gpt.py"
SKIP_STEPS = 3
"""Leading steps of every run left out of its median."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchArgs:
    pairs: int
    """Alone/with run pairs, interleaved."""
    steps: int
    """Training steps per run."""
    task: str
    """Side task, ``module:Class``."""
    task_opts: tuple[str, ...]
    step_time: str
    """The side task's expected step time, until measured."""
    train_args: tuple[str, ...]
    """Extra arguments for the training script."""
    keep: bool
    """Keep the runtime directory (logs, profile) for inspection."""
    hooked: bool
    """Also run, in every round, the job under FreeRide's hooks with no manager listening
    (what the adapter alone costs)."""

    def __post_init__(self) -> None:
        if self.pairs < 1:
            raise ValueError(f"pairs must be >= 1, got {self.pairs}")
        if self.steps <= SKIP_STEPS:
            raise ValueError(f"steps must be > {SKIP_STEPS}, got {self.steps}")
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


def _train_cmd(args: BenchArgs, steps: int) -> list[str]:
    return [sys.executable, str(SCRIPT), "--spawn", "2", "--steps", str(steps), *args.train_args]


def _median_step_ms(stdout: str) -> float:
    times: list[float] = [
        float(json.loads(line)["step_ms"])
        for line in stdout.splitlines()
        if line.startswith("{") and '"step_ms"' in line and '"rank": 0,' in line
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


def _status(endpoints: Endpoints) -> p.StatusReply:
    with ControlClient(endpoints.control, timeout_s=10) as client:
        reply = client.request(p.StatusRequest())
    if not isinstance(reply, p.StatusReply):
        raise RuntimeError(f"unexpected status reply {reply!r}")
    return reply


def _wait_for(what: str, timeout_s: float, check: object) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if callable(check) and check():
                return
        except ManagerUnreachable:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _with_run(args: BenchArgs, runtime: Path, endpoints: Endpoints) -> RunResult:
    before = _status(endpoints)
    stdout, wall = _run(
        _freeride("launch", "--runtime-dir", str(runtime), "--", *_train_cmd(args, args.steps)), _plain_env()
    )
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


def _report(args: BenchArgs, profile: Profile, runs: list[RunResult], final: p.StatusReply, command: str) -> str:
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
        "## DeepSpeed: training with side tasks in its bubbles",
        "",
        f"Command: `{command}`",
        "",
        f"Training: `{shlex.join(['python', str(SCRIPT.relative_to(ROOT)), *_train_cmd(args, args.steps)[2:]])}`; "
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


def bench(args: BenchArgs, command: str) -> str:
    runtime = Path(tempfile.mkdtemp(prefix="frbench-", dir="/tmp"))
    endpoints = Endpoints.ipc(runtime)
    serve: subprocess.Popen[bytes] | None = None
    try:
        profile_path = runtime / "profile.json"
        _run(
            _freeride("profile", "--runtime-dir", str(runtime), "--out", str(profile_path), "--", *_train_cmd(args, 8)),
            _plain_env(),
        )
        profile = load_profile(profile_path)
        serve = subprocess.Popen(
            _freeride("serve", "--runtime-dir", str(runtime), "--profile", str(profile_path)),
            env=_plain_env(),
            stdout=subprocess.DEVNULL,
            stderr=open(runtime / "serve.log", "wb"),  # noqa: SIM115 - lives as long as the manager
            start_new_session=True,
        )
        _wait_for("the manager", 60, lambda: bool(_status(endpoints)))
        for device in profile.devices:
            opts = [x for opt in args.task_opts for x in ("--opt", opt)]
            _run(
                _freeride(
                    "submit",
                    "--runtime-dir",
                    str(runtime),
                    args.task,
                    *opts,
                    "--step-time",
                    args.step_time,
                    "--device",
                    device,
                ),
                _plain_env(),
            )
        _wait_for(
            "side tasks to start",
            120,
            lambda: sum(t.state == "running" for t in _status(endpoints).tasks) == len(profile.devices),
        )
        runs: list[RunResult] = []
        nobody = runtime / "nobody"  # no manager there: the adapter's emits all drop
        for i in range(args.pairs):
            stdout, wall = _run(_train_cmd(args, args.steps), _plain_env())
            runs.append(RunResult("alone", _median_step_ms(stdout), wall))
            if args.hooked:
                cmd = _freeride("launch", "--runtime-dir", str(nobody), "--", *_train_cmd(args, args.steps))
                stdout, wall = _run(cmd, _plain_env())
                runs.append(RunResult("hooked", _median_step_ms(stdout), wall))
            runs.append(_with_run(args, runtime, endpoints))
            print(
                f"round {i}: "
                + ", ".join(f"{r.kind} {r.median_step_ms:.2f} ms" for r in runs[-(3 if args.hooked else 2) :]),
                file=sys.stderr,
            )
        return _report(args, profile, runs, _status(endpoints), command)
    finally:
        if serve is not None and serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
        if args.keep:
            print(f"runtime dir kept: {runtime}", file=sys.stderr)
        else:
            shutil.rmtree(runtime, ignore_errors=True)


def parse_args(argv: list[str]) -> BenchArgs:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--task", default="freeride.sidetasks.graph_sgd:GraphSGD")
    ap.add_argument("--opt", action="append", default=None, help="side-task option KEY=VALUE (repeatable)")
    ap.add_argument("--step-time", default="2ms")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--hooked", action="store_true", help="also time the hooks with no manager listening")
    ap.add_argument("train_args", nargs="*", help="after --: arguments for tools/train/deepspeed_gpt.py")
    ns = ap.parse_args(argv)
    opts = ns.opt if ns.opt is not None else ["batch_edges=2048"]
    try:
        return BenchArgs(
            pairs=ns.pairs,
            steps=ns.steps,
            task=ns.task,
            task_opts=tuple(opts),
            step_time=ns.step_time,
            train_args=tuple(ns.train_args),
            keep=ns.keep,
            hooked=ns.hooked,
        )
    except ValueError as exc:
        ap.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join(["python", "tools/bench/deepspeed_overhead.py", *argv])
    print(bench(args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
