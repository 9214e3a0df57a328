"""The bubble atlas: per backend, schedule, p and m, the bubble share in theory, measured, and used by side tasks.

For every case of :data:`CASES` (plain data: one line per case), on the CPU
stand-in (one pinned core per stage; sleeping layers stand in for kernels):

1. **theory**: the idle share of the schedule replayed by
   :func:`freeride.backends.schedule.simulate` with uniform stages and backward = 2 x
   forward (``-`` where ``freeride.backends.schedule`` does not model the schedule);
2. **measured**: ``freeride profile --steps N --picture ...`` on the unmodified
   training script, the mean over stages of the profiled bubble share;
3. **used**: ``freeride serve --profile`` with one graph-SGD side task pinned to
   each stage's device, ``freeride launch`` of the same job, and the share of
   the bubble time offered to them (neither held back for the cost meter nor
   backed off by the slowdown budget) the side tasks computed in (``freeride
   status``, "used").

It writes a markdown table and one picture per case (one step, per stage)::

    python tools/atlas.py --out docs/atlas --table docs/atlas/table.md
    python tools/atlas.py --only sim --no-used          # a subset, theory and measured only

A new schedule is one more :class:`Case` line (its backend's script must take
``--schedule NAME``); a new backend is one more entry of :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from freeride import protocol as p
from freeride.backends.schedule import SCHEDULE_NAMES, Durations, bubble_fraction, build_schedule, simulate
from freeride.observe.picture import render_profile
from freeride.profile import Profile, load_profile
from freeride.transport import ControlClient, Endpoints

__all__ = ["CASES", "COMMANDS", "Case", "Row", "main", "run_case", "table", "theory"]

ROOT = Path(__file__).resolve().parents[1]

FORWARD_MS, BACKWARD_MS = 10.0, 20.0
"""Per micro-batch and stage (and chunk: interleaved stages split it)."""
LAYERS = 8
"""Sleeping blocks of the framework scripts' model, split over the virtual stages."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One row of the atlas."""

    backend: str
    """A key of :data:`COMMANDS`."""
    schedule: str
    """The name the backend's script takes (``--schedule``)."""
    p: int
    """Pipeline stages (ranks)."""
    m: int
    """Micro-batches per step."""
    v: int = 1
    """Model chunks per rank (interleaved schedules)."""
    model: str = ""
    """The name in ``freeride.backends.schedule`` the theory comes from (default: ``schedule``, if it knows it)."""

    @property
    def ident(self) -> str:
        chunks = f"-v{self.v}" if self.v > 1 else ""
        return f"{self.backend}-{self.schedule}-p{self.p}-m{self.m}{chunks}"


def _sim(case: Case, steps: int, runtime_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "freeride.cli", "sim", "--runtime-dir", str(runtime_dir),
        "--schedule", case.schedule, "--stages", str(case.p), "--microbatches", str(case.m),
        "--chunks", str(case.v), "--forward", f"{FORWARD_MS / case.v}ms", "--backward", f"{BACKWARD_MS / case.v}ms",
        "--steps", str(steps),
    ]  # fmt: skip


def _script(name: str, *, schedule_flag: bool) -> Callable[[Case, int, Path], list[str]]:
    def command(case: Case, steps: int, runtime_dir: Path) -> list[str]:
        blocks = LAYERS // (case.p * case.v)  # sleeping blocks per virtual stage
        cmd = [
            sys.executable, str(ROOT / "tools" / "train" / name), "--spawn", str(case.p),
            "--micro-batches", str(case.m), "--layers", str(LAYERS), "--steps", str(steps), "--compute", "sleep",
            "--sleep-forward-ms", f"{FORWARD_MS / case.v / blocks:g}",
            "--sleep-backward-ms", f"{BACKWARD_MS / case.v / blocks:g}",
        ]  # fmt: skip
        if schedule_flag:
            cmd += ["--schedule", case.schedule]
            if case.v > 1 and case.schedule == "interleaved":
                cmd += ["--vpp", str(case.v)]
        else:
            cmd += ["--stages", str(case.p)]
            if case.schedule != "1f1b":
                cmd += ["--schedule", case.schedule]
        return cmd

    return command


COMMANDS: dict[str, Callable[[Case, int, Path], list[str]]] = {
    "sim": _sim,
    "deepspeed": _script("deepspeed_gpt.py", schedule_flag=False),
    "megatron": _script("megatron_gpt.py", schedule_flag=True),
    "torchpipe": _script("torchpipe_gpt.py", schedule_flag=True),
}
"""Backend -> the training command of a case (given its steps and the manager's runtime dir)."""

