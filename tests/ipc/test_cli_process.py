"""The ``freeride`` command as a process: its entry point, exit statuses and stderr.

None of these needs a manager: ``--help``, ``submit --list``, ``report`` and
``launch`` (which only edits the environment and ``exec``s) run on their own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import as_from_a_terminal

FREERIDE = [sys.executable, "-m", "freeride"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FREERIDE, *args], capture_output=True, text=True, timeout=120, check=False)


def test_python_dash_m_freeride_prints_usage() -> None:
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: freeride")
    assert "launch" in done.stdout and "submit" in done.stdout


@pytest.mark.parametrize("command", ["launch", "profile"])
def test_a_typo_in_the_command_is_one_line_and_127(command: str, tmp_path: Path) -> None:
    extra = ["--out", str(tmp_path / "profile.json")] if command == "profile" else []
    done = _run(command, "--runtime-dir", str(tmp_path), *extra, "--", "pythn-no-such-command", "train.py")
    assert done.returncode == 127
    assert done.stderr.splitlines() == [
        "freeride: command 'pythn-no-such-command' not found; check its spelling and that it is on PATH"
    ]


def test_a_command_that_is_not_executable_is_126(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    done = _run("launch", "--runtime-dir", str(tmp_path), "--", str(script))
    assert done.returncode == 126
    assert done.stderr.splitlines() == [f"freeride: command '{script}' is not executable; check its permissions"]


def test_launch_execs_the_command_with_the_hooks_environment(tmp_path: Path) -> None:
    # the lookup before exec must not change what runs: the named program, with FreeRide's environment
    done = _run("launch", "--runtime-dir", str(tmp_path), "--", "sh", "-c", 'echo "$FREERIDE_MODE $0"', "arg")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "emit arg"


# `freeride report trace.json | head -1` once printed a BrokenPipeError traceback.
# The reader here is closed before the command writes anything, so every run
# hits the closed pipe (a reader that leaves after one line races the writer,
# which may have written all its output into the pipe's buffer by then).
@pytest.mark.parametrize("command", ["submit", "report"])
def test_a_closed_stdout_ends_quietly(command: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text('{"traceEvents": []}')
    args = ["submit", "--list"] if command == "submit" else ["report", str(trace)]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [*FREERIDE, *args], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120, check=False
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 141


def test_version() -> None:
    import freeride

    done = _run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"freeride {freeride.__version__}", done


@pytest.mark.parametrize("command", [["status"], ["cancel", "3"]])
def test_no_manager_is_said_at_once_where_no_socket_exists(command: list[str], tmp_path: Path) -> None:
    """The runtime dir comes from ``FREERIDE_RUNTIME_DIR`` here; with no socket in it nothing is waited for."""
    env = {**os.environ, "FREERIDE_RUNTIME_DIR": str(tmp_path)}
    start = time.monotonic()
    done = subprocess.run([*FREERIDE, *command], capture_output=True, text=True, timeout=120, env=env)
    # the interpreter's start-up and imports, not the 5-30 s a reply deadline would take
    assert time.monotonic() - start < 4.0
    assert done.returncode == 3, done
    assert done.stderr.splitlines() == [
        f"freeride: no FreeRide manager runs on ipc://{tmp_path}/control (no socket there); start one with"
        " `freeride serve` (same --runtime-dir) or pass --runtime-dir"
    ]


@pytest.mark.parametrize(
    ("source", "said"),
    [
        (None, "does not exist"),
        ("class Broken(:\n", "invalid syntax"),
        ("import freeride\nclass Other(freeride.IterativeTask):\n    pass\n", "has no 'Mine'"),
    ],
    ids=["missing-file", "syntax-error", "missing-class"],
)
def test_a_bad_task_file_is_one_line_without_traceback(source: str | None, said: str, tmp_path: Path) -> None:
    path = tmp_path / "task.py"
    if source is not None:
        path.write_text(source)
    done = _run("submit", "--runtime-dir", str(tmp_path), f"{path}:Mine")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and said in done.stderr, done.stderr


@pytest.mark.parametrize("command", [["status"], ["cancel", "3"]])
def test_no_manager_is_said_at_once_where_a_gone_managers_socket_is_left(command: list[str], tmp_path: Path) -> None:
    """A manager killed (SIGKILL, a crash) leaves its socket file: nothing listens on it, which a knock tells."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(tmp_path / "control"))  # bound, never listened on, closed: the file stays
    env = {**os.environ, "FREERIDE_RUNTIME_DIR": str(tmp_path)}
    done = subprocess.run([*FREERIDE, *command], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 3, done
    assert done.stderr.splitlines() == [
        f"freeride: no FreeRide manager runs on ipc://{tmp_path}/control (its socket is left from one that has"
        " gone); start one with `freeride serve` (same --runtime-dir) or pass --runtime-dir"
    ]


@pytest.mark.parametrize("after_s", [1.5, 6.0], ids=["while-starting", "while-training"])
def test_ctrl_c_in_the_demo_stops_it_without_a_traceback(after_s: float) -> None:
    """SIGINT to the demo's process group, as a terminal's Ctrl-C sends it: while its
    stages and workers are still starting, and once its job trains.

    The demo starts with SIGINT at its default, as from a terminal, even where this test
    runs with it ignored.
    """
    with subprocess.Popen(
        as_from_a_terminal([sys.executable, "-m", "freeride", "demo", "--steps", "400"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as demo:
        try:
            time.sleep(after_s)
            os.killpg(demo.pid, signal.SIGINT)
            _, err = demo.communicate(timeout=60)
        finally:
            if demo.poll() is None:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
    assert demo.returncode == 130, (demo.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1] == "freeride: interrupted", err[-3000:]
