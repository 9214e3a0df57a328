"""The one-command GPU check: everything FreeRide does on a GPU, measured, in one markdown report.

Run through ``tools/gpu/check.sh`` (which installs the wheels ``wheelhouse.sh``
fetched and bounds the run to 10 minutes). Sections:

a. A real pipeline stage on the GPU with emulated neighbours (``stage.py``),
   alone and with each sample workload in its bubbles, in interleaved pairs:
   slowdown with a distribution-free 95 % interval, bubble use, device-timeline
   accuracy (when the host learnt the device reached a bubble; announced vs
   measured by events) and interference (the stage's own forward and backward
   time by CUDA events, with vs alone).
b. MPS: FreeRide's own daemon, a side task over its memory cap fails alone while
   training goes on; the SM cap as the capped client sees it.
c. The tail of an imperative CUDA program after SIGSTOP, with and without
   ``sync_every`` (``tools/bench/gpu_tail.py``).
d. NVML's readings against torch's view of memory.
e. With two GPUs: the real DeepSpeed and Megatron pipelines (``--two-gpu``).
f. Side work released by the device (``gate_bench.py``): the lag from a
   bubble's start to the first side kernel and the delay of the trainer's first
   kernel after it, side work in the trainer's process, in a second one, and
   in a second one under MPS.

``--dry-run`` runs the same path on CPU (one pinned core plays the GPU; MPS,
the tail and NVML are reported as not available), fast enough for CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "bench"))  # the benchmark harness lives there

from _pipeline_bench import BenchOptions, Job, ManagerFailed, bench, side_task  # noqa: E402

if TYPE_CHECKING:
    from freeride.gpu.mps import MpsDaemon

__all__ = ["CheckConfig", "main"]

STAGE = Path(__file__).resolve().parent / "stage.py"
GATE_BENCH = Path(__file__).resolve().parent / "gate_bench.py"
GPU_WORKLOADS = ("resnet18-train", "pagerank", "graph-sgd", "imaging", "resnet18-infer")
"""In the order they run: the ones the time budget leaves out come last."""
GPU_STAGE = ("--device", "cuda", "--width", "4096", "--depth", "8", "--batch", "1024")
"""About 5 ms per forward in FP32 on an H100: bubbles of several ms, as in real stages."""
DRY_WORKLOADS = ("graph-sgd",)

_ALLOC = """
import os, sys, torch
device, mib = sys.argv[1], int(sys.argv[2])
fraction = os.environ.get("FREERIDE_TORCH_MEMORY_FRACTION")
if fraction and device == "cuda":  # as a worker applies it (freeride/worker/main.py)
    torch.cuda.set_per_process_memory_fraction(float(fraction), 0)
try:
    x = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    x.fill_(1)
    if device == "cuda":
        torch.cuda.synchronize()
    print("ok")
except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as exc:
    print("oom", type(exc).__name__)
"""
_SMS = """
import torch
print(torch.cuda.get_device_properties(0).multi_processor_count)
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckConfig:
    """What the check runs."""

    dry_run: bool
    """On CPU: the same path, short, with what needs a GPU reported as not available."""
    out: Path
    """Where the markdown report goes."""
    workloads: tuple[str, ...]
    pairs: int
    steps: int
    budget_s: float
    """Sections of (a) that would start after this many seconds are skipped."""
    two_gpu: bool
    stage_args: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.pairs < 1 or self.steps < 5 or self.budget_s <= 0:
            raise ValueError("pairs must be >= 1, steps >= 5 and budget_s > 0")


@dataclass(slots=True)
class Report:
    started: float = field(default_factory=time.monotonic)
    sections: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    mps_missing: str | None = None
    """Why MPS cannot run here ("" where it runs), once a section found out; None until then."""

    def run(self, title: str, fn: Callable[[], str]) -> None:
        """Run one section; a failure is written into the report and the check goes on."""
        t0 = time.monotonic()
        print(f"[check] {title} ...", file=sys.stderr, flush=True)
        try:
            body = fn()
        except Exception as exc:
            self.failures.append(title)
            body = f"**FAILED**: {type(exc).__name__}: {exc}\n\n```\n{traceback.format_exc()[-3000:]}\n```"
        self.sections.append(f"## {title}\n\n{body}\n\n_{time.monotonic() - t0:.0f} s_\n")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _run(cmd: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 300) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


# ----------------------------------------------------------------------- (a)


