"""Supervisor bookkeeping that needs no process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from freeride import protocol as p
from freeride.observe.base import Observers
from freeride.serve.config import ServeConfig
from freeride.serve.supervisor import Supervisor
from freeride.serve.tasks import TaskRecord
from freeride.transport import Endpoints


def test_non_finite_metrics_are_dropped_so_status_stays_valid_json(tmp_path: Path) -> None:
    config = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "s")
    sup = Supervisor(config, devices={}, schedulers={}, send=lambda ident, msg: True, observers=Observers())
    task = TaskRecord(task_id=1, spec=p.IterativeSpec(target="m:C"), name="t", checkpoint_path=tmp_path / "c")
    sup.tasks[1] = task
    sup.on_worker(task.ident, p.Progress(task_id=1, steps=3, metrics={"loss": math.nan, "acc": 0.5, "x": math.inf}))
    assert task.metrics == {"acc": 0.5} and task.steps == 3
    import msgspec

    reply = msgspec.json.decode(msgspec.json.encode(task.status()), type=p.TaskStatus)
    assert reply.metrics == {"acc": 0.5}


def test_submissions_beyond_the_live_task_cap_are_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A control client cannot fill the manager's memory with tasks that never start."""
    import freeride.serve.supervisor as sup_mod

    monkeypatch.setattr(sup_mod, "MAX_LIVE_TASKS", 3)
    config = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "s")
    sup = Supervisor(config, devices={}, schedulers={}, send=lambda ident, msg: True, observers=Observers())
    spec = p.ProgramSpec(argv=["true"])
    replies = [sup.submit(spec) for _ in range(4)]
    assert [type(r) for r in replies] == [p.Submitted] * 3 + [p.Rejected]
    assert isinstance(replies[-1], p.Rejected) and "at most 3" in replies[-1].reason


def test_a_task_is_warmed_up_only_while_no_rank_trains_on_its_device(tmp_path: Path) -> None:
    """Rehearsing steps outside bubbles takes nothing from training only before it starts."""
    from freeride.serve.ranks import DeviceInfo, _Rank

    config = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "s")
    idle, busy = DeviceInfo(name="cpu:0", first_seen_ns=0), DeviceInfo(name="cpu:1", first_seen_ns=0)
    busy.trainer = _Rank(rank=1, device="cpu:1", pid=4242, last_seen_ns=0)
    devices = {"cpu:0": idle, "cpu:1": busy}
    sup = Supervisor(config, devices=devices, schedulers={}, send=lambda ident, msg: True, observers=Observers())
    assigned = _assignments(sup, tmp_path)
    assert {device: a.warm_up for device, a in assigned.items()} == {"cpu:0": True, "cpu:1": False}


def _assignments(sup: Supervisor, tmp_path: Path) -> dict[str, p.Assign]:
    """What a worker is told on starting, for one task placed on each of the supervisor's devices."""
    assigned = {}
    for task_id, device in enumerate(sup.devices, start=1):
        task = TaskRecord(
            task_id=task_id,
            spec=p.IterativeSpec(target="m:C"),
            name=f"t{task_id}",
            checkpoint_path=tmp_path,
        )
        task.place(device)
        assigned[device] = sup._assignment(task)
    return assigned


def test_a_worker_is_told_the_typical_bubble_of_its_device(tmp_path: Path) -> None:
    """What a task that sizes its steps by the bubbles (``TaskContext.bubble_ns``) learns at its start."""
    from freeride.observe.stats import LatencyRecorder
    from freeride.serve.ranks import DeviceInfo
    from freeride.serve.scheduler import DeviceScheduler

    config = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "s")
    devices = {
        "cpu:0": DeviceInfo(name="cpu:0", first_seen_ns=0, profiled_bubble_ns=25_000_000),
        "cpu:1": DeviceInfo(name="cpu:1", first_seen_ns=0),
    }
    schedulers = {name: DeviceScheduler(name, latency=LatencyRecorder(), margin_ns=0) for name in devices}
    sup = Supervisor(
        config, devices=devices, schedulers=schedulers, send=lambda ident, msg: True, observers=Observers()
    )
    told = {device: a.bubble_ns for device, a in _assignments(sup, tmp_path).items()}
    assert told == {"cpu:0": 25_000_000, "cpu:1": 0}  # profiled; not known yet
