"""Multi-node launchers under ``freeride launch`` (docs/launchers.md), two "nodes" on one machine.

Each node is a launcher invocation with its own runtime directory, standing
for that node's: torchrun with ``--nnodes 2 --node_rank 0/1`` and a localhost
rendezvous, and DeepSpeed's hostfile launcher with ``--no_ssh --node_rank
0/1`` (DeepSpeed starts nothing remotely then, so no ssh is needed). Each
launch starts its node's manager (kept after the job, to be asked), and each
manager sees exactly its node's pipeline stage.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import freeride_cmd, poll, status

from freeride.cli.node_manager import serve_lock_pid
from freeride.host.jobs import Job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STEPS = 4
STARTED = re.compile(r"freeride: started a manager \(pid (\d+),")


@pytest.fixture
def nodes() -> Iterator[list[Path]]:
    """Two runtime directories, one per "node"; their managers are stopped afterwards."""
    dirs = [Path(tempfile.mkdtemp(prefix=f"fr-n{i}-", dir="/tmp")) for i in range(2)]
    try:
        yield dirs
    finally:
        for d in dirs:
            pid = serve_lock_pid(d)
            if pid is not None and Job.of(pid) is not None:
                os.kill(pid, signal.SIGTERM)
                poll(lambda pid=pid: Job.of(pid) is None, 30, f"manager {pid} to exit")
            shutil.rmtree(d, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_nodes(nodes: list[Path], launcher: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """``freeride launch --keep-manager -- LAUNCHER[i]`` per node, all at once; each one's result."""
    procs = [
        subprocess.Popen(
            freeride_cmd("launch", "--runtime-dir", str(d), "--keep-manager", "--", *cmd),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for d, cmd in zip(nodes, launcher, strict=True)
    ]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return done


def _check_each_node_saw_its_stage(nodes: list[Path], done: list[subprocess.CompletedProcess[str]]) -> None:
    for rank, (d, run) in enumerate(zip(nodes, done, strict=True)):
        assert run.returncode == 0, run.stderr[-4000:]
        assert STARTED.search(run.stderr), run.stderr[-2000:]  # each node's launch started its own manager
        reply = status(d, timeout_s=30)
        assert [dev.stage for dev in reply.devices] == [rank], reply.devices
        (device,) = reply.devices
        assert device.steps == STEPS and device.bubbles > 0, device


def _train_args(script: str) -> list[str]:
    return [str(ROOT / "tools" / "train" / script), "--compute", "sleep", "--steps", str(STEPS)]


def test_torchrun_two_nodes_each_with_its_own_manager(nodes: list[Path]) -> None:
    port = str(_free_port())
    launcher = [
        [
            *[str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1"],
            *["--master_addr", "127.0.0.1", "--master_port", port, *_train_args("torchpipe_gpt.py")],
        ]
        for rank in range(2)
    ]
    _check_each_node_saw_its_stage(nodes, _run_nodes(nodes, launcher))


def test_deepspeed_hostfile_no_ssh_two_nodes_each_with_its_own_manager(nodes: list[Path]) -> None:
    """DeepSpeed's launcher runs the torch pipelining script: what is tested is the launcher's path from
    ``freeride launch`` to the ranks (a DeepSpeed engine's own bubbles cost a JIT build and minutes here;
    tests/ipc/test_deepspeed_serve.py covers them under ``freeride launch``)."""
    hostfile = nodes[0] / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = str(_free_port())
    launcher = [
        [
            *[str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank)],
            *["--master_addr", "127.0.0.1", "--master_port", port, "--no_local_rank"],
            *_train_args("torchpipe_gpt.py"),
        ]
        for rank in range(2)
    ]
    _check_each_node_saw_its_stage(nodes, _run_nodes(nodes, launcher))


def test_profile_stops_a_torchrun_job_without_a_traceback(tmp_path: Path) -> None:
    """torchrun, signalled itself, printed a SignalException traceback (exit 0) that read as a crash: the
    profiler now stops the ranks, which end with status 0, and torchrun ends normally."""
    runtime = tmp_path / "rt"
    out = tmp_path / "job.json"
    job = [
        *[str(BIN / "torchrun"), "--nnodes", "1", "--nproc_per_node", "2", "--master_port", str(_free_port())],
        str(ROOT / "tools" / "train" / "torchpipe_gpt.py"), "--compute", "sleep", "--steps", "300",
    ]  # fmt: skip
    cmd = freeride_cmd("profile", "--runtime-dir", str(runtime), "--out", str(out), "--steps", "3", "--")
    done = subprocess.run([*cmd, *job], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "the job was stopped after 3 steps" in done.stdout, done.stdout[-2000:]
    assert "Traceback" not in done.stderr and "SignalException" not in done.stderr, done.stderr[-4000:]
    assert out.exists()
