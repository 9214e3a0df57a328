"""The training job's measured cost with a real manager, real workers and a simulated 2-stage pipeline.

The manager holds back a quarter of the steps (blocks of two); the test checks
that no side-task step starts inside a held-back step of its device (read from
the trace), that status, ``freeride status`` text and ``freeride report`` show
the cost with its interval, and that the bubble time held back is counted.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from conftest import running_manager, wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.cli.status import format_status
from freeride.observe.report import ReportOptions, build_report
from freeride.observe.timeline import load_trace
from freeride.serve.config import ServeConfig
from freeride.serve.holdback import HoldbackSchedule
from freeride.transport import Endpoints

HOLDBACK = p.Holdback(block_steps=2, every=4, max_every=4)
STEPS = 60


async def test_held_back_steps_get_no_side_work_and_every_view_shows_the_cost(
    runtime_dir: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.json"
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", holdback=HOLDBACK, trace=trace
    )
    logs = {stage: tmp_path / f"steps-{stage}.json" for stage in range(2)}
    sim_config = SimConfig(endpoint=config.endpoints.events, steps=STEPS, forward_s=0.005, backward_s=0.010)
    async with running_manager(config) as manager:
        for stage in range(2):
            device = sim_config.device(stage)
            manager.declare_device(device, stage=stage, spare_memory=1 << 30, cpu_affinity=[sim_config.core(stage)])
            reply = manager.submit(
                p.IterativeSpec(
                    target="_tasks:SpinSteps",
                    device=device,
                    options={"step_ms": 1.0, "log": str(logs[stage])},
                )
            )
            assert isinstance(reply, p.Submitted), reply
        await wait_until(lambda: all(t.state == "running" for t in manager.tasks.values()), 60, "setup")
        sim = SimPipeline(sim_config).start()
        try:
            await asyncio.to_thread(sim.join)
        finally:
            sim.terminate()
        await wait_until(lambda: not manager.live_backends(), 10, "the ranks' goodbyes")
        for task in list(manager.tasks.values()):
            await manager.cancel(task.task_id)  # each flushes its step log at teardown
        status = manager.status()

    [cost] = status.costs
    assert cost.steps == STEPS and cost.pairs >= 6 and cost.coverage >= 0.95, cost
    assert cost.low <= cost.slowdown <= cost.high and cost.harvest_share == 1.0 and cost.held_share == 0.25
    assert all(d.held_back_ns > 0 and d.used_ns > 0 for d in status.devices), status.devices
    text = format_status(status)
    assert "training cost" in text and "95 %:" in text and "held back" in text

    # no side-task step started inside a held-back step of its own device
    schedule = HoldbackSchedule(p.Holdback(job=cost.job, block_steps=2, every=4, max_every=4))
    timeline = load_trace(trace)
    held_spans = {
        name: [span for step, span in device.steps.items() if schedule.held(step)]
        for name, device in timeline.devices.items()
    }
    checked = 0
    for stage, log in logs.items():
        device = sim_config.device(stage)
        assert held_spans[device], "no held-back step in the trace"
        for start, _ in json.loads(log.read_text())["intervals"]:
            assert not any(lo <= start < hi for lo, hi in held_spans[device]), (stage, start)
            checked += 1
    assert checked > 100

    report = build_report(timeline, ReportOptions())
    assert report.costs and report.costs[0].job == cost.job
    assert "training cost" in report.text() and report.to_dict()["costs"][0]["pairs"] >= 6
