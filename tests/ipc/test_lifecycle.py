"""`freeride serve` shuts down cleanly on SIGINT/SIGTERM; tasks survive crashes and cancels."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import freeride_cmd, poll, status, wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.serve.manager import Manager


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry.name))
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_stops_cleanly_and_leaves_no_child(served: subprocess.Popen[bytes], runtime_dir: Path, sig: int) -> None:
    sim = subprocess.Popen(
        [
            *freeride_cmd("sim"),
            "--runtime-dir",
            str(runtime_dir),
            "--steps",
            "1000",
            "--forward",
            "5ms",
            "--backward",
            "10ms",
        ],
        start_new_session=True,
    )
    try:
        poll(lambda: len(status(runtime_dir).devices) == 2, 30, "the simulated ranks")
        for device in ("cpu:0", "cpu:1"):
            subprocess.run(
                [*freeride_cmd("submit"), "--runtime-dir", str(runtime_dir), "_tasks:SpinSteps", "--device", device],
                check=True,
            )
        poll(lambda: all(t.state == "running" for t in status(runtime_dir).tasks), 60, "running workers")
        workers = _children(served.pid)
        assert len(workers) == 2
        served.send_signal(sig)
        assert served.wait(30) == 0
        for pid in workers:
            poll(lambda pid=pid: not Path(f"/proc/{pid}").exists(), 10, f"worker {pid} gone")  # type: ignore[misc]
        logs = [log.read_text() for log in (runtime_dir / "state" / "logs").glob("task-*.log")]
        assert len(logs) == 2 and all("stopped (manager shutting down)" in text for text in logs), logs
        # its sockets go with it: a client finds no file, and says so without waiting for a reply
        assert not any((runtime_dir / name).exists() for name in ("events", "control", "workers"))
    finally:
        os.killpg(sim.pid, signal.SIGKILL)
        sim.wait()


async def _run_sim(config: SimConfig) -> None:
    sim = SimPipeline(config).start()
    try:
        await asyncio.to_thread(sim.join, 120)
    finally:
        sim.terminate()


async def test_a_crashed_task_restarts_from_its_checkpoint(
    manager: Manager, tmp_path: Path, resumed_steps: dict[int, list[int]]
) -> None:
    config = SimConfig(endpoint=manager.config.endpoints.events, steps=150, forward_s=0.005, backward_s=0.010)
    device = config.device(0)
    manager.declare_device(device, stage=0, spare_memory=1 << 30, cpu_affinity=[0])
    log = tmp_path / "steps.json"
    reply = manager.submit(
        p.IterativeSpec(
            target="_tasks:CrashOnce",
            device=device,
            options={"crash_at": 40, "marker": str(tmp_path / "crashed"), "step_ms": 1.0, "log": str(log)},
        )
    )
    assert isinstance(reply, p.Submitted)
    task = manager.tasks[reply.task_id]
    await wait_until(lambda: task.state == "running", 60, "setup")
    sim = asyncio.create_task(_run_sim(config))
    try:
        await wait_until(lambda: task.restarts == 1, 60, "the crash and restart")
        await wait_until(lambda: task.state == "running", 60, "the restarted worker")
        resumed = resumed_steps[task.task_id]
        assert len(resumed) == 2 and resumed[0] == 0
        restored = resumed[1]
        assert restored > 0, "the restarted task lost its progress"
        await wait_until(lambda: task.steps > 45, 60, "progress after the restart")
    finally:
        await sim
    # why it restarted, not an error of the task running again; and the steps it went back over
    assert "exited with code 17" in task.restart_reason and task.error == ""
    assert 0 <= task.lost_steps <= 40 - restored  # what the manager had heard of, past the checkpoint
    await manager.cancel(task.task_id)
    assert json.loads(log.read_text())["count"] > 45


async def test_a_cancelled_task_resumes_when_submitted_again(manager: Manager) -> None:
    config = SimConfig(endpoint=manager.config.endpoints.events, steps=30, forward_s=0.005, backward_s=0.010)
    device = config.device(0)
    manager.declare_device(device, stage=0, spare_memory=1 << 30, cpu_affinity=[0])
    spec = p.IterativeSpec(target="_tasks:SpinSteps", device=device, name="resumable", options={"step_ms": 1.0})
    first = manager.submit(spec)
    assert isinstance(first, p.Submitted)
    await wait_until(lambda: manager.tasks[first.task_id].state == "running", 60, "setup")
    await _run_sim(config)
    done_before = manager.tasks[first.task_id].steps
    assert done_before > 5
    assert isinstance(await manager.cancel(first.task_id), p.Cancelled)
    assert manager.tasks[first.task_id].state == "cancelled"
    assert (manager.config.checkpoint_dir / "resumable.pt").is_file()

    second = manager.submit(spec)
    assert isinstance(second, p.Submitted)
    await wait_until(lambda: manager.tasks[second.task_id].state == "running", 60, "setup again")
    assert manager.tasks[second.task_id].steps == done_before


def test_cli_against_a_running_manager(served: subprocess.Popen[bytes], runtime_dir: Path) -> None:
    rd = ["--runtime-dir", str(runtime_dir)]
    bad = subprocess.run([*freeride_cmd("submit"), *rd, "no_such_module:Task"], capture_output=True, text=True)
    assert bad.returncode == 2 and "cannot import module 'no_such_module'" in bad.stderr
    ok = subprocess.run(
        [*freeride_cmd("submit"), *rd, "_tasks:SpinSteps", "--opt", "step_ms=1.5"], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "task 1 submitted; waiting for a device" in ok.stdout
    out = subprocess.run([*freeride_cmd("status"), *rd, "--json"], capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    assert doc["tasks"][0]["state"] == "pending" and doc["devices"] == []
    human = subprocess.run([*freeride_cmd("status"), *rd], capture_output=True, text=True, check=True).stdout
    assert "SpinSteps" in human and "pending" in human
    filler = subprocess.run(
        [*freeride_cmd("submit"), *rd, "_tasks:SpinSteps", "--name", "filler", "--fill"], capture_output=True, text=True
    )
    assert filler.returncode == 0, filler.stderr
    out = subprocess.run([*freeride_cmd("status"), *rd, "--json"], capture_output=True, text=True, check=True).stdout
    assert [t["fill"] for t in json.loads(out)["tasks"]] == [False, True]
    human = subprocess.run([*freeride_cmd("status"), *rd], capture_output=True, text=True, check=True).stdout
    assert "filler (fill)" in human
    cancel = subprocess.run([*freeride_cmd("cancel"), *rd, "1"], capture_output=True, text=True)
    assert cancel.returncode == 0 and "cancelled" in cancel.stdout
    again = subprocess.run([*freeride_cmd("cancel"), *rd, "1"], capture_output=True, text=True)
    assert again.returncode == 2 and "already cancelled" in again.stderr


def test_cli_says_what_to_do_without_a_manager(runtime_dir: Path) -> None:
    out = subprocess.run(
        [*freeride_cmd("status"), "--runtime-dir", str(runtime_dir), "--timeout", "0.5"], capture_output=True, text=True
    )
    assert out.returncode == 3 and "freeride serve" in out.stderr
