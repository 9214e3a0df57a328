"""The imperative sample program survives SIGKILL: a rerun finishes the job, losing nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from freeride.sidetasks.imaging_cli import PROGRESS_FILE, main

ARGS = ["--images", "32", "--size", "128", "--seed", "11"]


def _done(out: Path) -> int:
    try:
        return int(json.loads((out / PROGRESS_FILE).read_text())["done"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


@pytest.fixture
def program(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "freeride.sidetasks.imaging_cli", "--out", str(out), *ARGS],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        yield proc, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()


def test_kill_mid_run_then_rerun_matches_a_clean_run(
    program: tuple[subprocess.Popen[bytes], Path], tmp_path: Path
) -> None:
    proc, out = program
    deadline = time.monotonic() + 60
    while _done(out) < 3:
        assert proc.poll() is None, "the program exited before it could be killed"
        assert time.monotonic() < deadline, "no progress within 60 s"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    finished_before_kill = len(list(out.glob("*.pgm")))
    assert 3 <= finished_before_kill < 32, "the kill should land part-way through"

    assert main(["--out", str(out), *ARGS]) == 0
    clean = tmp_path / "clean"
    assert main(["--out", str(clean), *ARGS]) == 0
    names = sorted(p.name for p in clean.glob("*.pgm"))
    assert sorted(p.name for p in out.glob("*.pgm")) == names
    for name in names:
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    assert json.loads((out / PROGRESS_FILE).read_text())["done"] == 32
