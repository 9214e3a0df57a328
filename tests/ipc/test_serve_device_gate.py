"""``freeride serve --device-gate``: a gate page per CUDA device its ranks train on, shown in status, removed at exit.

A real ``freeride serve`` subprocess and a rank (a
:class:`~freeride.backends.session.BackendSession` in this process, over real
sockets) that names its device ``cuda:0``: the manager never touches CUDA, so
the page it makes, and what ``status`` says of it, are the same here as on a
GPU. What a rank and a worker do with the page needs CUDA: the stream
operations are checked through stand-ins in ``tests/unit/test_rank_gate.py``
and ``tests/unit/test_gate_gated.py``, and on a device in ``tests/gpu``.
"""

from __future__ import annotations

import stat
import subprocess
import time
from pathlib import Path

from conftest import freeride_cmd, poll, serving, status

from freeride.backends.session import BackendConfig, BackendSession
from freeride.gpu.bubblegate import GateWord, page_path

MS = 1_000_000


def _train(session: BackendSession, steps: int) -> None:
    for step in range(steps):
        session.bubble_started(step, 5 * MS)
        time.sleep(0.002)
        session.bubble_ended()
        session.step_finished(step, 10 * MS)


def test_the_manager_makes_a_private_gate_page_for_a_cuda_rank_and_removes_it_when_it_exits(runtime_dir: Path) -> None:
    page = page_path(runtime_dir, "cuda:0")
    with serving(runtime_dir, "--device-gate") as proc:
        config = BackendConfig(
            endpoint=f"ipc://{runtime_dir}/events", rank=0, stage=0, num_stages=2, device="cuda:0", framework="test"
        )
        session = BackendSession(config)
        try:
            poll(lambda: (_train(session, 5), page.exists())[1], 30, "the gate page of cuda:0")
            info = page.stat()
            assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == 4096
            word = GateWord.attach(page)  # what a rank and a worker of the device map
            assert word.control() == (0, 0)  # no task armed with a slot
            word.close()
            poll(lambda: any(d.gate for d in status(runtime_dir).devices), 30, "the gate in status")
            [device] = [d for d in status(runtime_dir).devices if d.device == "cuda:0"]
            assert device.gate == "device gate, used by no task yet"
            shown = subprocess.run(
                freeride_cmd("status", "--runtime-dir", str(runtime_dir)), capture_output=True, text=True, timeout=60
            )
            assert "cuda:0     released by the device gate, used by no task yet" in shown.stdout
        finally:
            session.close()
        proc.terminate()
        proc.wait(30)
    assert not page.exists()


def test_without_the_flag_no_page_is_made(runtime_dir: Path) -> None:
    with serving(runtime_dir):
        config = BackendConfig(
            endpoint=f"ipc://{runtime_dir}/events", rank=0, stage=0, num_stages=2, device="cuda:0", framework="test"
        )
        session = BackendSession(config)
        try:
            poll(lambda: (_train(session, 5), bool(status(runtime_dir).devices))[1], 30, "the rank's device")
            assert not page_path(runtime_dir, "cuda:0").exists()
            assert all(d.gate == "" for d in status(runtime_dir).devices)
        finally:
            session.close()
