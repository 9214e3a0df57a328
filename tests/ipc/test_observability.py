"""Traces, metrics and the live status view of a real manager serving a simulated job.

A manager, a two-stage simulated pipeline (a process per stage) and a
:class:`SpinSteps` worker per stage run for real; the trace written through
``ServeConfig.trace`` must be a valid trace-event file in which every side-task
interval sits inside a bubble of its own device, the Prometheus endpoint is
scraped over HTTP, and the watch view is drawn from real status replies.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import socket
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest
from conftest import running_manager, wait_until
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from freeride import __version__
from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline, StageResult
from freeride.observe.metrics import MetricsExporter
from freeride.observe.report import ReportOptions, build_report
from freeride.observe.timeline import load_trace
from freeride.observe.watch import watch
from freeride.serve.config import ServeConfig
from freeride.serve.manager import Manager
from freeride.transport import ControlClient, Endpoints

MS = 1_000_000
STEP_MS = 2.0
SIM_STEPS = 12


def _traceformat() -> ModuleType:
    """The independent trace-format checker that the unit tests use."""
    path = Path(__file__).resolve().parents[1] / "unit" / "_traceformat.py"
    spec = importlib.util.spec_from_file_location("_traceformat", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def run_job(manager: Manager) -> tuple[SimConfig, list[StageResult]]:
    """A SpinSteps task per stage, a simulated job to its end, then the tasks cancelled."""
    sim_config = SimConfig(
        endpoint=manager.config.endpoints.events,
        num_stages=2,
        num_microbatches=4,
        forward_s=0.010,
        backward_s=0.020,
        steps=SIM_STEPS,
    )
    mine: list[int] = []
    for stage in range(2):
        device = sim_config.device(stage)
        manager.declare_device(device, stage=stage, spare_memory=1 << 30, cpu_affinity=[sim_config.core(stage)])
        reply = manager.submit(
            p.IterativeSpec(
                target="_tasks:SpinSteps",
                name=f"spin-{stage}",
                device=device,
                options={"step_ms": STEP_MS},
                step_time_ns=int(STEP_MS * MS),
            )
        )
        assert isinstance(reply, p.Submitted) and reply.device == device
        mine.append(reply.task_id)
    await wait_until(lambda: all(manager.tasks[t].state == "running" for t in mine), 60, "tasks set up")
    sim = SimPipeline(sim_config).start()
    try:
        stages = await asyncio.to_thread(sim.join, 120)
    finally:
        sim.terminate()
    await wait_until(lambda: not manager.live_backends(), 10, "goodbyes")
    for task_id in mine:
        assert isinstance(await manager.cancel(task_id), p.Cancelled)
    return sim_config, stages


async def test_trace_shows_side_task_work_inside_bubbles(runtime_dir: Path) -> None:
    trace_path = runtime_dir / "trace.json"
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir),
        state_dir=runtime_dir / "state",
        checkpoint_every_s=0.2,
        stop_timeout_s=5,
        trace=trace_path,
    )
    stop = asyncio.Event()
    async with Manager(config) as manager:
        runner = asyncio.create_task(manager.run(stop), name="test-manager")
        try:
            sim_config, stages = await run_job(manager)
            status = manager.status()
        finally:
            stop.set()
            await runner
    # the manager has closed its observers: the trace is complete and valid
    events = _traceformat().load_checked(trace_path)

    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    by_device: dict[str, list[tuple[float, float]]] = {}
    # per device, each bubble's span as its start announced it: to the later of its predicted and actual end
    promised: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "bubble":
            start, end = e["ts"], e["ts"] + e["dur"]
            by_device.setdefault(e["args"]["device"], []).append((start, end))
            predicted = start + e["args"]["expected_ns"] / 1000
            promised.setdefault(e["args"]["device"], []).append((start, max(end, predicted)))
    work = [e for e in events if e.get("cat") == "side_task"]
    assert {tracks.get(e["tid"]) for e in events if e.get("cat") == "compute" and e["pid"] == 1} >= {
        f"stage {s} ({sim_config.device(s)})" for s in range(2)
    }

    for d in status.devices:
        # both count every BubbleEnded received (a few early BubbleStarted may have been dropped)
        traced_ns = sum(round((end - start) * 1000) for start, end in by_device[d.device])
        assert traced_ns == pytest.approx(d.bubble_ns, abs=len(by_device[d.device])), f"{d.device}: bubble time"
    late = dict.fromkeys(by_device, 0)
    inside = total = 0.0
    for e in work:
        device, start, end = e["args"]["device"], e["ts"], e["ts"] + e["dur"]
        # A worker starts a step only while what its bubble's start announced is left: a bubble
        # that ends sooner than predicted may see work begin after its end, before the worker
        # hears of it (the manager counts an overrun).
        holders = [b for b, span in zip(by_device[device], promised[device], strict=True) if span[0] <= start < span[1]]
        assert holders, f"side-task work at {start} µs on {device} outside every bubble of that device"
        bubble_end = holders[-1][1]
        # The last step of a grant may end after the bubble (a busy core stretches steps,
        # a revoke takes time to arrive); the manager must then have counted an overrun.
        late[device] += end > bubble_end + 1  # 1 µs of rounding
        inside += max(0.0, min(end, bubble_end) - start)
        total += end - start
    for d in status.devices:
        assert late[d.device] <= d.overruns, f"{d.device}: late work the manager did not count as overruns"
    assert inside / total > 0.5, f"only {inside / total:.0%} of side-task work inside bubbles"

    for t in status.tasks:
        mine = [e for e in work if e["tid"] == t.task_id]
        assert sum(e["args"]["steps"] for e in mine) > 10, f"task {t.name} barely ran"
        assert sum(e["args"]["busy_ns"] for e in mine) == t.busy_ns

    # the report's bubble share matches what the stages measured themselves
    report = build_report(load_trace(trace_path), ReportOptions(warmup_steps=1))
    for s in report.stages:
        result = next(r for r in stages if sim_config.device(r.stage) == s.device)
        measured = sum(result.bubble_ns[1:]) / sum(result.step_ns[1:])
        assert s.steps == SIM_STEPS - 1
        assert s.bubble_share == pytest.approx(measured, abs=0.01)
        # a loose floor: the machine running this test may be busy with more than this job
        assert s.harvested_share is not None and s.harvested_share > 0.2


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = scrape_text(port)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_endpoint_and_live_view(manager: Manager, runtime_dir: Path) -> None:
    exporter = MetricsExporter(port=0, status=manager.status)
    manager.observers.add(exporter)
    try:
        waiting = manager.submit(p.IterativeSpec(target="_tasks:SpinSteps", device="cpu:99"))
        assert isinstance(waiting, p.Submitted) and waiting.device == ""
        await run_job(manager)
        status = manager.status()
        # scrape from another thread: the event loop must stay free to answer the status call
        assert exporter.port is not None
        samples = await asyncio.to_thread(scrape, exporter.port)

        host = socket.gethostname()
        for d in status.devices:
            key = (("device", d.device), ("gpu_uuid", ""), ("hostname", host), ("stage", str(d.stage)))
            assert samples[("freeride_bubble_seconds_total", key)] == pytest.approx(d.bubble_ns / 1e9)
            assert samples[("freeride_bubble_used_seconds_total", key)] == pytest.approx(d.used_ns / 1e9)
            assert samples[("freeride_overruns_total", key)] == d.overruns
            assert samples[("freeride_training_steps_total", key)] == d.steps > 0
        for t in status.tasks:
            key = (
                ("device", t.device),
                ("gpu_uuid", ""),
                ("hostname", host),
                ("name", t.name),
                ("task", str(t.task_id)),
            )
            assert samples[("freeride_side_task_steps_total", key)] == t.steps
            assert samples[("freeride_side_task_busy_seconds_total", key)] == pytest.approx(t.busy_ns / 1e9)
        assert samples[("freeride_pending_tasks", ())] == 1
        latency_count = sum(
            v for (name, _), v in samples.items() if name == "freeride_bubble_start_to_step_seconds_count"
        )
        assert latency_count == status.latency.count > 0
        assert samples[("freeride_events_total", ())] == status.events

        def draw() -> str:
            out = io.StringIO()
            with ControlClient(Endpoints.ipc(runtime_dir).control, timeout_s=10) as client:

                def fetch() -> p.StatusReply:
                    reply = client.request(p.StatusRequest())
                    assert isinstance(reply, p.StatusReply)
                    return reply

                code = watch(fetch, interval_s=0.05, count=2, console=Console(file=out, width=200))
            assert code == 0
            return out.getvalue()

        view = await asyncio.to_thread(draw)
        for d in status.devices:
            assert d.device in view
        for t in status.tasks:
            assert t.name in view
        assert "bubble start -> side-task step" in view
    finally:
        exporter.close()
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(scrape, exporter.port)


async def test_a_served_manager_labels_its_series_for_a_fleet(runtime_dir: Path) -> None:
    """``serve --metrics-port``: every device series says which host and GPU, the build is there, no -1 anywhere."""
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", checkpoint_every_s=0.2, metrics_port=0
    )
    async with running_manager(config) as manager:
        assert manager.metrics_port is not None
        # a device nothing is known about yet: its spare memory is unknown, so it has no spare-memory series
        manager.declare_device("cpu:77", stage=5, spare_memory=-1, cpu_affinity=[])
        await run_job(manager)
        status = manager.status()
        text = await asyncio.to_thread(scrape_text, manager.metrics_port)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [build] = families["freeride_build_info"].samples  # the text format has no info type: a gauge
    assert build.name == "freeride_build_info" and build.value == 1 and build.labels == {"version": __version__}
    per_device = [
        s for f in families.values() for s in f.samples if "device" in s.labels and s.name != "freeride_build_info"
    ]
    assert {s.name for s in per_device} >= {"freeride_bubble_seconds_total", "freeride_side_task_steps_total"}
    assert any(s.name == "freeride_bubble_start_to_step_seconds_count" for s in per_device)  # observer-recorded too
    uuids = {d.device: d.gpu_uuid for d in status.devices}
    for s in per_device:
        assert s.labels["hostname"] == socket.gethostname()
        assert s.labels["gpu_uuid"] == uuids.get(s.labels["device"], "")  # "" on CPU devices, NVML's on GPUs
    spare = {s.labels["device"]: s.value for s in families["freeride_spare_memory_bytes"].samples}
    assert spare == {d.device: d.spare_memory for d in status.devices if d.spare_memory >= 0}
    assert "cpu:77" not in spare and "cpu:77" in uuids
    assert [(s.name, s.labels) for f in families.values() for s in f.samples if s.value == -1] == []
