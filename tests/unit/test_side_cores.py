"""The cores and threads of a side task: its stage's own core, even when the rank was not pinned."""

from __future__ import annotations

from pathlib import Path

from freeride import protocol as p
from freeride.observe.base import Observers
from freeride.serve.config import ServeConfig
from freeride.serve.cores import side_task_cores, stage_position, thread_env
from freeride.serve.ranks import DeviceInfo
from freeride.serve.supervisor import Supervisor
from freeride.serve.tasks import TaskRecord
from freeride.transport import Endpoints

ALL = list(range(8))


def test_a_pinned_rank_keeps_its_core() -> None:
    assert side_task_cores("cpu:3", [3], position=1) == [3]
    assert side_task_cores("cpu:3", [], position=1) == []


def test_an_unpinned_rank_gives_each_stage_its_own_core() -> None:
    assert [side_task_cores(f"cpu:{s}", ALL, position=s) for s in range(3)] == [[0], [1], [2]]
    assert side_task_cores("cpu:9", [4, 2, 6], position=4) == [4]  # modulo the rank's cores, in order


def test_a_gpu_task_keeps_its_rank_cores() -> None:
    assert side_task_cores("cuda:1", ALL, position=1) == ALL


def test_one_thread_per_core() -> None:
    assert thread_env([5]) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert thread_env([]) == {}


def test_stage_position_orders_this_nodes_stages() -> None:
    devices = [
        DeviceInfo(name=f"cpu:{n}", first_seen_ns=0, stage=s, rank=s, declared=True)
        for n, s in ((7, 2), (5, 0), (6, 1))
    ]
    assert [stage_position(d, devices) for d in devices] == [2, 0, 1]
    gone = DeviceInfo(name="cpu:4", first_seen_ns=0, stage=0, rank=9)  # an earlier job's: no rank, not declared
    assert [stage_position(d, [gone, *devices]) for d in devices] == [2, 0, 1]


def test_the_worker_is_assigned_its_stages_core_and_one_thread(tmp_path: Path) -> None:
    """An unmodified training script reports all cores as its own: its side task must not take them all."""
    devices = {
        name: DeviceInfo(name=name, first_seen_ns=0, stage=stage, rank=stage, cpu_affinity=ALL, declared=True)
        for name, stage in (("cpu:0", 0), ("cpu:1", 1))
    }
    config = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "s")
    sent: list[p.ManagerToWorker] = []
    sup = Supervisor(
        config, devices=devices, schedulers={}, send=lambda ident, msg: sent.append(msg) is None, observers=Observers()
    )
    record = TaskRecord(task_id=1, spec=p.IterativeSpec(target="m:C"), name="t", checkpoint_path=tmp_path / "c")
    record.place("cpu:1")
    sup.tasks[1] = record
    sup.on_worker(record.ident, p.WorkerReady(protocol_version=p.PROTOCOL_VERSION, task_id=1, pid=1))
    [assign] = sent
    assert isinstance(assign, p.Assign) and assign.cpu_affinity == [1]
