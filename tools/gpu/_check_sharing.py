"""The GPU check's sections on how side work shares the device: (b) MPS caps and (f) the bubble gate.

b. FreeRide's own MPS daemon: a side task over its memory cap fails alone while
   training goes on; the SM cap as the capped client sees it.
f. Side work released by the device (``gate_bench.py``), in the trainer's
   process, in a second one, and in a second one under MPS.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from _check_report import ROOT, STAGE, CheckConfig, Report, run_command

if TYPE_CHECKING:
    from freeride.gpu.mps import MpsDaemon

__all__ = ["mps_missing", "section_gate", "section_mps"]

GATE_BENCH = Path(__file__).resolve().parent / "gate_bench.py"
SM_SHARES = (25, 50, 75)
"""The side work's share of the SMs tried, by a green context and by MPS (issue: settle the default by measurement)."""
SHARE_BUBBLES = 200
"""Bubbles of each kind in a run of the SM-share variants (400 in the main rows)."""

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
        daemon, report.mps_missing = start_mps(tmp)
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
            full = run_command([sys.executable, "-c", _SMS]).strip()
            capped = run_command([sys.executable, "-c", _SMS], env={**os.environ, **sm_env}).strip()
            lines.append(f"- SM cap {share} %: the client sees {capped} SMs (the device has {full})")
        if not (over_ok and under_ok and train_ok):
            raise RuntimeError("memory cap check failed:\n" + "\n".join(lines))
        return "\n".join(lines)
    finally:
        if daemon is not None:
            import asyncio

            asyncio.run(daemon.quit())
        shutil.rmtree(tmp, ignore_errors=True)


def start_mps(tmp: Path) -> tuple[MpsDaemon | None, str]:
    """FreeRide's MPS daemon on a private pipe directory under ``tmp``; None and why, where it cannot start."""
    import asyncio

    from freeride.gpu.mps import MpsDaemon, MpsError

    daemon = MpsDaemon(tmp / "pipe", tmp / "log")
    try:
        asyncio.run(daemon.start())
    except MpsError as exc:
        return None, str(exc).splitlines()[0][:300] or type(exc).__name__
    return daemon, ""


def mps_missing(config: CheckConfig, report: Report) -> str:
    """Why MPS cannot run here ("" when it can), from section (b) or a start of the daemon now."""
    if config.dry_run:
        return ""
    if report.mps_missing is None:
        import asyncio

        tmp = Path(tempfile.mkdtemp(prefix="frmps-"))
        daemon, report.mps_missing = start_mps(tmp)
        if daemon is not None:
            asyncio.run(daemon.quit())
        shutil.rmtree(tmp, ignore_errors=True)
    return report.mps_missing


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
    short = ["--bubbles", str(SHARE_BUBBLES)]
    # (label, arguments, environment added for the whole run: trainer and side process)
    runs: list[tuple[str, list[str], dict[str, str]]] = [
        ("side stream, same process", ["--side", "stream"], {}),
        *(
            (f"green context, {pct} % of SMs", ["--side", "green", "--sm-percent", str(pct), *short], {})
            for pct in SM_SHARES
        ),
        ("side process, no MPS", ["--side", "process"], {}),
    ]
    tmp = Path(tempfile.mkdtemp(prefix="frgate-mps-"))
    daemon = None
    if not mps_missing(config, report):
        daemon, _ = start_mps(tmp)
    try:
        if daemon is not None:
            client = daemon.client_env(0, 8 << 30)
            side_only = [arg for key, value in client.items() for arg in ("--side-env", f"{key}={value}")]
            runs.append(("side process, MPS client; trainer outside MPS", ["--side", "process", *side_only], {}))
            for pct in SM_SHARES:
                share = ["--side-env", f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct}"]
                label = f"side process, MPS client at {pct} % of SMs; trainer outside MPS"
                runs.append((label, ["--side", "process", *side_only, *share, *short], {}))
            runs.append(("side process and trainer, both MPS clients", ["--side", "process"], client))
        for label, args, env in runs:
            try:  # one variant that cannot run (no green contexts in this torch, say) leaves the others
                out = run_command([sys.executable, str(GATE_BENCH), *args], env={**os.environ, **env}, timeout_s=120)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                rows.append(f"| {label} | FAILED: {str(exc).strip().splitlines()[-1][:200]} | | | | | |")
                continue
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
        "(`python tools/gpu/gate_bench.py --side stream|green|process`). Start lag: bubble start to the first side "
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