CASES: list[Case] = [
    *(Case(backend="sim", schedule="1f1b", p=p, m=m) for p in (2, 4) for m in (4, 8)),
    *(Case(backend="sim", schedule="interleaved", p=p, m=m, v=2) for p in (2, 4) for m in (4, 8)),
    *(Case(backend="deepspeed", schedule="1f1b", p=p, m=m) for p in (2, 4) for m in (4, 8)),
    *(Case(backend="megatron", schedule="1f1b", p=p, m=m) for p in (2, 4) for m in (4, 8)),
    *(Case(backend="megatron", schedule="interleaved", p=p, m=m, v=2) for p in (2, 4) for m in (4, 8)),
    *(Case(backend="torchpipe", schedule="1f1b", p=p, m=m) for p in (2, 4) for m in (4, 8)),
    *(Case(backend="torchpipe", schedule="gpipe", p=p, m=m) for p in (2, 4) for m in (4, 8)),
    *(Case(backend="torchpipe", schedule="interleaved", p=p, m=m, v=2) for p in (2, 4) for m in (4, 8)),
    *(Case(backend="torchpipe", schedule="zbv", p=p, m=m, v=2, model="-") for p in (2, 4) for m in (4, 8)),
    *(Case(backend="torchpipe", schedule="interleaved-zb", p=2, m=m, v=2, model="-") for m in (4, 8)),
    *(Case(backend="torchpipe", schedule="looped-bfs", p=2, m=m, v=2, model="-") for m in (4, 8)),
    *(Case(backend="torchpipe", schedule="dualpipev", p=2, m=m, v=2, model="-") for m in (4, 8)),
    *(Case(backend="deepspeed", schedule="dualpipev", p=2, m=m, v=2, model="-") for m in (4, 8)),
]
"""The atlas' rows. ZBV has no model in freeride.backends.schedule (V placement, W passes): its theory is left out."""


