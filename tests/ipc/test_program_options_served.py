"""`freeride submit --imperative` options against a real manager, a simulated pipeline and the CLI.

The program runs only inside bubbles; what it saw (its working directory, its
environment) it writes to a file, and its progress reaches status through
either its stdout or a progress file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.serve.manager import Manager

SEEN = (
    "import json, os\n"
    "names = ('FOO', 'CLIENT_ONLY', 'MANAGER_ONLY', 'FREERIDE_SYNC_EVERY', 'CUDA_VISIBLE_DEVICES')\n"
    "seen = {'cwd': os.getcwd(), 'env': {k: os.environ.get(k) for k in names}}\n"
    "open('seen.json', 'w').write(json.dumps(seen))\n"
)
PRINTS = SEEN + "for i in range(1, 6):\n    print(f'step {i} loss {1 / i}', flush=True)\n"
WRITES = SEEN + "for i in range(1, 4):\n    open('p.json', 'w').write(json.dumps({'step': i, 'acc': i / 4}))\n"


@contextlib.asynccontextmanager
async def pipeline(manager: Manager) -> AsyncIterator[str]:
    """A simulated two-stage pipeline training until the block ends; yields stage 0's device."""
    config = SimConfig(endpoint=manager.config.endpoints.events, steps=100_000, forward_s=0.005, backward_s=0.010)
    sim = SimPipeline(config).start()
    try:
        yield config.device(0)
    finally:
        sim.terminate()


async def cli(runtime_dir: Path, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "freeride.cli",
        args[0],
        "--runtime-dir",
        str(runtime_dir),
        *args[1:],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=env,
    )
    async with asyncio.timeout(90):
        out, err = await proc.communicate()
    assert proc.returncode == 0, (out.decode(), err.decode())
    return out.decode()


def task_id(submitted: str) -> int:
    assert submitted.startswith("task "), submitted
    return int(submitted.split()[1])


async def test_a_program_runs_where_and_with_what_it_was_given_and_its_progress_shows(
    manager: Manager, runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client_env = {**os.environ, "CLIENT_ONLY": "the shell's", "CUDA_VISIBLE_DEVICES": "0,1"}
    monkeypatch.setenv("MANAGER_ONLY", "the manager's")  # this process runs the manager
    (tmp_path / "work").mkdir()
    async with pipeline(manager) as device:
        await wait_until(lambda: device in manager.schedulers, 30, "the pipeline's devices")
        pattern = r"step (?P<step>\d+) loss (?P<loss>[\d.]+)"
        args = ("--imperative", "--device", device, "--wait", "0")
        first = await cli(
            runtime_dir,
            "submit",
            *args,
            "--name=prints",
            "--cwd=work",
            "--progress-pattern",
            pattern,
            "--",
            sys.executable,
            "-c",
            PRINTS,
            cwd=tmp_path,
            env=client_env,
        )
        second = await cli(
            runtime_dir,
            "submit",
            *args,
            "--name=writes",
            "--clean-env",
            "--env=FOO=bar",
            "--sync-every=3",
            "--progress-file=p.json",
            "--",
            sys.executable,
            "-c",
            WRITES,
            env=client_env,
        )
        prints, writes = manager.tasks[task_id(first)], manager.tasks[task_id(second)]
        await wait_until(lambda: prints.state == writes.state == "finished", 120, "both programs to finish")
    seen = json.loads((tmp_path / "work" / "seen.json").read_text())
    assert seen["cwd"] == str(tmp_path / "work")
    # the submitting shell's environment, not the manager's
    assert seen["env"]["CLIENT_ONLY"] == "the shell's" and seen["env"]["MANAGER_ONLY"] is None
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == ""  # its device's GPUs (a CPU device: none), not the shell's
    assert prints.steps == 5 and prints.metrics["loss"] == pytest.approx(0.2)
    workdir = manager.config.state_dir / "tasks" / "writes"  # its own directory, by default
    seen = json.loads((workdir / "seen.json").read_text())
    assert seen["cwd"] == str(workdir)
    assert seen["env"] == {
        "FOO": "bar",
        "CLIENT_ONLY": None,
        "MANAGER_ONLY": None,
        "FREERIDE_SYNC_EVERY": "3",
        "CUDA_VISIBLE_DEVICES": "",
    }
    assert writes.steps == 3 and writes.metrics["acc"] == pytest.approx(0.75)
    [shown] = [t for t in manager.status().tasks if t.task_id == prints.task_id]
    assert shown.steps == 5 and shown.metrics["loss"] == pytest.approx(0.2)


async def test_the_manager_refuses_a_working_directory_it_does_not_have(manager: Manager, tmp_path: Path) -> None:
    reply = manager.submit(p.ProgramSpec(argv=["true"], cwd=str(tmp_path / "gone")))
    assert isinstance(reply, p.Rejected) and "is not a directory here" in reply.reason
    reply = manager.submit(p.ProgramSpec(argv=["true"], progress_pattern="(\\d+)"))
    assert isinstance(reply, p.Rejected) and "has no named group" in reply.reason


async def test_cancelling_a_program_says_it_restarts_from_the_beginning(manager: Manager, runtime_dir: Path) -> None:
    manager.declare_device("cpu:0", stage=0, spare_memory=1 << 30, cpu_affinity=[0])
    submitted = await cli(
        runtime_dir, "submit", "--imperative", "--device", "cpu:0", "--wait", "0", "--", "sleep", "600"
    )
    task = manager.tasks[task_id(submitted)]
    await wait_until(lambda: task.state == "running", 30, "the program to start (stopped)")
    said = await cli(runtime_dir, "cancel", str(task.task_id))
    assert "its program is stopped" in said and "starts from the beginning" in said
    assert "checkpoint" not in said
