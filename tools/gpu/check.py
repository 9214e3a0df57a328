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
g. The suite's GPU tests (``pytest tests/gpu``): the device timeline, the bubble
   gate, steps as CUDA graphs, the GPU paths, each against the real device.

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
from collections.abc import Callable
from pathlib import Path

from _check_report import ROOT, STAGE, CheckConfig, Report, cuda_available, run_command

sys.path.insert(0, str(ROOT / "tools" / "bench"))  # the benchmark harness lives there

from _bench_commands import profile_job
from _check_sharing import mps_missing, section_gate, section_mps
from _pipeline_bench import Benched, BenchOptions, Job, ManagerFailed, RunResult, SideTask, bench_runs, side_task

__all__ = ["CheckConfig", "main"]

GPU_WORKLOADS = ("resnet18-train", "pagerank", "graph-sgd", "imaging", "resnet18-infer")
"""In the order they run: the ones the time budget leaves out come last."""
GPU_STAGE = ("--device", "cuda", "--width", "4096", "--depth", "8", "--batch", "1024")
"""About 5 ms per forward in FP32 on an H100: bubbles of several ms, as in real stages."""
DRY_WORKLOADS = ("graph-sgd", "pagerank")
"""Two, so that the dry run takes the path of a later workload too (the A/A pairs of the first shown with it)."""
CHECK = "tools/gpu/check.sh"
RELEASE_ARGS = {"host": (), "gate": ("--device-gate",)}
"""How side work is released in a run of (a): through the host, or by the device (``serve --device-gate``)."""
RELEASE_TITLES = {"host": "", "gate": ", released by the device gate"}

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
    no_mps = mps_missing(config, report)
    serve_args: tuple[str, ...] = () if config.dry_run or no_mps else ("--mps",)
    parts, rows = [], []
    if no_mps:
        parts.append(f"`freeride serve` without `--mps`: MPS is not available here ({no_mps})")
    # one profile of the stage for every workload; the A/A pairs run with the first workload measured and are
    # shown with each (the stage alone does not depend on the side task), so the later ones need no warm-up alone
    work = Path(tempfile.mkdtemp(prefix="frcheck-profile-"))
    try:
        profile = profile_job(Job(title="", script=STAGE, args=config.stage_args, profiles_itself=True), work)
        floor: list[RunResult] = []
        for name, release in ((n, r) for n in config.workloads for r in config.releases):
            label = name if release == "host" else f"{name} (gate)"
            if time.monotonic() - report.started > config.budget_s:
                parts.append(f"{label}: skipped (time budget of {config.budget_s:.0f} s spent)")
                continue
            first = not floor
            options = BenchOptions(
                pairs=config.pairs, controls=config.controls if first else 0, steps=config.steps, warm_alone=first
            )
            stats = Path(tempfile.mkdtemp(prefix="frcheck-stats-"))
            job = Job(
                title=f"### {name} in the bubbles of an emulated-neighbour stage{RELEASE_TITLES[release]}",
                script=STAGE,
                args=(*config.stage_args, "--stats-out", str(stats)),
                profiles_itself=True,
            )
            task = side_task(name, (), "2ms")

            def measure(
                serve_args: tuple[str, ...],
                job: Job = job,
                task: SideTask = task,
                options: BenchOptions = options,
                shown: list[RunResult] = floor,
                release: str = release,
            ) -> Benched:
                args = (*serve_args, *RELEASE_ARGS[release])
                return bench_runs(job, task, options, command=CHECK, serve_args=args, profile_path=profile, shown=shown)

            try:
                try:
                    benched = measure(serve_args)
                except ManagerFailed as exc:
                    if not serve_args:
                        raise
                    # the manager could not run with MPS: say why, and measure the bubbles without it
                    report.failures.append(f"a. freeride serve --mps ({label})")
                    parts.append(
                        f"**`freeride serve --mps` FAILED**, the runs below are without MPS:\n\n```\n{exc}\n```"
                    )
                    serve_args = ()
                    for path in stats.glob("stage-*.json"):  # the failed attempt's runs: from here as a first attempt
                        path.unlink()
                    benched = measure(serve_args)
            except Exception as exc:  # one workload that cannot run fails its own part; the others still run
                report.failures.append(f"a. {label}")
                parts.append(f"{job.title}\n\n**FAILED**: {type(exc).__name__}: {str(exc)[-3000:]}")
                shutil.rmtree(stats, ignore_errors=True)
                continue
            parts.append(benched.markdown)
            if first:
                floor = benched.controls()
            alone, launched = _stats(stats)
            shutil.rmtree(stats, ignore_errors=True)
            f_alone, f_with = _median(alone, "forward_ms"), _median(launched, "forward_ms")
            b_alone, b_with = _median(alone, "backward_ms"), _median(launched, "backward_ms")
            timing = str(launched[0]["timing"]) if launched else "?"
            rows.append(
                f"| {label} | {timing} | {_acc(launched, 'announced'):.0f} | {_acc(launched, 'lag_p50_ms'):.3f} / "
                f"{_acc(launched, 'lag_p99_ms'):.3f} | {_acc(launched, 'abs_error_p50_ms'):.3f} | "
                f"{f_alone:.3f} -> {f_with:.3f} | {b_alone:.3f} -> {b_with:.3f} |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
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


# ------------------------------------------------------------------ (c), (d)


def section_tail(config: CheckConfig) -> str:
    if config.dry_run:
        return "Not available without CUDA (the tail is work queued on the GPU); run on a GPU."
    tail = ROOT / "tools/bench/gpu_tail.py"
    cmd = [sys.executable, str(tail), "--ks", "0", "1", "4", "--reps", "5", "--warmup-s", "40"]
    out = run_command(cmd, timeout_s=150)
    return f"```\n{out.strip()}\n```"


def section_tests(config: CheckConfig) -> str:
    """The suite's GPU tests (``tests/gpu``): what CPU machines check through stand-ins, on the device."""
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider", "--durations=0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    summary = f"`{shlex.join(cmd[1:])}`: exit {done.returncode}"
    body = f"{summary}\n\n```\n{(done.stdout + done.stderr)[-4000:].strip()}\n```"
    if done.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(body)
    if config.dry_run:
        return body + "\n\nOn CPU every test there skips, saying it needs a CUDA device."
    return body


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
        outputs.append(run_command(cmd, timeout_s=280))
    return "\n\n".join(outputs)


# ---------------------------------------------------------------------- main


def run_check(config: CheckConfig) -> int:
    report = Report()
    env = "CPU (dry run)" if config.dry_run else "GPU"
    if not config.dry_run and not cuda_available():
        print("check: no CUDA device here; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    header = [
        f"# FreeRide GPU check ({env})",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; host: {os.uname().nodename}; python {sys.version.split()[0]}",
        f"- {_device_line()}",
        f"- stage: `python tools/gpu/stage.py {' '.join(config.stage_args)}`; {config.pairs} pairs x "
        f"{config.steps} steps per workload, {config.controls} A/A pairs",
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
        ("g. The suite's GPU tests", lambda: section_tests(config)),
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
    ap.add_argument(
        "--controls", type=int, help="A/A pairs, run with the first workload and shown with each (default 2; dry run 1)"
    )
    ap.add_argument(
        "--release",
        nargs="+",
        choices=tuple(RELEASE_ARGS),
        help="how side work is released in (a), each workload run once per choice (default host gate; dry run host)",
    )
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
        controls=(1 if dry else 2) if ns.controls is None else ns.controls,
        releases=tuple(ns.release or (("host",) if dry else tuple(RELEASE_ARGS))),
        steps=ns.steps or (5 if dry else 15),
        budget_s=ns.budget_s,
        two_gpu=bool(ns.two_gpu),
        stage_args=stage_args if dry else GPU_STAGE,
    )
    return run_check(config)


if __name__ == "__main__":
    sys.exit(main())
