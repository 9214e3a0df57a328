"""What the manager does with a task's declarations and reports: options checked at submit, the class's
peak memory and device kind honoured, final failures, and the status that explains a starved task."""

from __future__ import annotations

from pathlib import Path

from test_scheduler import MS, Harness, done

from freeride import protocol as p
from freeride.host.memory import meminfo
from freeride.observe.base import Observers
from freeride.serve.config import ServeConfig
from freeride.serve.ranks import DeviceInfo
from freeride.serve.supervisor import Supervisor
from freeride.serve.tasks import TaskRecord
from freeride.transport import Endpoints

TASK_SOURCE = """
from typing import ClassVar, Literal
from freeride.sidetask import IterativeTask


class Declares(IterativeTask):
    peak_memory = 3 << 20
    device_kind: ClassVar[Literal["any", "gpu"]] = "gpu"

    def __init__(self, *, rate: float, name: str = "x", n: int = 1) -> None:
        pass

    def step(self) -> None:
        pass


class Plain(Declares):
    device_kind = "any"
"""


def supervisor(tmp_path: Path, devices: dict[str, DeviceInfo] | None = None) -> Supervisor:
    config = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "s")
    return Supervisor(config, devices=devices or {}, schedulers={}, send=lambda ident, msg: True, observers=Observers())


def task_file(tmp_path: Path) -> Path:
    path = tmp_path / "mytask.py"
    path.write_text(TASK_SOURCE)
    return path


