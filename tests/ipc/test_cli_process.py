"""The ``freeride`` command as a process: its entry point, exit statuses and stderr.

None of these needs a manager: ``--help``, ``submit --list``, ``report`` and
``launch`` (which only edits the environment and ``exec``s) run on their own.
"""

from __future__ import annotations

import subprocess
import sys

FREERIDE = [sys.executable, "-m", "freeride"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FREERIDE, *args], capture_output=True, text=True, timeout=120, check=False)


def test_python_dash_m_freeride_prints_usage() -> None:
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: freeride")
    assert "launch" in done.stdout and "submit" in done.stdout
