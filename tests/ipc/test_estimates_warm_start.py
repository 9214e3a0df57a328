"""Step-time estimates outlive a task's run: the next run of the same task starts with them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import HERE, freeride_cmd, wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.serve.manager import Manager

REPO = HERE.parents[1]


@pytest.fixture(autouse=True)
def _this_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers import this checkout's freeride (an installed one may be another's)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(REPO)]))


async def _run_sim(config: SimConfig) -> None:
    sim = SimPipeline(config).start()
    try:
        await asyncio.to_thread(sim.join, 120)
    finally:
        sim.terminate()


async def test_a_task_run_again_knows_its_step_times_before_its_first_bubble(manager: Manager) -> None:
    config = SimConfig(endpoint=manager.config.endpoints.events, steps=40, forward_s=0.005, backward_s=0.010)
    device = config.device(0)
    manager.declare_device(device, stage=0, spare_memory=1 << 30, cpu_affinity=[0])
    spec = p.IterativeSpec(target="_kind_tasks:TwoKinds", device=device, name="warm", options={"step_ms": 1.0})
    first = manager.submit(spec)
    assert isinstance(first, p.Submitted)
    task = manager.tasks[first.task_id]
    await wait_until(lambda: task.state == "running", 60, "setup")
    assert task.estimate_ns == -1  # no hint, nothing measured: its first step would be a probe
    sim = asyncio.create_task(_run_sim(config))
    try:
        await wait_until(lambda: task.steps >= 10, 60, "steps of both kinds")
        assert isinstance(await manager.cancel(first.task_id), p.Cancelled)
    finally:
        await sim
    (kept,) = manager.config.estimates_dir.glob("*.json")
    doc = json.loads(kept.read_text())
    assert doc["key"]["target"] == "_kind_tasks:TwoKinds" and doc["key"]["options"] == {"step_ms": 1.0}
    assert set(doc["kinds"]) == {"a", "b"}

    second = manager.submit(spec)
    assert isinstance(second, p.Submitted)
    again = manager.tasks[second.task_id]
    await wait_until(lambda: again.state == "running", 60, "setup again")
    assert again.estimate_ns >= 1_000_000  # known before any bubble (from the first run): no probe
    log = manager.config.log_dir / f"task-{second.task_id}-warm.log"
    await wait_until(lambda: "measured before" in log.read_text(), 10, "the worker's word on its estimates")


def _profile_task(runtime_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``freeride profile-task ARGS`` with serve's default state dir under ``runtime_dir``."""
    return subprocess.run(
        [*freeride_cmd("profile-task"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)},
    )


def test_profile_task_writes_what_serve_reads_and_prints_a_table(runtime_dir: Path) -> None:
    out = _profile_task(runtime_dir, "_kind_tasks:TwoKinds", "--opt", "step_ms=0.5", "--samples", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["kind", "steps", "median", "p90", "max"]
    rows = {line.split()[0]: line.split() for line in lines[1:3]}
    assert set(rows) == {"a", "b"} and rows["a"][1] == rows["b"][1] == "3"
    (kept,) = (runtime_dir / "freeride" / "state" / "estimates").glob("*.json")
    doc = json.loads(kept.read_text())
    assert doc["key"]["target"] == "_kind_tasks:TwoKinds" and {len(t["recent"]) for t in doc["kinds"].values()} == {3}
    assert str(kept) in out.stdout


def test_profile_task_refuses_a_bad_option_before_running_anything(runtime_dir: Path) -> None:
    out = subprocess.run(
        [*freeride_cmd("profile-task"), "_kind_tasks:TwoKinds", "--opt", "step_sm=1", "--state-dir", str(runtime_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2 and "step_sm" in out.stderr and "its options are: step_ms" in out.stderr
    assert not (runtime_dir / "estimates").exists()


async def test_serve_starts_a_task_with_what_profile_task_measured(manager: Manager) -> None:
    profiled = await asyncio.create_subprocess_exec(
        *freeride_cmd("profile-task"),
        "_kind_tasks:TwoKinds",
        "--opt",
        "step_ms=0.5",
        "--cores",
        "0",
        "--state-dir",
        str(manager.config.state_dir),
        cwd=REPO,
    )
    assert await profiled.wait() == 0
    device = "cpu:0"
    manager.declare_device(device, stage=0, spare_memory=1 << 30, cpu_affinity=[0])
    spec = p.IterativeSpec(target="_kind_tasks:TwoKinds", device=device, options={"step_ms": 0.5})
    reply = manager.submit(spec)
    assert isinstance(reply, p.Submitted)
    task = manager.tasks[reply.task_id]
    await wait_until(lambda: task.state == "running", 60, "setup")
    assert task.estimate_ns >= 500_000  # the same key: no bubble has run, no probe is needed


def test_profile_task_tells_the_task_the_bubble_it_will_be_sized_for(runtime_dir: Path) -> None:
    out = _profile_task(runtime_dir, "_kind_tasks:TellsItsBubble", "--bubble-ms", "12.5", "--samples", "2")
    assert out.returncode == 0, out.stderr
    (kept,) = (runtime_dir / "freeride" / "state" / "estimates").glob("*.json")
    assert set(json.loads(kept.read_text())["kinds"]) == {"bubble12500000"}  # what serve would tell it


async def test_serve_tells_a_task_the_typical_bubble_of_its_profiled_device(runtime_dir: Path) -> None:
    from conftest import running_manager

    from freeride.profile import BubbleProfile, Profile, StageProfile, write_profile
    from freeride.serve.config import ServeConfig
    from freeride.transport import Endpoints

    ms = 1_000_000
    bubbles = [(0, "0F1", 25 * ms), (1, "0B0", 2 * ms), (2, "0B1", 20 * ms)]
    stage = StageProfile(
        stage=0,
        rank=0,
        device="cpu:0",
        framework="deepspeed",
        num_stages=2,
        num_microbatches=4,
        steps=8,
        step_time_ns=300 * ms,
        bubble_ns=47 * ms,
        bubbles=[
            BubbleProfile(index=i, key=k, offset_ns=i * 50 * ms, duration_ns=d, p5_ns=d, p95_ns=d, count=8)
            for i, k, d in bubbles
        ],
    )
    path = runtime_dir / "job.profile.json"
    write_profile(Profile(stages=[stage]), path)
    config = ServeConfig(endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", profile=path)
    async with running_manager(config) as manager:
        reply = manager.submit(p.IterativeSpec(target="_kind_tasks:TellsItsBubble", device="cpu:0"))
        assert isinstance(reply, p.Submitted)
        task = manager.tasks[reply.task_id]
        await wait_until(lambda: task.state == "running", 60, "setup")
        told = config.state_dir / "tasks" / task.name / "told.txt"
        assert told.read_text() == str(25 * ms)  # half the bubble time lies in bubbles of 25 ms or more