def test_options_that_do_not_match_init_are_rejected_at_submit_with_what_is_accepted(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    reply = sup.submit(p.IterativeSpec(target="pagerank", options={"nodez": 10, "alpha": "high"}))
    assert isinstance(reply, p.Rejected)
    assert "unknown option 'nodez'" in reply.reason and "alpha must be float" in reply.reason
    assert "nodes: int = 100000" in reply.reason  # the accepted options, with types and defaults
    assert sup.tasks == {}


def test_a_missing_required_option_is_rejected(tmp_path: Path) -> None:
    reply = supervisor(tmp_path).submit(p.IterativeSpec(target=f"{task_file(tmp_path)}:Plain"))
    assert isinstance(reply, p.Rejected) and "missing required option 'rate'" in reply.reason


def test_the_short_and_file_forms_are_accepted_and_options_take_the_declared_types(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    for target in ("pagerank", "pagerank:PageRank", "freeride.sidetasks.pagerank:PageRank"):
        reply = sup.submit(p.IterativeSpec(target=target, options={"alpha": 1}))
        assert isinstance(reply, p.Submitted), (target, reply)
        assert sup.tasks[reply.task_id].spec.target == "freeride.sidetasks.pagerank:PageRank"
        assert sup.tasks[reply.task_id].spec.options == {"alpha": 1.0}
    path = task_file(tmp_path)
    reply = sup.submit(p.IterativeSpec(target=f"{path}:Plain", options={"rate": 2, "name": 7}))
    assert isinstance(reply, p.Submitted)
    assert sup.tasks[reply.task_id].spec.options == {"rate": 2.0, "name": "7"}


def test_the_class_peak_memory_counts_when_the_submitter_gives_none(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    target = f"{task_file(tmp_path)}:Plain"
    reply = sup.submit(p.IterativeSpec(target=target, options={"rate": 1.0}))
    assert isinstance(reply, p.Submitted) and sup.tasks[reply.task_id].spec.peak_memory == 3 << 20
    given = sup.submit(p.IterativeSpec(target=target, options={"rate": 1.0}, peak_memory=1 << 30))
    assert isinstance(given, p.Submitted) and sup.tasks[given.task_id].spec.peak_memory == 1 << 30


def test_a_gpu_task_waits_for_a_gpu_and_says_why(tmp_path: Path) -> None:
    cpu = DeviceInfo(name="cpu:0", first_seen_ns=0)
    sup = supervisor(tmp_path, {"cpu:0": cpu})
    target = f"{task_file(tmp_path)}:Declares"
    reply = sup.submit(p.IterativeSpec(target=target, options={"rate": 1.0}))
    assert isinstance(reply, p.Submitted) and reply.device == ""  # never placed on the CPU device
    status = sup.tasks[reply.task_id].status()
    assert status.state == "pending" and "needs a GPU" in status.pending_reason and "cpu:0" in status.pending_reason
    plain = sup.submit(p.IterativeSpec(target=f"{task_file(tmp_path)}:Plain", options={"rate": 1.0}))
    assert isinstance(plain, p.Submitted) and plain.device == "cpu:0"
    pinned = sup.submit(p.IterativeSpec(target=target, options={"rate": 1.0}, device="cpu:0"))
    assert isinstance(pinned, p.Rejected) and "needs a GPU" in pinned.reason


def record(tmp_path: Path, task_id: int = 1) -> TaskRecord:
    task = TaskRecord(task_id=task_id, spec=p.IterativeSpec(target="m:C"), name="t", checkpoint_path=tmp_path / "c")
    task.place("cpu:0")
    return task


def test_a_final_failure_is_not_restarted_and_keeps_its_traceback(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    task = sup.tasks[1] = record(tmp_path)
    tb = "Traceback (most recent call last):\n" + "".join(f'  File "x.py", line {i}\n' for i in range(50))
    sup.on_worker(
        task.ident, p.TaskFailed(task_id=1, error="RuntimeError: no model", traceback=tb + "Boom", final=True)
    )
    assert task.exited(1) is False
    status = task.status()
    assert status.state == "failed" and task.restarts == 0
    assert status.traceback.endswith("Boom") and len(status.traceback.splitlines()) == 20


def test_a_crash_after_setup_is_still_restarted(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    task = sup.tasks[1] = record(tmp_path)
    sup.on_worker(task.ident, p.TaskFailed(task_id=1, error="RuntimeError: step", traceback="tb"))
    assert task.exited(1) is True and task.state == "starting"


def test_progress_carries_estimates_and_waiting_into_status(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    task = sup.tasks[1] = record(tmp_path)
    task.ready()
    sup.on_worker(task.ident, p.Progress(task_id=1, steps=4, estimates={"micro": 2 * MS, "update": -1}, waiting=True))
    status = task.status()
    assert status.estimates == {"micro": 2 * MS, "update": -1} and status.waiting


def test_the_scheduler_counts_each_bubble_a_task_did_not_fit_once_and_says_why() -> None:
    h = Harness()
    h.task(1, 30 * MS)
    for i in range(3):
        b = h.started(20 * MS, index=i)
        h.sched.on_task_changed(h.sched.tasks[0])  # looked at again in the same bubble: not counted twice
        h.ended(b, 20 * MS)
    count, why = h.sched.no_fit(1)
    assert count == 3 and "30 ms" in why and "20 ms" in why
    assert h.sched.no_fit(2) == (0, "")


def test_a_grant_given_back_idle_passes_the_bubble_on() -> None:
    h = Harness()
    waiter, other = h.task(1, 1 * MS), h.task(2, 1 * MS)
    h.started(50 * MS)
    [(first, grant)] = h.grants()
    assert first == 1
    h.report(waiter, done(waiter, grant, reason="idle"))
    assert [t for t, _ in h.grants()] == [1, 2] and other.task_id == 2


def test_status_explains_estimates_bubbles_not_fitted_waits_and_failures() -> None:
    from freeride.cli.status import format_status

    base = {"kind": "iterative", "device": "cpu:0", "steps": 3, "busy_ns": 0}
    tasks = [
        p.TaskStatus(
            task_id=1,
            name="a",
            state="running",
            estimates={"": 2 * MS, "update": 30 * MS},
            no_fit=12,
            no_fit_reason="its step estimate 30 ms > the 20 ms left in the bubble",
            waiting=True,
            **base,  # type: ignore[arg-type]
        ),
        p.TaskStatus(task_id=2, name="b", state="pending", pending_reason="needs a GPU", **base),  # type: ignore[arg-type]
        p.TaskStatus(
            task_id=3,
            name="c",
            state="failed",
            error="RuntimeError: x",
            traceback='  File "t.py", line 3, in setup\nRuntimeError: x',
            **base,  # type: ignore[arg-type]
        ),
    ]
    reply = p.StatusReply(
        devices=[],
        tasks=tasks,
        latency=p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0),
        events=0,
        rejected_frames=0,
        uptime_ns=0,
    )
    text = format_status(reply)
    assert "step estimates: step 2.00 ms, update 0.03 s" in text
    assert "kept out of 12 bubbles: its step estimate 30 ms > the 20 ms left in the bubble" in text
    assert "waiting for its own input" in text
    assert "pending: needs a GPU" in text
    assert 'File "t.py", line 3, in setup' in text


def test_a_task_without_a_peak_is_capped_even_before_its_stage_says_what_it_spares(tmp_path: Path) -> None:
    """A task pinned ahead of training, on devices whose spare memory no stage reported yet: the host's
    available memory shared by the host devices (read from this machine), half of a GPU's free memory
    (NVML's figure is set by hand: there is no GPU here)."""
    devices = {
        "cpu:0": DeviceInfo(name="cpu:0", first_seen_ns=0),
        "cpu:1": DeviceInfo(name="cpu:1", first_seen_ns=0),
        "cuda:0": DeviceInfo(name="cuda:0", first_seen_ns=0, free_memory=8 << 30, device_memory=16 << 30),
    }
    sup = supervisor(tmp_path, devices)
    host = record(tmp_path)
    assert 0 < sup.processes.peak(host) <= meminfo("MemAvailable") // 2 + (64 << 20)
    cap = sup.processes.memory_cap(host)
    assert cap.mechanism == "rlimit_as" and host.memory_cap == sup.processes.peak(host)
    gpu = record(tmp_path, task_id=2)
    gpu.device = "cuda:0"
    assert sup.processes.peak(gpu) == 4 << 30
    devices["cpu:0"].spare_memory = 1 << 30  # once the stage reports, its figure counts
    assert sup.processes.peak(host) == 1 << 30


def test_a_program_without_a_peak_is_capped_like_any_task(tmp_path: Path) -> None:
    """An imperative program declared without a peak: the same default cap as an iterative task (the host's
    available memory shared by the host devices, read from this machine), applied by the same rule."""
    devices = {"cpu:0": DeviceInfo(name="cpu:0", first_seen_ns=0), "cpu:1": DeviceInfo(name="cpu:1", first_seen_ns=0)}
    sup = supervisor(tmp_path, devices)
    program = TaskRecord(task_id=3, spec=p.ProgramSpec(argv=["sleep", "60"]), name="p", checkpoint_path=tmp_path / "c")
    program.place("cpu:0")
    assert program.spec.peak_memory < 0
    cap = sup.processes.memory_cap(program)
    assert cap.mechanism == "rlimit_as" and 0 < program.memory_cap <= meminfo("MemAvailable") // 2 + (64 << 20)
