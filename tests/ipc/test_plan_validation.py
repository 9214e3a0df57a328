"""``freeride plan`` against a measured small run: the demo.

The test runs the real demo (a manager, a simulated 2-stage pipeline whose
stages sleep, a side task per stage), measures its bubbles and what the side
tasks harvested of them, then runs ``freeride plan`` with the same shape and
checks that it reproduces them within 10 %. (The DeepSpeed CPU job's check,
the plan fed with its profile, lives beside that job's run in
test_deepspeed_bubbles.py, which runs it anyway.)

What a side task fills of the bubbles is an input of the plan, measured and
never modelled: the demo test gives the plan the use this run measured, so
what it checks is the bubble time the plan multiplies that use by (per stage
and over the run) and the conversion to harvested time. How the benchmarks'
use figures compare with a run on a loaded machine is in docs/plan.md.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from _quiet import quietest, require_quiet

from freeride.cli.demo import DemoOptions, DemoReport, run_demo
from freeride.cli.main import main

pytestmark = pytest.mark.slow

TOLERANCE = 0.10
DEMO_STEPS = 30


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["plan", *argv, "--json", "--scale", "1024"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def test_plan_reproduces_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    defaults = DemoOptions()

    def attempt(_: int) -> DemoReport:
        report = run_demo(replace(defaults, sim=replace(defaults.sim, steps=DEMO_STEPS)))
        assert report.ok, report.text()
        return report

    report, other = quietest(attempt)
    # the model has no jitter: the waits a late neighbour adds on a shared core are not in it
    require_quiet(other, "the demo")
    sim = report.options.sim
    stages = sorted(report.stages, key=lambda r: r.stage)
    devices = sorted(report.status.devices, key=lambda d: d.stage)
    # the ranks' own clocks: waits over step time, step 0 (start-up) left out
    measured = [sum(r.wait_ns[1:]) / sum(r.step_ns[1:]) for r in stages]
    used_ns = sum(d.used_ns for d in devices)
    use = used_ns / sum(d.bubble_ns for d in devices)
    plan = _plan(
        capsys,
        *("--pp", str(sim.num_stages), "--micro-batches", str(sim.num_microbatches)),
        *("--forward", f"{sim.forward_s}s", "--backward", f"{sim.backward_s}s"),
        *("--task", "graph-sgd", "--use", f"graph-sgd={use}"),
    )
    modelled = [s["bubble_share"] for s in plan["stages"]]
    for stage, (model, seen) in enumerate(zip(modelled, measured, strict=True)):
        assert model == pytest.approx(seen, rel=TOLERANCE), (stage, modelled, measured)
    assert plan["job"]["bubble_share"] == pytest.approx(sum(measured) / len(measured), rel=TOLERANCE)
    # harvested: the plan's GPU-hours per day, over the time the stages trained, against what the tasks did
    gpus = plan["shape"]["gpus"]
    per_gpu_s = plan["job"]["harvested_gpu_h_day"] * 3600 / (gpus * 86_400)
    predicted_ns = per_gpu_s * sum(d.train_ns for d in devices)
    assert predicted_ns == pytest.approx(used_ns, rel=TOLERANCE), (predicted_ns, used_ns, use)
