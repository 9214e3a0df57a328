"""The commands a benchmark runs (its job, ``freeride profile``, ``serve``, ``launch``) and their environment."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

# tools/bench is the script's directory: the harness's parts import by their bare names
from _bench_options import SidePriority
from _bench_tasks import ROOT, Job

__all__ = ["PROFILE_STEPS", "freeride_cmd", "plain_env", "profile_job", "run_cmd", "serve_cmd"]

PROFILE_STEPS = 8
"""Steps of the profiling run."""


def freeride_cmd(*args: str) -> list[str]:
    """``freeride ARGS...`` run by this interpreter."""
    return [sys.executable, "-m", "freeride.cli", *args]


def plain_env() -> dict[str, str]:
    """The environment of every process the benchmark starts: none of ours, and this checkout's code.

    ``PYTHONPATH`` names this checkout: a job script run by path, and the workers
    ``serve`` starts with ``python -P``, would otherwise import ``freeride`` and
    ``backends`` from wherever the package is installed (an editable install of
    another checkout), not the code under test.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def run_cmd(cmd: list[str], *, job: str = "") -> tuple[str, float]:
    """Run ``cmd`` to its end in :func:`plain_env` (``FREERIDE_JOB=job`` if given); its stdout and wall seconds.

    Raises:
        RuntimeError: it exited non-zero; the message ends with its stderr's tail.
    """
    t0 = time.monotonic()
    env = plain_env() | ({"FREERIDE_JOB": job} if job else {})
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return done.stdout, time.monotonic() - t0


def serve_cmd(runtime: Path, profile: Path, side_priority: SidePriority, *, supported: bool = True) -> list[str]:
    """``freeride serve`` for the benchmark; ``supported``: whether this serve knows ``--side-priority``."""
    cmd = freeride_cmd("serve", "--runtime-dir", str(runtime), "--profile", str(profile))
    if supported:
        cmd += ["--side-priority", side_priority]
    return cmd


def profile_job(job: Job, runtime: Path) -> Path:
    """Profile ``job`` (by ``freeride profile``, or by itself) into ``runtime``; the profile's path."""
    path = runtime / "profile.json"
    if job.profiles_itself:
        run_cmd([*job.cmd(PROFILE_STEPS), "--profile-out", str(path)])
    else:
        run_cmd(
            freeride_cmd("profile", "--runtime-dir", str(runtime), "--out", str(path), "--", *job.cmd(PROFILE_STEPS))
        )
    return path
