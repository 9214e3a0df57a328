"""Step time and peak memory of the packaged side tasks, each run alone.

Every task runs in a fresh child process (so one task's memory cannot hide
another's) through :func:`freeride.sidetask.run_alone`: construct, set up, run
``--steps`` steps. Reported, as a markdown table:

* setup: seconds from construction to the first step (building models, graphs);
* step median / p90 / max: over the steps after ``--warmup`` warm-up steps;
* page faults and system time per step: over the measured steps
  (``getrusage``): on a CPU device, a task whose tensors come from fresh pages
  each step pays for it here (glibc maps allocations over 32 MB anew and
  returns them on free; the first write to each 4 KB page faults);
* slowest kind: for a task whose steps come in kinds (see
  ``IterativeTask.step_kind``), the kind with the longest median step: the
  piece that must fit in a bubble;
* peak memory: on a CPU device, the peak resident set of the child
  (``VmHWM`` in ``/proc/self/status``, reset with ``/proc/self/clear_refs``
  once the imports are done) minus its resident set at that moment, i.e. what
  the task itself added; on a CUDA device, ``torch.cuda.max_memory_allocated``.

Inference tasks are profiled with ``fit_steps=0`` (their steady state; their
optional fitting steps cost what the training task's steps cost).

Run: ``python tools/bench/sidetask_profile.py --steps 10 --threads 1`` (all
iterative catalog entries), or name some: ``... pagerank graph-sgd --opt
pagerank:nodes=1000000``. A partitioned task's steps differ by piece: measure
whole batches, e.g. ``... vgg19-train --opt vgg19-train:batch_size=1 --warmup
400 --steps 900`` (about 300 pieces a batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from freeride.sidetask import UnboundedGate  # no torch: the parent process stays light

__all__ = ["main"]

# Options that make a profile describe the task's steady state.
_PROFILE_DEFAULTS: dict[str, dict[str, Any]] = {
    "resnet18-infer": {"fit_steps": 0},
    "resnet50-infer": {"fit_steps": 0},
    "vgg19-infer": {"fit_steps": 0},
    "pagerank": {"tol": 1e-30, "max_iters": 1_000_000},  # never converge within the profile
}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _MeasuredGate(UnboundedGate):
    """Takes the process's resource usage as the first measured step starts."""

    def __init__(self, warmup: int) -> None:
        super().__init__()
        self.warmup = warmup
        self.start: resource.struct_rusage | None = None

    @asynccontextmanager
    async def step(self, kind: str = "") -> AsyncIterator[None]:
        if self.start is None and self.steps >= self.warmup:
            self.start = resource.getrusage(resource.RUSAGE_SELF)
        async with super().step(kind):
            yield


def _child(name: str, options: dict[str, Any], steps: int, warmup: int, threads: int, device: str) -> dict[str, Any]:
    import importlib

    import torch

    from freeride.sidetask import TaskContext, run_alone
    from freeride.tasks.targets import catalog

    if threads:
        torch.set_num_threads(threads)
    module_name, _, cls_name = catalog()[name].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    base_kib = _status_kib("VmRSS")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    task = cls(**options)
    name_of_device = device if ":" in device else f"{device}:0"
    ctx = TaskContext(task_id=0, device=name_of_device, torch_device=device, workdir=Path.cwd())
    asyncio.run(task.setup(ctx))  # the sample tasks build once; run_alone's setup() is then a no-op
    setup_s = time.perf_counter() - t0
    gate = _MeasuredGate(warmup)
    durations = asyncio.run(run_alone(task, steps=steps + warmup, ctx=ctx, gate=gate))
    after = resource.getrusage(resource.RUSAGE_SELF)
    before = gate.start or after
    measured_steps = max(1, len(durations) - warmup)
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.startswith("cuda")
        else (_status_kib("VmHWM") - base_kib) * 1024
    )
    measured = [d / 1e6 for d in durations[warmup:]] or [d / 1e6 for d in durations]
    by_kind: dict[str, list[float]] = {}
    for kind, d in list(zip(gate.kinds, durations, strict=True))[warmup:]:
        by_kind.setdefault(kind, []).append(d / 1e6)
    slowest = max(by_kind.items(), key=lambda kv: statistics.median(kv[1]), default=("", measured))
    return {
        "setup_s": setup_s,
        "steps": len(durations),
        "median_ms": statistics.median(measured),
        "p90_ms": sorted(measured)[max(0, round(0.9 * len(measured)) - 1)],
        "max_ms": max(measured),
        "kinds": len(by_kind),
        "slowest_kind": slowest[0],
        "slowest_kind_ms": statistics.median(slowest[1]),
        "peak_bytes": peak,
        "faults_per_step": (after.ru_minflt + after.ru_majflt - before.ru_minflt - before.ru_majflt) / measured_steps,
        "sys_ms_per_step": (after.ru_stime - before.ru_stime) * 1e3 / measured_steps,
        "metrics": task.metrics(),
    }


def _parse_value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("names", nargs="*", help="catalog names (default: every iterative task)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per task (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first and not measured (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each child; 0: torch's default")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--opt", action="append", default=[], metavar="NAME:KEY=VALUE", help="task option")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        options = json.loads(args.child)
        result = _child(options.pop("__name"), options, args.steps, args.warmup, args.threads, args.device)
        print(json.dumps(result))
        return 0

    from freeride.tasks.targets import catalog

    names = args.names or list(catalog())
    overrides: dict[str, dict[str, Any]] = {n: dict(_PROFILE_DEFAULTS.get(n, {})) for n in names}
    for spec in args.opt:
        name, _, pair = spec.partition(":")
        key, _, raw = pair.partition("=")
        if name not in overrides or not key:
            parser.error(f"--opt {spec!r}: expected NAME:KEY=VALUE with NAME among {names}")
        overrides[name][key] = _parse_value(raw)

    print(
        f"device {args.device}, torch threads {args.threads or 'default'}, "
        f"{args.steps} measured steps after {args.warmup} warm-up\n"
    )
    print(
        "| task | options | setup s | step median ms | p90 ms | max ms | page faults / step | system ms / step "
        "| slowest kind (ms) | peak memory MiB |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name in names:
        payload = json.dumps({"__name": name, **overrides[name]})
        cmd = [
            sys.executable,
            __file__,
            "--child",
            payload,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--threads",
            str(args.threads),
            "--device",
            args.device,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        opts = " ".join(f"{k}={v}" for k, v in overrides[name].items()) or "defaults"
        if proc.returncode != 0:
            print(f"| {name} | {opts} | failed: {proc.stderr.strip().splitlines()[-1:]} | | | | | | | |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        slowest = f"{r['slowest_kind']} ({r['slowest_kind_ms']:.1f}) of {r['kinds']}" if r["kinds"] > 1 else "-"
        print(
            f"| {name} | {opts} | {r['setup_s']:.2f} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} "
            f"| {r['max_ms']:.1f} | {r['faults_per_step']:.0f} | {r['sys_ms_per_step']:.2f} "
            f"| {slowest} | {r['peak_bytes'] / 2**20:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