def theory(case: Case) -> float | None:
    """The schedule's idle share with uniform stages and backward = 2 x forward (None: not modeled)."""
    name = case.model or case.schedule
    if name not in SCHEDULE_NAMES:
        return None
    schedule = build_schedule(name, case.p, case.m, case.v if name == "interleaved" else 1)
    return bubble_fraction(simulate(schedule, Durations.uniform(case.p, FORWARD_MS / case.v, BACKWARD_MS / case.v)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    case: Case
    theory: float | None
    measured: float | None = None
    used: float | None = None
    step_ms: float | None = None
    picture: str = ""
    note: str = ""
    """Why a figure is missing; empty when every figure was measured."""
    skipped: bool = False
    """Not run by design on this machine (too few cores): a note, not a failure."""


def _freeride(*args: str) -> list[str]:
    return [sys.executable, "-m", "freeride.cli", *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return env


def _run(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_env(), cwd=ROOT)


def _measured(profile: Profile) -> tuple[float, float]:
    shares = [s.bubble_fraction for s in profile.stages]
    steps = [s.step_time_ns for s in profile.stages]
    return sum(shares) / len(shares), max(steps) / 1e6


def _status(runtime_dir: Path) -> p.StatusReply:
    with ControlClient(Endpoints.ipc(runtime_dir).control, timeout_s=10) as client:
        reply = client.request(p.StatusRequest())
    if not isinstance(reply, p.StatusReply):
        raise RuntimeError(f"unexpected status reply {reply!r}")
    return reply


def _used(case: Case, profile_path: Path, devices: list[str], runtime_dir: Path, steps: int, timeout_s: float) -> float:
    """Serve with one graph-SGD task per device, launch the job, return used / announced bubble time."""
    serve = subprocess.Popen(
        _freeride("serve", "--runtime-dir", str(runtime_dir), "--profile", str(profile_path)),
        env=_env(), cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (runtime_dir / "control").exists():
            if time.monotonic() > deadline or serve.poll() is not None:
                raise RuntimeError("freeride serve did not start")
            time.sleep(0.1)
        for device in devices:
            submit = _freeride("submit", "--runtime-dir", str(runtime_dir), "--device", device, "--wait", "30")
            done = _run([*submit, "graph-sgd", "--opt", "eval_every=25"], 120)
            if done.returncode != 0:
                raise RuntimeError(f"submit on {device}: {done.stderr.strip()[-300:]}")
        command = COMMANDS[case.backend](case, steps, runtime_dir)
        done = _run(_freeride("launch", "--runtime-dir", str(runtime_dir), "--", *command), timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"launch exited with {done.returncode}: {done.stderr.strip()[-300:]}")
        reply = _status(runtime_dir)
        offered = sum(d.offered_ns for d in reply.devices)  # neither held back for the cost meter nor backed off
        return sum(d.used_ns for d in reply.devices) / offered if offered else 0.0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def run_case(case: Case, *, out: Path, steps: int, used_steps: int, with_used: bool, timeout_s: float) -> Row:
    """Profile ``case`` (and, ``with_used``, run it with side tasks); failures become the row's note."""
    row = Row(case=case, theory=theory(case))
    cores = len(os.sched_getaffinity(0))
    if case.p > cores:  # two stages on one core would be one device: neither their bubbles nor side tasks part
        note = f"needs {case.p} cores (one per stage), this machine has {cores}"
        return dataclasses.replace(row, note=note, skipped=True)
    tmp = Path(tempfile.mkdtemp(prefix="fratl-", dir="/tmp"))  # short: ipc paths
    try:
        profile_path = tmp / "job.json"
        picture = out / f"{case.ident}.png"
        command = COMMANDS[case.backend](case, 10 * steps, tmp)
        cmd = _freeride("profile", "--runtime-dir", str(tmp), "--out", str(profile_path), "--steps", str(steps))
        done = _run([*cmd, "--", *command], timeout_s)
        if done.returncode != 0 or not profile_path.exists():
            return Row(case=case, theory=row.theory, note=f"profile failed ({done.returncode}): {_last(done.stderr)}")
        profile = load_profile(profile_path)
        measured, step_ms = _measured(profile)
        render_profile(profile, picture)  # the default resolution: 1680 x 360, labels readable
        row = Row(case=case, theory=row.theory, measured=measured, step_ms=step_ms, picture=picture.name)
        if with_used:
            try:
                used = _used(case, profile_path, profile.devices, tmp, used_steps, timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                return dataclasses.replace(row, note=f"used: {_last(str(exc))}")
            row = dataclasses.replace(row, used=used)
        return row
    except subprocess.TimeoutExpired:
        return Row(case=case, theory=row.theory, note=f"timed out after {timeout_s:.0f}s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "no output")[-200:].replace("|", "/")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def table(rows: list[Row], *, pictures: str) -> str:
    """The markdown table of ``rows``; pictures linked relative to ``pictures``."""
    lines = [
        "| backend | schedule | p | m | v | theory | measured | used by side tasks | step | picture | note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        c = r.case
        step = "-" if r.step_ms is None else f"{r.step_ms:.0f} ms"
        pic = f"[step]({pictures}/{r.picture})" if r.picture else "-"
        lines.append(
            f"| {c.backend} | {c.schedule} | {c.p} | {c.m} | {c.v} | {_pct(r.theory)} | {_pct(r.measured)}"
            f" | {_pct(r.used)} | {step} | {pic} | {r.note} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "atlas", help="where the pictures go")
    parser.add_argument("--table", type=Path, help="write the markdown table here (default: stdout only)")
    parser.add_argument("--only", action="append", default=[], help="cases whose id contains this (repeatable)")
    parser.add_argument("--steps", type=int, default=8, help="profiled steps per rank (default 8)")
    parser.add_argument("--used-steps", type=int, default=30, help="steps of the run with side tasks (default 30)")
    parser.add_argument("--no-used", action="store_true", help="skip the runs with side tasks")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run (default 240)")
    parser.add_argument("--list", action="store_true", help="list the cases and their theory, run nothing")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.used_steps < 2:
        parser.error("--steps and --used-steps must be >= 2")
    cases = [c for c in CASES if not args.only or any(o in c.ident for o in args.only)]
    if not cases:
        parser.error(f"no case matches {args.only}; see --list")
    if args.list:
        sys.stdout.write(table([Row(case=c, theory=theory(c)) for c in cases], pictures=args.out.name))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in cases:
        started = time.monotonic()
        row = run_case(
            case, out=args.out, steps=args.steps, used_steps=args.used_steps, with_used=not args.no_used,
            timeout_s=args.timeout,
        )  # fmt: skip
        rows.append(row)
        print(
            f"atlas: {case.ident}: theory {_pct(row.theory)}, measured {_pct(row.measured)}, used {_pct(row.used)}"
            f" ({time.monotonic() - started:.0f}s) {row.note}",
            file=sys.stderr,
            flush=True,
        )
    text = table(rows, pictures=args.out.name)
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(text)
    sys.stdout.write(text)
    return 0 if all(r.skipped or not r.note for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
