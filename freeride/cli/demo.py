"""``freeride demo``: a manager, a simulated pipeline job and a side task per stage.

Everything is real but the training framework: the manager serves on ipc://
sockets in a fresh runtime directory, each pipeline stage is a process pinned
to its own core that waits on its neighbours, and each side task is a worker
process pinned to its stage's core that only steps inside granted bubbles.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline, StageResult
from freeride.observe.cost import cost_lines
from freeride.serve.config import ServeConfig
from freeride.serve.guard import describe as describe_guard
from freeride.serve.manager import Manager
from freeride.transport import Endpoints
from freeride.units import format_ns

__all__ = ["DemoOptions", "DemoReport", "run_demo"]


def _default_sim() -> SimConfig:
    # slower than `freeride sim`'s defaults so a sample task's step fits in a bubble
    return SimConfig(endpoint="", forward_s=0.010, backward_s=0.020, steps=60)


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoOptions:
    sim: SimConfig = field(default_factory=_default_sim)
    """The simulated pipeline job; its ``endpoint`` is replaced by the demo manager's."""
    task: str = "graph-sgd"
    """A name from ``freeride submit --list`` or ``module:Class``."""
    task_options: dict[str, str | int | float | bool] = field(default_factory=lambda: {"eval_every": 25})
    """Options of the side task (the default suits the default task)."""
    setup_timeout_s: float = 120.0
    holdback: p.Holdback = field(default_factory=lambda: p.Holdback(block_steps=2, every=4, max_every=4))
    """Steps held back to measure the job's cost: denser than ``serve``'s default, so that a short demo
    has the pairs a 95 % interval needs (a quarter of its steps; 60 steps give 7 pairs)."""


@dataclass(slots=True)
class DemoReport:
    options: DemoOptions
    status: p.StatusReply
    stages: list[StageResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.status.devices) and all(
            t.state in ("cancelled", "finished") and t.steps > 0 for t in self.status.tasks
        )

    def text(self) -> str:
        o, sim = self.options, self.options.sim
        # an interleaved schedule with v chunks per rank shrinks the bubble to (p-1)/(v*m) of the ideal time
        work = sim.num_chunks * sim.num_microbatches
        theory = (sim.num_stages - 1) / (work + sim.num_stages - 1)
        chunks = f" x {sim.num_chunks} chunks" if sim.num_chunks > 1 else ""
        lines = [
            f"FreeRide demo: {sim.schedule} pipeline, {sim.num_stages} stages x {sim.num_microbatches} micro-batches"
            f"{chunks}, {sim.steps} steps ({sim.compute} compute); side task: {o.task}",
            "",
            f"{'stage':>5} {'device':8} {'step (median)':>13} {'bubble share':>12} {'bubble time':>11} "
            f"{'used by side task':>17} {'overruns':>8}",
        ]
        by_stage = {r.stage: r for r in self.stages}
        for d in sorted(self.status.devices, key=lambda d: d.stage):
            r = by_stage.get(d.stage)
            step = statistics.median(r.step_ns) if r and r.step_ns else 0
            # step 0 includes start-up (ranks waiting for each other to exist)
            share = sum(r.wait_ns[1:]) / sum(r.step_ns[1:]) if r and len(r.step_ns) > 1 else 0.0
            used = d.used_ns / d.offered_ns if d.offered_ns else 0.0
            lines.append(
                f"{d.stage:>5} {d.device:8} {format_ns(int(step)):>13} {share:>12.1%} {format_ns(d.bubble_ns):>11} "
                f"{used:>17.1%} {d.overruns:>8}"
            )
        formula = "(p-1)/(v*m+p-1)" if sim.num_chunks > 1 else "(p-1)/(m+p-1)"
        lines.append(
            f"(bubble share measured after step 0; the schedule's {formula} is {theory:.1%}; used: of the bubble"
            " time not held back to measure the cost)"
        )
        lines.extend(cost_lines(self.status.costs, self.status.devices))
        for d in sorted(self.status.devices, key=lambda d: d.stage):
            if d.margin_ns >= 0:  # what each device's interference guard settled on, and why
                lines.append(f"guard {d.device}: {describe_guard(d)} ({d.guard_reason})")
        lines.append("")
        for t in self.status.tasks:
            metrics = ", ".join(f"{k} {v:.4g}" for k, v in sorted(t.metrics.items()))
            lines.append(f"task {t.task_id} {t.name}: {t.state} on {t.device}, {t.steps} steps; {metrics}")
            if t.error:
                lines.append(f"  error: {t.error}")
        lat = self.status.latency
        lines.append("")
        lines.append(
            f"bubble start -> side-task step start: median {format_ns(lat.p50_ns)}, p99 {format_ns(lat.p99_ns)} "
            f"({lat.count} grants)"
        )
        return "\n".join(lines)


def _target(task: str) -> str:
    from freeride.tasks.targets import resolve

    return resolve(task)


async def _wait_for(predicate: object, timeout_s: float, what: str) -> None:
    assert callable(predicate)
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise TimeoutError(f"demo: timed out after {timeout_s:g}s waiting for {what}") from None


async def _demo(options: DemoOptions) -> DemoReport:
    runtime_dir = Path(tempfile.mkdtemp(prefix="freeride-demo-"))
    try:
        return await _demo_in(options, runtime_dir)
    finally:
        # sockets, logs and checkpoints of a demo are of no use once it has reported
        shutil.rmtree(runtime_dir, ignore_errors=True)


async def _demo_in(options: DemoOptions, runtime_dir: Path) -> DemoReport:
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", holdback=options.holdback
    )
    sim_config = replace(options.sim, endpoint=config.endpoints.events)
    target = _target(options.task)
    stop = asyncio.Event()
    async with Manager(config) as manager, asyncio.TaskGroup() as tg:
        tg.create_task(manager.run(stop), name="demo-manager")
        for stage in range(sim_config.num_stages):
            device = sim_config.device(stage)
            manager.declare_device(
                device, stage=stage, spare_memory=sim_config.spare_memory, cpu_affinity=[sim_config.core(stage)]
            )
            reply = manager.submit(
                p.IterativeSpec(
                    target=target,
                    device=device,
                    name=f"demo-{options.task}-stage{stage}",
                    options=options.task_options,
                )
            )
            if isinstance(reply, p.Rejected):
                raise ValueError(reply.reason)
        await _wait_for(
            lambda: all(t.state != "starting" for t in manager.tasks.values()),
            options.setup_timeout_s,
            "side tasks",
        )
        sim = SimPipeline(sim_config).start()
        try:
            stages = await asyncio.to_thread(sim.join)
        finally:
            sim.terminate()
        await _wait_for(lambda: not manager.live_backends(), 10.0, "the simulated ranks to say goodbye")
        for task in list(manager.tasks.values()):
            if task.state not in ("finished", "failed", "cancelled"):
                await manager.cancel(task.task_id)  # each checkpoints and reports its last metrics
        await asyncio.sleep(0.1)  # let the last progress messages land
        status = manager.status()
        stop.set()
    return DemoReport(options=options, status=status, stages=stages)


def run_demo(options: DemoOptions) -> DemoReport:
    """Run the demo on a uvloop event loop and return its report."""
    import uvloop

    return uvloop.run(_demo(options))
