"""``freeride serve --mps`` as a real process against the stand-in control program (no GPU here).

The manager runs on uvloop; the daemon its control program leaves behind must
not hold the pipe the manager reads that program's output from (on an H200
the real daemon did, and the manager's start timed out after 10 s). The
stand-in daemonizes as the real one does (tests/standins/fake_mps_control.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import freeride_cmd, serving, status

STANDIN = Path(__file__).resolve().parents[1] / "standins" / "fake_mps_control.py"


def _path_with_standin(bin_dir: Path) -> dict[str, str]:
    bin_dir.mkdir()
    wrapper = bin_dir / "nvidia-cuda-mps-control"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN}" "$@"\n')
    wrapper.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_serve_with_mps_starts_its_daemon_and_quits_it(runtime_dir: Path, tmp_path: Path) -> None:
    env = _path_with_standin(tmp_path / "bin")
    pipe = runtime_dir / "state" / "mps"
    try:
        with serving(runtime_dir, "--mps", env=env) as proc:
            assert status(runtime_dir).devices is not None  # answering, its daemon up
            assert (pipe / "nvidia-cuda-mps-control.pid").exists()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        assert not (pipe / "nvidia-cuda-mps-control.pid").exists()  # quit on shutdown
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((pipe / "fake-daemon.pid").read_text()), signal.SIGKILL)


def test_serve_with_mps_and_no_control_program_says_so(runtime_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    env = {**os.environ, "PATH": str(tmp_path / "empty")}
    done = subprocess.run(
        freeride_cmd("serve", "--runtime-dir", str(runtime_dir), "--mps"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "freeride: nvidia-cuda-mps-control not found on PATH: run without --mps or install the NVIDIA driver utilities"
    )