def _stats(directory: Path) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    alone: list[dict[str, object]] = []
    launched: list[dict[str, object]] = []
    for path in sorted(directory.glob("stage-*.json")):
        record = json.loads(path.read_text())
        (launched if record.get("launched") else alone).append(record)
    return alone, launched


def _median(records: list[dict[str, object]], key: str) -> float:
    values = [float(v) for r in records if isinstance(v := r.get(key), int | float)]
    return statistics.median(values) if values else float("nan")


def _acc(records: list[dict[str, object]], key: str) -> float:
    values = []
    for r in records:
        acc = r.get("accuracy")
        if isinstance(acc, dict) and isinstance(v := acc.get(key), int | float) and v == v:
            values.append(float(v))
    return statistics.median(values) if values else float("nan")


def section_pipeline(config: CheckConfig, report: Report) -> str:
    options = BenchOptions(pairs=config.pairs, controls=0, steps=config.steps)
    mps_missing = _mps_missing(config, report)
    serve_args: tuple[str, ...] = () if config.dry_run or mps_missing else ("--mps",)
    parts, rows = [], []
    if mps_missing:
        parts.append(f"`freeride serve` without `--mps`: MPS is not available here ({mps_missing})")
    for name in config.workloads:
        if time.monotonic() - report.started > config.budget_s:
            parts.append(f"{name}: skipped (time budget of {config.budget_s:.0f} s spent)")
            continue
        stats = Path(tempfile.mkdtemp(prefix="frcheck-stats-"))
        job = Job(
            title=f"### {name} in the bubbles of an emulated-neighbour stage",
            script=STAGE,
            args=(*config.stage_args, "--stats-out", str(stats)),
            profiles_itself=True,
        )
        task = side_task(name, (), "2ms")
        try:
            parts.append(bench(job, task, options, command="tools/gpu/check.sh", serve_args=serve_args))
        except ManagerFailed as exc:
            if not serve_args:
                raise
            # the manager could not run with MPS: say why, and measure the bubbles without it
            report.failures.append(f"a. freeride serve --mps ({name})")
            parts.append(f"**`freeride serve --mps` FAILED**, the runs below are without MPS:\n\n```\n{exc}\n```")
            serve_args = ()
            for path in stats.glob("stage-*.json"):  # the failed attempt profiled too: from here as a first attempt
                path.unlink()
            parts.append(bench(job, task, options, command="tools/gpu/check.sh"))
        alone, launched = _stats(stats)
        shutil.rmtree(stats, ignore_errors=True)
        f_alone, f_with = _median(alone, "forward_ms"), _median(launched, "forward_ms")
        b_alone, b_with = _median(alone, "backward_ms"), _median(launched, "backward_ms")
        timing = str(launched[0]["timing"]) if launched else "?"
        rows.append(
            f"| {name} | {timing} | {_acc(launched, 'announced'):.0f} | {_acc(launched, 'lag_p50_ms'):.3f} / "
            f"{_acc(launched, 'lag_p99_ms'):.3f} | {_acc(launched, 'abs_error_p50_ms'):.3f} | "
            f"{f_alone:.3f} -> {f_with:.3f} | {b_alone:.3f} -> {b_with:.3f} |"
        )
    table = [
        "Per run with side tasks (medians over runs): bubbles announced; lag from the device reaching a bubble to "
        "the host announcing it; |expected - measured| duration; the stage's own forward and backward pass "
        "(CUDA events on a GPU), alone -> with side tasks: their growth is interference.",
        "",
        "| workload | timing | announced | lag p50 / p99 (ms) | abs error p50 (ms) | forward (ms) | backward (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    return "\n".join(table) + "\n\n" + "\n\n".join(parts)


# ----------------------------------------------------------------------- (b)


def section_mps(config: CheckConfig, report: Report) -> str:
    import resource

    from freeride.gpu.memcap import plan_memory_cap
    from freeride.gpu.smshare import plan_sm_share

    device = "cpu:0" if config.dry_run else "cuda:0"
    kind = "cpu" if config.dry_run else "cuda"
    lines: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="frmps-"))
    daemon = None
    pipe_dir: Path | None = None
    if not config.dry_run:
        daemon, report.mps_missing = _start_mps(tmp)
        if daemon is None:  # a machine without MPS: the fallback cap is what side tasks get there
            lines.append(f"- **MPS not available here**: {report.mps_missing}; the fallback cap is checked instead")
        else:
            pipe_dir = daemon.pipe_dir
            report.mps_missing = "an MPS client's allocations did not finish"  # until they do
            lines.append(f"- MPS daemon started with a private pipe directory ({pipe_dir})")
    try:
        cap = 1 << 30  # well above a CUDA context's own allocations, which the MPS limit counts
        total = -1
        if not config.dry_run and pipe_dir is None:
            import torch

            total = torch.cuda.get_device_properties(0).total_memory
        plan = plan_memory_cap(device, cap, mps_pipe_dir=pipe_dir, total_bytes=total)
        lines.append(f"- memory cap {cap >> 20} MiB by `{plan.mechanism}`")
        env = {**os.environ, **plan.env}

        def limited() -> None:  # RLIMIT_AS on CPU, as the manager applies it
            if plan.rlimit_as > 0:
                resource.setrlimit(resource.RLIMIT_AS, (plan.rlimit_as, plan.rlimit_as))

        trainer = subprocess.Popen(
            [sys.executable, str(STAGE), "--steps", "20", *config.stage_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        over = subprocess.run(
            [sys.executable, "-c", _ALLOC, kind, str(4 * (cap >> 20))],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=limited,
        )
        under = subprocess.run(
            [sys.executable, "-c", _ALLOC, kind, str((cap >> 20) // 16)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=limited,
        )
        out, _ = trainer.communicate(timeout=300)
        steps = sum(1 for line in out.splitlines() if line.startswith("{"))
        over_ok = over.stdout.startswith("oom")
        under_ok = under.stdout.startswith("ok")
        if pipe_dir is not None:  # section (a) runs its side tasks under MPS only where a client could work
            report.mps_missing = "" if under_ok else f"an MPS client could not allocate {(cap >> 20) // 16} MiB"
        train_ok = trainer.returncode == 0 and steps == 20
        lines += [
            f"- over-cap allocation ({4 * (cap >> 20)} MiB): `{over.stdout.strip() or over.stderr.strip()[-200:]}`"
            f" -> {'fails alone' if over_ok else 'DID NOT FAIL'}",
            f"- under-cap allocation ({(cap >> 20) // 16} MiB): `{under.stdout.strip()}`",
            f"- training beside it: exit {trainer.returncode}, {steps}/20 steps -> {'goes on' if train_ok else 'HURT'}",
        ]
        share, sm_env = plan_sm_share("cuda:0", 25, mps_pipe_dir=pipe_dir or tmp / "pipe")
        if not config.dry_run and pipe_dir is None:
            lines.append("- SM cap: not measurable without MPS (side tasks run on a lowest-priority stream only)")
        elif config.dry_run:
            lines.append(f"- SM cap: env for a 25 % share would be `{sm_env}` (not measurable without a GPU)")
        else:
            full = _run([sys.executable, "-c", _SMS]).strip()
            capped = _run([sys.executable, "-c", _SMS], env={**os.environ, **sm_env}).strip()
            lines.append(f"- SM cap {share} %: the client sees {capped} SMs (the device has {full})")
        if not (over_ok and under_ok and train_ok):
            raise RuntimeError("memory cap check failed:\n" + "\n".join(lines))
        return "\n".join(lines)
    finally:
        if daemon is not None:
            import asyncio

            asyncio.run(daemon.quit())
        shutil.rmtree(tmp, ignore_errors=True)


def _start_mps(tmp: Path) -> tuple[MpsDaemon | None, str]:
    """FreeRide's MPS daemon on a private pipe directory under ``tmp``; None and why, where it cannot start."""
    import asyncio

    from freeride.gpu.mps import MpsDaemon, MpsError

    daemon = MpsDaemon(tmp / "pipe", tmp / "log")
    try:
        asyncio.run(daemon.start())
    except MpsError as exc:
        return None, str(exc).splitlines()[0][:300] or type(exc).__name__
    return daemon, ""


def _mps_missing(config: CheckConfig, report: Report) -> str:
    """Why MPS cannot run here ("" when it can), from section (b) or a start of the daemon now."""
    if config.dry_run:
        return ""
    if report.mps_missing is None:
        import asyncio

        tmp = Path(tempfile.mkdtemp(prefix="frmps-"))
        daemon, report.mps_missing = _start_mps(tmp)
        if daemon is not None:
            asyncio.run(daemon.quit())
        shutil.rmtree(tmp, ignore_errors=True)
    return report.mps_missing


# ------------------------------------------------------------------ (c), (d)


def section_tail(config: CheckConfig) -> str:
    if config.dry_run:
        return "Not available without CUDA (the tail is work queued on the GPU); run on a GPU."
    tail = ROOT / "tools/bench/gpu_tail.py"
    out = _run([sys.executable, str(tail), "--ks", "0", "1", "4", "--reps", "5", "--warmup-s", "40"], timeout_s=150)
    return f"```\n{out.strip()}\n```"


def section_nvml(config: CheckConfig) -> str:
    from freeride.gpu.nvml import NvmlMonitor

    monitor = NvmlMonitor.open()
    if monitor is None:
        if config.dry_run:
            return "No NVML on this machine (expected without a GPU): the monitor reports nothing and never raises."
        raise RuntimeError("NVML could not be opened on a GPU machine")
    import torch

    try:
        x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        dev = monitor.devices()[0]
        mine = monitor.process_memory(0).get(os.getpid(), -1)
        reserved = torch.cuda.memory_reserved()
        del x
        return "\n".join(
            [
                f"- total: NVML {dev.total >> 20} MiB, torch {total >> 20} MiB",
                f"- free: NVML {dev.free >> 20} MiB, torch {free >> 20} MiB",
                f"- this process: NVML {mine >> 20 if mine >= 0 else '?'} MiB, torch reserved {reserved >> 20} MiB "
                "(NVML adds the CUDA context)",
            ]
        )
    finally:
        monitor.close()


def section_two_gpu(config: CheckConfig) -> str:
    import torch

    if torch.cuda.device_count() < 2:
        return "Skipped: fewer than two GPUs."
    outputs = []
    for script in ("deepspeed_overhead.py", "megatron_overhead.py"):
        cmd = [sys.executable, str(ROOT / "tools/bench" / script), "--pairs", "3", "--controls", "1", "--steps", "15"]
        cmd += ["--", "--device", "cuda", "--hidden", "1024", "--layers", "8", "--seq", "256"]
        outputs.append(_run(cmd, timeout_s=280))
    return "\n\n".join(outputs)


# ----------------------------------------------------------------------- (f)


def _gate_row(label: str, r: dict[str, object]) -> str:
    def num(key: str, sub: str = "") -> float:
        value = r.get(key)
        if sub:
            value = value.get(sub) if isinstance(value, dict) else None
        return float(value) if isinstance(value, int | float) else float("nan")

    return (
        f"| {label} | {num('start_lag_us', 'p50'):.1f} / {num('start_lag_us', 'p99'):.1f} | "
        f"{num('first_kernel_us', 'delay_p50'):.1f} / {num('first_kernel_us', 'delay_p99'):.1f} | "
        f"{100 * num('bubble_use'):.1f} % | {100 * num('overrun_of_bubble_time'):.2f} % | "
        f"{num('piece_us'):.0f} | {num('clock_error_us'):.1f} |"
    )


def section_gate(config: CheckConfig, report: Report) -> str:
    if config.dry_run:
        return (
            "Not available without CUDA (stream memory operations on a device); "
            "`tests/unit/test_bubble_gate.py` covers the protocol on CPU."
        )
    import torch

    from freeride.gpu.bubblegate import cuda_stream_ops, probe

    torch.zeros(1, device="cuda")
    why = probe(cuda_stream_ops(), torch.cuda.current_stream(), Path(tempfile.gettempdir()))
    if why:
        raise RuntimeError(f"the bubble gate cannot be used on this GPU: {why}")
    rows, raw = [], []
    runs: list[tuple[str, list[str], dict[str, str]]] = [
        ("side stream, same process", ["--side", "stream"], dict(os.environ)),
        ("side process, no MPS", ["--side", "process"], dict(os.environ)),
    ]
    tmp = Path(tempfile.mkdtemp(prefix="frgate-mps-"))
    daemon = None
    if not _mps_missing(config, report):
        daemon, _ = _start_mps(tmp)
    try:
        if daemon is not None:
            env = {**os.environ, **daemon.client_env(0, 8 << 30)}
            runs.append(("side process, MPS client", ["--side", "process"], env))
        for label, args, env in runs:
            out = _run([sys.executable, str(GATE_BENCH), *args], env=env, timeout_s=120)
            result = json.loads(out.strip().splitlines()[-1])
            rows.append(_gate_row(label, result))
            raw.append(json.dumps(result))
    finally:
        if daemon is not None:
            import asyncio

            asyncio.run(daemon.quit())
        shutil.rmtree(tmp, ignore_errors=True)
    table = [
        "Gate opened and closed by the training stream; side pieces queued ahead behind it "
        "(`python tools/gpu/gate_bench.py --side stream|process`). Start lag: bubble start to the first side "
        "piece on the device; trainer delay: its first kernel after the bubble, with side work minus without "
        "(p50 / p99 of each, us); use and overrun: side time inside / outside bubbles over bubble time; clock "
        "error: bound on the two processes' calibration (0: one context).",
        "",
        "| side work | start lag p50 / p99 (us) | trainer delay p50 / p99 (us) | bubble use | overrun | piece (us) "
        "| clock error (us) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    return "\n".join(table) + "\n\n```\n" + "\n".join(raw) + "\n```"


# ---------------------------------------------------------------------- main


def run_check(config: CheckConfig) -> int:
    report = Report()
    env = "CPU (dry run)" if config.dry_run else "GPU"
    if not config.dry_run and not _cuda():
        print("check: no CUDA device here; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    header = [
        f"# FreeRide GPU check ({env})",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; host: {os.uname().nodename}; python {sys.version.split()[0]}",
        f"- {_device_line()}",
        f"- stage: `python tools/gpu/stage.py {' '.join(config.stage_args)}`; {config.pairs} pairs x "
        f"{config.steps} steps per workload",
    ]
    if config.dry_run:
        header.append("- **dry run**: the figures are CPU figures; a GPU's are in docs/gpu-results.md")

    def write(verdict: str) -> None:  # after every section: a run cut short still leaves its report
        text = "\n".join([*header, f"- result: {verdict}; {time.monotonic() - report.started:.0f} s", ""])
        config.out.parent.mkdir(parents=True, exist_ok=True)
        config.out.write_text(text + "\n" + "\n".join(report.sections))

    # the short sections first; the pipeline runs take what is left of the budget; the tail last, as its
    # program's start-up on a fresh machine is the one part that has taken minutes
    sections: list[tuple[str, Callable[[], str]]] = [
        ("b. MPS memory cap and SM cap", lambda: section_mps(config, report)),
        ("d. NVML against torch", lambda: section_nvml(config)),
        ("f. Side work released by the device (bubble gate)", lambda: section_gate(config, report)),
        ("a. Pipeline stage with side tasks in its bubbles", lambda: section_pipeline(config, report)),
        ("c. Tail after SIGSTOP (sync_every)", lambda: section_tail(config)),
    ]
    if config.two_gpu:
        sections.append(("e. Two GPUs: DeepSpeed and Megatron pipelines", lambda: section_two_gpu(config)))
    for title, fn in sections:
        report.run(title, fn)
        write(f"running ({len(report.sections)} of {len(sections)} sections done)")
    verdict = "all sections ran" if not report.failures else f"FAILED: {', '.join(report.failures)}"
    write(verdict)
    print(f"[check] report: {config.out} ({verdict})", file=sys.stderr)
    return 1 if report.failures else 0


def _device_line() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return (
                f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory >> 30} GiB; "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}"
            )
        return f"device: CPU ({os.cpu_count()} cores); torch {torch.__version__}"
    except ImportError:
        return "device: unknown (no torch)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="the same path on CPU, short (CI)")
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-check-report.md", help="markdown report")
    ap.add_argument("--workloads", nargs="+", help=f"side tasks (default {' '.join(GPU_WORKLOADS)})")
    ap.add_argument("--pairs", type=int, help="alone/with pairs per workload (default 3; dry run 1)")
    ap.add_argument("--steps", type=int, help="steps per run (default 15; dry run 5)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting workloads after this long")
    ap.add_argument("--two-gpu", action="store_true", help="also the real DeepSpeed and Megatron pipelines")
    ns = ap.parse_args(argv)
    dry = bool(ns.dry_run)
    stage_args = ("--device", "cpu", "--width", "768", "--batch", "32", "--stages", "2", "--stage", "0")
    config = CheckConfig(
        dry_run=dry,
        out=ns.out,
        workloads=tuple(ns.workloads or (DRY_WORKLOADS if dry else GPU_WORKLOADS)),
        pairs=ns.pairs or (1 if dry else 3),
        steps=ns.steps or (5 if dry else 15),
        budget_s=ns.budget_s,
        two_gpu=bool(ns.two_gpu),
        stage_args=stage_args if dry else GPU_STAGE,
    )
    return run_check(config)


if __name__ == "__main__":
    sys.exit(main())
