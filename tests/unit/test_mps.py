"""MpsDaemon and client_env against the stand-in control program (tests/standins/fake_mps_control.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from freeride.gpu.mps import MpsDaemon, MpsError, MpsUnavailable, client_env, torch_memory_fraction

STANDIN = Path(__file__).resolve().parents[1] / "standins" / "fake_mps_control.py"


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    pipe, log = tmp_path / "pipe", tmp_path / "log"
    yield pipe, log
    with contextlib.suppress(OSError, ValueError):
        os.kill(int((pipe / "fake-daemon.pid").read_text()), signal.SIGKILL)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "nvidia-cuda-mps-control"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN}" "$@"\n')
    wrapper.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "GPU-abc"}


def calls(pipe: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (pipe / "fake-calls.jsonl").read_text().splitlines()]


async def test_start_command_sequence_and_quit(dirs: tuple[Path, Path], env: dict[str, str]) -> None:
    pipe, log = dirs
    daemon = MpsDaemon(pipe, log, env=env)
    await daemon.start()
    assert daemon.daemon_pid() is not None and not daemon.joined
    (pipe / "fake-servers.json").write_text(json.dumps({"101": [7, 8]}))

    assert await daemon.get_server_list() == [101]
    assert await daemon.get_client_list(101) == [7, 8]
    await daemon.terminate_client(101, 8)
    assert await daemon.get_client_list(101) == [7]
    with pytest.raises(MpsError, match="terminate_client 101 99"):
        await daemon.terminate_client(101, 99)
    await daemon.quit()
    assert daemon.daemon_pid() is None
    await daemon.quit()  # idempotent

    sent = calls(pipe)
    assert sent[0]["argv"] == ["-d"]
    assert [c["stdin"] for c in sent[1:]] == [
        "get_server_list\n",
        "get_client_list 101\n",
        "terminate_client 101 8\n",
        "get_client_list 101\n",
        "terminate_client 101 99\n",
        "quit\n",
    ]
    assert {(c["pipe"], c["log"]) for c in sent} == {(str(pipe), str(log))}
    assert "control daemon started" in (log / "control.log").read_text()
    assert pipe.stat().st_mode & 0o777 == 0o700


async def test_joins_a_running_daemon_and_leaves_it_running(dirs: tuple[Path, Path], env: dict[str, str]) -> None:
    pipe, log = dirs
    async with MpsDaemon(pipe, log, env=env) as owner:
        async with MpsDaemon(pipe, log, env=env) as guest:
            assert guest.joined
            assert await guest.get_server_list() == []
        assert owner.daemon_pid() is not None
        assert [c["argv"] for c in calls(pipe)].count(["-d"]) == 1
    assert owner.daemon_pid() is None


async def test_missing_binary_says_what_to_do(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    daemon = MpsDaemon(*dirs, env={"PATH": str(empty)})
    with pytest.raises(MpsUnavailable, match="run without --mps or install the NVIDIA driver utilities"):
        await daemon.start()


async def test_daemon_start_failure_is_reported(dirs: tuple[Path, Path], env: dict[str, str]) -> None:
    daemon = MpsDaemon(*dirs, env={**env, "FAKE_MPS_FAIL_START": "1"})
    with pytest.raises(MpsError, match="already running"):
        await daemon.start()


async def test_daemon_that_never_comes_up_times_out(dirs: tuple[Path, Path], env: dict[str, str]) -> None:
    daemon = MpsDaemon(*dirs, env={**env, "FAKE_MPS_SLOW_START": "30"}, timeout_s=0.3)
    with pytest.raises(MpsError, match="did not start"):
        await daemon.start()


async def test_command_errors_and_odd_replies(dirs: tuple[Path, Path], env: dict[str, str]) -> None:
    pipe, log = dirs
    daemon = MpsDaemon(pipe, log, env=env)
    with pytest.raises(RuntimeError, match="before start"):
        await daemon.command("get_server_list")
    async with daemon:
        with pytest.raises(MpsError, match="Unrecognized command"):
            await daemon.command("frobnicate")
        with pytest.raises(MpsError, match="unexpected reply to get_client_list"):
            await daemon.get_client_list(5)
        assert await daemon.command("get_default_device_pinned_mem_limit 0") == "1G"
        os.kill(daemon.daemon_pid() or 0, signal.SIGTERM)  # daemon dies under us
        with pytest.raises(MpsError, match="Cannot find MPS control daemon"):
            await daemon.get_server_list()


def test_client_env_by_index_and_uuid(tmp_path: Path) -> None:
    env = client_env(1, 3 * 1024**3 + 123, pipe_dir=tmp_path)
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=3072M",
        "CUDA_MPS_CLIENT_PRIORITY": "1",
        "FREERIDE_MEMORY_LIMIT": str(3 * 1024**3 + 123),
    }
    env = client_env("GPU-0a1b", 512 << 20, 0, pipe_dir=tmp_path, total_bytes=80 << 30)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "GPU-0a1b=512M"
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "0"
    fraction = float(env["FREERIDE_TORCH_MEMORY_FRACTION"])
    assert fraction == pytest.approx(torch_memory_fraction(512 << 20, 80 << 30), abs=1e-6)
    assert fraction * (80 << 30) < 512 << 20


def test_daemon_client_env_uses_its_pipe_dir(tmp_path: Path) -> None:
    daemon = MpsDaemon(tmp_path / "p", tmp_path / "l")
    assert daemon.client_env(0, 1 << 30)["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "p")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"device": -1}, "device"),
        ({"device": "0,1"}, "device"),
        ({"device": ""}, "device"),
        ({"limit_bytes": 1000}, "limit_bytes"),
        ({"priority": 2}, "priority"),
    ],
)
def test_client_env_rejects_bad_input(tmp_path: Path, kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"device": 0, "limit_bytes": 1 << 30, "priority": 1, **kwargs}
    with pytest.raises(ValueError, match=field):
        client_env(pipe_dir=tmp_path, **args)  # type: ignore[arg-type]


def test_torch_memory_fraction_keeps_headroom() -> None:
    gib = 1 << 30
    assert torch_memory_fraction(8 * gib, 80 * gib) == pytest.approx(8 * gib * 0.95 / (80 * gib))
    assert torch_memory_fraction(256 << 20, gib) == pytest.approx((256 - 64) / 1024)
    assert torch_memory_fraction(32 << 20, gib) == 0.0
    with pytest.raises(ValueError, match="total_bytes"):
        torch_memory_fraction(gib, 0)


_UNDER_UVLOOP = """
import asyncio, json, sys, uvloop
from pathlib import Path
from freeride.gpu.mps import MpsDaemon

async def scenario():
    pipe = Path(sys.argv[1])
    daemon = MpsDaemon(pipe, Path(sys.argv[2]), env=json.loads(sys.argv[3]), timeout_s=5.0)
    await daemon.start()
    (pipe / "fake-servers.json").write_text(json.dumps({"101": [7]}))
    try:
        print(await daemon.get_server_list())
    finally:
        await daemon.quit()

uvloop.run(scenario())
"""


def test_starts_and_answers_under_the_managers_uvloop(dirs: tuple[Path, Path], env: dict[str, str]) -> None:
    """``freeride serve`` runs on uvloop, whose child processes keep copies of their stdout pipe at other
    descriptors. The daemon that ``-d`` leaves behind held them open, so a start that read the program's
    output to its end timed out (the real control program, on an H200) or hung the loop's close (here).
    The stand-in daemonizes as the real one does: it closes 0-2 and keeps the rest."""
    pipe, log = dirs
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_UVLOOP, str(pipe), str(log), json.dumps(env)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[101]"
    assert not (pipe / "nvidia-cuda-mps-control.pid").exists()  # quit
