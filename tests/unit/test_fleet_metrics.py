"""The Prometheus metrics as a GPU fleet reads them: host and GPU labels, the build, no sentinel values."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client.metrics_core import Metric

from freeride import __version__
from freeride import protocol as p
from freeride.gpu.nvml import NvmlMonitor
from freeride.observe.metrics import MetricsExporter, StatusCollector

UUID = "GPU-5b9c3e1a-0f2d-4c1e-9a77-2d1f0c6b8e11"


def _uuid(device: str) -> str:
    return UUID if device.startswith("cuda:") else ""


def _device(name: str, *, stage: int = 0, spare_memory: int = 1 << 30, margin_ns: int = 300_000) -> p.DeviceStatus:
    gpu_uuid = _uuid(name)
    return p.DeviceStatus(
        device=name, stage=stage, rank=stage, framework="sim", alive=True, bubbles=10, bubble_ns=10**9,
        used_ns=5 * 10**8, overruns=1, overrun_ns=10**6, spare_memory=spare_memory, steps=10, margin_ns=margin_ns,
        gpu_uuid=gpu_uuid,
    )  # fmt: skip


def status(*devices: p.DeviceStatus) -> p.StatusReply:
    """A status with every kind of series: devices, a task on each with a metric, a pending one, a measured job."""
    tasks = [
        p.TaskStatus(
            task_id=i,
            name=f"t{i}",
            kind="iterative",
            state="running",
            device=d.device,
            steps=7,
            busy_ns=10**8,
            metrics={"loss": 0.5},
        )
        for i, d in enumerate(devices)
    ]
    tasks.append(
        p.TaskStatus(task_id=99, name="waiting", kind="iterative", state="pending", device="", steps=0, busy_ns=0)
    )
    cost = p.TrainingCost(job="gpt", steps=100, pairs=8, slowdown=0.002, low=-0.001, high=0.004, coverage=0.96)
    return p.StatusReply(
        devices=list(devices),
        tasks=tasks,
        latency=p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0),
        events=3,
        rejected_frames=0,
        uptime_ns=10**9,
        costs=[cost],
    )


def _families(reply: p.StatusReply) -> dict[str, Metric]:
    return {f.name: f for f in StatusCollector(lambda: reply, dict, hostname="node7").collect()}


def exported(reply: p.StatusReply) -> Iterator[Metric]:
    """Every family a manager exports for ``reply``: the status ones and those recorded from grants."""
    exporter = MetricsExporter(port=None, status=lambda: reply, hostname="node7", gpu_uuid=_uuid)
    try:
        for d in reply.devices:
            done = p.GrantDone(
                task_id=0, grant_id=1, steps=2, busy_ns=1000, first_step_delay_ns=200, overrun_ns=0, reason="expired"
            )
            exporter.grant_done(d.device, 0, "t0", done)
        yield from exporter.registry.collect()
    finally:
        exporter.close()


def test_every_device_series_names_its_host_and_gpu() -> None:
    reply = status(_device("cuda:0"), _device("cpu:1", stage=1))
    uuid_of = {"cuda:0": UUID, "cpu:1": "", "": ""}  # "": the pending task, on no device yet
    per_device = [s for f in exported(reply) for s in f.samples if "device" in s.labels]
    assert {s.name for s in per_device} >= {
        "freeride_bubble_used_seconds_total",
        "freeride_side_task_steps_total",
        "freeride_bubble_start_to_step_seconds_bucket",
        "freeride_grants_total",
    }
    for s in per_device:
        assert s.labels["hostname"] == "node7", s
        assert s.labels["gpu_uuid"] == uuid_of[s.labels["device"]], s


def test_the_build_is_a_gauge_of_one() -> None:
    [build] = [f for f in exported(status()) if f.name == "freeride_build"]
    [sample] = build.samples
    assert (sample.name, sample.labels, sample.value) == ("freeride_build_info", {"version": __version__}, 1.0)


def test_an_unknown_value_is_left_out_not_minus_one() -> None:
    unknown = _device("cuda:0", spare_memory=-1, margin_ns=-1)
    families = _families(status(unknown, _device("cpu:1", stage=1)))
    assert [s.labels["device"] for s in families["freeride_spare_memory_bytes"].samples] == ["cpu:1"]
    assert [s.labels["device"] for s in families["freeride_margin_seconds"].samples] == ["cpu:1"]
    assert [s for f in families.values() for s in f.samples if s.value == -1] == []
    # a device whose stage is not known yet has an empty stage label, not "-1"
    nameless = _families(status(_device("cpu:2", stage=-1)))
    assert {s.labels["stage"] for s in nameless["freeride_bubble_seconds"].samples} == {""}


class _Nvml:
    class NVMLError(Exception):
        pass


@pytest.mark.parametrize(
    ("device", "uuid"), [("cuda:0", "GPU-a"), ("cuda:1", "GPU-b"), ("cuda:2", ""), ("cpu:0", ""), ("cuda:x", "")]
)
def test_a_devices_uuid_is_nvmls_of_the_same_index(device: str, uuid: str) -> None:
    monitor = NvmlMonitor(_Nvml(), [object(), object()], ["GPU-a", "GPU-b"])
    assert monitor.uuid_of(device) == uuid
