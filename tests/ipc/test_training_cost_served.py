"""The training job's measured cost with a real manager, real workers and a simulated 2-stage pipeline.

The manager holds back a quarter of the steps (blocks of two), with no slowdown
budget (on two shared cores the measured cost can pass it and back harvesting
off after a pair: what is checked here is the meter's every view); the test checks
that no side-task step starts inside a held-back step of its device (read from
the trace), that status, ``freeride status`` text and ``freeride report`` show
the cost with its interval, and that the bubble time held back is counted.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
from conftest import NO_BUDGET, running_manager, wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.cli.status import format_status
from freeride.holdback import HoldbackSchedule
from freeride.observe.base import Observer
from freeride.observe.report import ReportOptions, build_report
from freeride.observe.timeline import load_trace
from freeride.serve.config import ServeConfig
from freeride.transport import Endpoints

HOLDBACK = p.Holdback(block_steps=2, every=4, max_every=4)
STEPS = 60
MS = 1_000_000


async def _served(
    config: ServeConfig, logs: dict[int, Path], sim_config: SimConfig, observer: Observer | None = None
) -> p.StatusReply:
    """Run the job with one spinning side task a stage under a real manager; its status at the end."""
    async with running_manager(config) as manager:
        if observer is not None:
            manager.observers.add(observer)
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
        assert isinstance(status, p.StatusReply)
        return status


async def test_held_back_steps_get_no_side_work_and_every_view_shows_the_cost(
    runtime_dir: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.json"
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir),
        state_dir=runtime_dir / "state",
        holdback=HOLDBACK,
        trace=trace,
        slowdown_budget=NO_BUDGET,
    )
    logs = {stage: tmp_path / f"steps-{stage}.json" for stage in range(2)}
    sim_config = SimConfig(endpoint=config.endpoints.events, steps=STEPS, forward_s=0.005, backward_s=0.010)
    status = await _served(config, logs, sim_config)

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


class _Bubbles(Observer):
    """The steps of the bubble starts that reached the manager, by rank."""

    def __init__(self) -> None:
        self.steps: dict[int, set[int]] = {0: set(), 1: set()}

    def backend_event(self, event: p.BackendEvent) -> None:
        if isinstance(event, p.BubbleStarted):
            self.steps[event.rank].add(event.step)


async def test_without_a_trace_the_ranks_publish_no_bubble_of_a_held_back_step_and_their_time_is_still_counted(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """The manager's answer to each rank names the held-back steps (decision D61): the rank keeps their
    bubbles to itself, so neither the manager nor an armed worker wakes for them; its step reports carry
    their count and time, which the manager adds to the bubble time held back."""
    seen = _Bubbles()
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir),
        state_dir=runtime_dir / "state",
        holdback=HOLDBACK,
        slowdown_budget=NO_BUDGET,
    )
    logs = {stage: tmp_path / f"steps-{stage}.json" for stage in range(2)}
    sim_config = SimConfig(endpoint=config.endpoints.events, steps=STEPS, forward_s=0.005, backward_s=0.010)
    status = await _served(config, logs, sim_config, seen)

    [cost] = status.costs
    assert cost.steps == STEPS and cost.pairs >= 6 and cost.held_share == 0.25, cost
    schedule = HoldbackSchedule(msgspec.structs.replace(HOLDBACK, job=cost.job))
    held = {step for step in range(STEPS) if schedule.held(step)}
    assert len(held) >= 10
    answered = {step for step in held if step >= 2 + 4 * 2}  # after the first cycle: the answer has come
    for rank, steps in seen.steps.items():
        assert not steps & answered, (rank, sorted(steps & answered))
        assert len(steps) >= STEPS - len(held) - 2, (rank, sorted(steps))  # the harvested ones did reach it
    for device in status.devices:
        assert device.used_ns > 0, device
        # two bubbles a stage in each held step, as long as the stage waits: counted from the step reports
        assert device.held_back_ns > len(held) * 5 * MS, device
