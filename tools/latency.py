"""Bubble start -> side-task step start latency, over many real bubbles.

Runs a manager, a simulated 2-stage pipeline with short compute (many small
bubbles) and one iterative side task per stage, all as real processes over
ipc:// sockets. The time is measured from the backend's ``BubbleStarted``
timestamp (taken right before its send) to the first step the side task
starts inside that bubble: one emit, two socket hops and two wake-ups.

The manager runs with ``freeride serve``'s defaults: it holds side work back
from some steps to measure the job's cost, and its slowdown budget leaves a
share of bubbles out while that cost is above 0.5 %. Bubble time used is a
share of all bubble time; ``held_back`` and ``backed_off`` say how much of it
those two took (``--no-cost`` turns both off).

    .venv/bin/python tools/latency.py --bubbles 10000
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.observe.stats import quantile
from freeride.serve.config import ServeConfig
from freeride.serve.manager import Manager
from freeride.transport import Endpoints

TASK = "freeride.sidetasks.graph_sgd:GraphSGD"
TASK_OPTIONS: dict[str, str | int | float | bool] = {"users": 500, "items": 200, "batch_edges": 512, "eval_every": 0}
"""Small SGD steps (well under a millisecond) that never finish: every bubble gets steps."""


async def measure(
    bubbles: int, forward_ms: float, backward_ms: float, microbatches: int, *, cost: bool = True
) -> dict[str, float]:
    runtime_dir = Path(tempfile.mkdtemp(prefix="fr-lat-"))
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir),
        state_dir=runtime_dir / "state",
        checkpoint_every_s=3600,
    )
    if not cost:
        config = dataclasses.replace(config, holdback=p.Holdback(every=0), slowdown_budget=0.0)
    # bubbles per step per stage in 1F1B with p=2: head or tail, fill, and (m-1)... count from a probe run below
    sim = SimConfig(
        endpoint=config.endpoints.events,
        num_stages=2,
        num_microbatches=microbatches,
        forward_s=forward_ms / 1e3,
        backward_s=backward_ms / 1e3,
        steps=1,
    )
    from freeride.backends.schedule import Durations, build_schedule, simulate
    from freeride.backends.schedule import bubbles as find_bubbles

    timeline = simulate(build_schedule("1f1b", 2, microbatches), Durations.uniform(2, sim.forward_s, sim.backward_s))
    per_step = sum(len(w) for w in find_bubbles(timeline, min_duration=sim.min_bubble_s))
    steps = math.ceil(bubbles / per_step)
    sim = SimConfig(**{**{f: getattr(sim, f) for f in sim.__dataclass_fields__}, "steps": steps})
    stop = asyncio.Event()
    async with Manager(config) as manager, asyncio.TaskGroup() as tg:
        tg.create_task(manager.run(stop), name="latency-manager")
        for stage in range(2):
            device = sim.device(stage)
            manager.declare_device(device, stage=stage, spare_memory=1 << 30, cpu_affinity=[sim.core(stage)])
            manager.submit(p.IterativeSpec(target=TASK, device=device, options=TASK_OPTIONS))
        while any(t.state == "starting" for t in manager.tasks.values()):
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        pipeline = SimPipeline(sim).start()
        try:
            await asyncio.to_thread(pipeline.join)
        finally:
            pipeline.terminate()
        wall = time.monotonic() - t0
        while manager.live_backends():
            await asyncio.sleep(0.05)
        values = sorted(manager.latency.values())
        status = manager.status()
        stop.set()
    failed = [f"task {t.task_id}: {t.error}" for t in status.tasks if t.state == "failed"]
    if failed:
        raise SystemExit("side tasks failed: " + "; ".join(failed))
    seen = sum(d.bubbles for d in status.devices)
    bubble_ns = max(1, sum(d.bubble_ns for d in status.devices))
    used = sum(d.used_ns for d in status.devices) / bubble_ns
    return {
        "bubbles": seen,
        "grants_with_a_step": len(values),
        "p50_us": quantile(values, 0.5) / 1e3,
        "p90_us": quantile(values, 0.9) / 1e3,
        "p99_us": quantile(values, 0.99) / 1e3,
        "max_us": (values[-1] if values else 0) / 1e3,
        "bubble_time_used": used,
        "held_back": sum(d.held_back_ns for d in status.devices) / bubble_ns,
        "backed_off": sum(d.backed_off_ns for d in status.devices) / bubble_ns,
        "overruns": sum(d.overruns for d in status.devices),
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bubbles", type=int, default=10_000, help="bubbles to produce over both stages")
    parser.add_argument("--forward-ms", type=float, default=2.0)
    parser.add_argument("--backward-ms", type=float, default=4.0)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument(
        "--no-cost",
        action="store_true",
        help="no held-back steps and no slowdown budget (serve --holdback-every 0 --slowdown-budget off):"
        " the reaction path alone",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import uvloop

    r = uvloop.run(measure(args.bubbles, args.forward_ms, args.backward_ms, args.microbatches, cost=not args.no_cost))
    if args.json:
        print(json.dumps(r))
    else:
        print(
            "| bubbles | grants with a step | p50 | p90 | p99 | max | bubble time used | held back | backed off"
            " | overruns |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        print(
            f"| {r['bubbles']} | {r['grants_with_a_step']} | {r['p50_us']:.0f} µs | {r['p90_us']:.0f} µs | "
            f"{r['p99_us']:.0f} µs | {r['max_us']:.0f} µs | {r['bubble_time_used']:.1%} | {r['held_back']:.1%} | "
            f"{r['backed_off']:.1%} | {r['overruns']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
