"""What room a node offers the cluster queue (freeride.cluster.offer), and the sweep sample it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freeride import protocol as p
from freeride.cluster.agent import AgentConfig
from freeride.cluster.offer import OfferPolicy, offer, summarize
from freeride.sidetasks.sweep import SweepShard, expected_sum


def _device(name: str, *, alive: bool = True, bubble_ns: int = 300, train_ns: int = 700, spare: int = -1,
            free: int = -1) -> p.DeviceStatus:  # fmt: skip
    return p.DeviceStatus(
        device=name, stage=0, rank=0, framework="sim", alive=alive, bubbles=10 if bubble_ns else 0,
        bubble_ns=bubble_ns, used_ns=100, overruns=0, overrun_ns=0, spare_memory=spare, steps=5,
        free_memory=free, train_ns=train_ns,
    )  # fmt: skip


def _task(task_id: int, device: str, state: p.TaskState = "running") -> p.TaskStatus:
    return p.TaskStatus(task_id=task_id, name=f"t{task_id}", kind="iterative", state=state, device=device, steps=0,
                        busy_ns=0)  # fmt: skip


def _status(devices: list[p.DeviceStatus], tasks: list[p.TaskStatus]) -> p.StatusReply:
    latency = p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0)
    return p.StatusReply(devices=devices, tasks=tasks, latency=latency, events=0, rejected_frames=0, uptime_ns=1)


def test_each_training_device_with_bubbles_offers_its_free_places() -> None:
    status = _status(
        [
            _device("cpu:0", bubble_ns=400, train_ns=600, spare=1 << 30),
            _device("cpu:1", bubble_ns=200, train_ns=800, spare=2 << 30, free=3 << 30),
            _device("cpu:2", alive=False),  # its rank is gone
            _device("cpu:3", bubble_ns=1, train_ns=999),  # under 2 % bubble
            _device("cpu:4", bubble_ns=0),  # no bubbles seen yet
        ],
        [_task(1, "cpu:0"), _task(2, "cpu:1", state="finished")],
    )
    slots = offer(status, OfferPolicy(jobs_per_device=2))
    assert [(s.device, s.spare_memory) for s in slots] == [("cpu:0", 1 << 30), ("cpu:1", 3 << 30), ("cpu:1", 3 << 30)]
    assert slots[0].bubble_share == pytest.approx(0.4)
    # a task still waiting for a device will take one of them
    waiting = _status(status.devices, [*status.tasks, _task(3, "", state="pending")])
    assert len(offer(waiting, OfferPolicy(jobs_per_device=2))) == 2
    summary = summarize(status)
    assert (summary.devices, summary.alive_devices, summary.bubble_ns, summary.tasks_running) == (5, 4, 901, 1)


def test_bad_agent_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="jobs_per_device"):
        OfferPolicy(jobs_per_device=0)
    with pytest.raises(ValueError, match="lease_s must be at least 3 ticks"):
        AgentConfig(node="a", lease_s=1, poll_s=1)
    with pytest.raises(ValueError, match="node"):
        AgentConfig(node="")


def test_the_sweep_sample_resumes_to_the_exact_sum_and_writes_its_result_once(tmp_path: Path) -> None:
    first = SweepShard(shard=1, shards=3, size=1000, chunk=300, out=str(tmp_path))
    first.step()
    second = SweepShard(shard=1, shards=3, size=1000, chunk=300, out=str(tmp_path))
    second.load_state_dict(first.state_dict())
    while not second.done():
        second.step()
    result = json.loads((tmp_path / "shard-1.json").read_text())
    assert int(result["sum"]) == expected_sum(1, 1000) == sum(x * x for x in range(1000, 2000))
    assert result["resumed_from"] == 300
    assert len((tmp_path / "shard-1.log").read_text().splitlines()) == 1
    with pytest.raises(ValueError, match="out must be an absolute"):
        SweepShard(out="relative")
