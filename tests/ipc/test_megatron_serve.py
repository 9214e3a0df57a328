"""The whole path on a real megatron-core job, 1F1B and interleaved: profile, serve, submit, launch.

``freeride profile`` runs the unmodified training script and writes the bubble
profile; ``freeride serve --profile`` knows both devices from it; one iterative
side task is pinned to each stage's device; ``freeride launch`` runs the
training. The side tasks must do their work inside the stages' bubbles, and
training must compute the losses it computes without them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _quiet import OtherWork, require_quiet
from conftest import freeride_cmd, serving, status, submit_spin_steps

from freeride import protocol as p
from freeride.backends.megatron.plan import iterations, megatron_schedule
from freeride.backends.schedule import Durations
from freeride.backends.tracker import schedule_priors
from freeride.profile import load_profile

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "megatron_gpt.py"
STEP_MS = 2.0
MS = 1_000_000
SCHEDULES = {"1f1b": [], "interleaved": ["--schedule", "interleaved", "--vpp", "2"]}


def _train(schedule: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--spawn",
        "2",
        "--compute",
        "sleep",
        "--micro-batches",
        "4",
        *SCHEDULES[schedule],
        *extra,
    ]


def _plain_env() -> dict[str, str]:
    """Without FreeRide variables; PYTHONPATH (the test tasks' folder) stays for the workers."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_")}


def _record(line: str) -> dict[str, Any]:
    try:
        record: dict[str, Any] = json.loads(line)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"not one JSON record: {line!r}") from exc
    return record


def _losses(stdout: str) -> list[float]:
    records = [_record(line) for line in stdout.splitlines() if line.startswith("{") and '"step"' in line]
    return [r["loss"] for r in sorted(records, key=lambda r: r["step"]) if r["loss"] is not None]


Profiled = tuple[Path, list[float]]
"""A profile's path and the losses of the run it was made from."""


@pytest.fixture(scope="module", params=sorted(SCHEDULES))
def schedule(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def job_dir(schedule: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="frmg-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def profiled(job_dir: Path, schedule: str) -> tuple[Path, list[float]]:
    """The profile of a 5-step run, and that run's losses."""
    out = job_dir / "job.profile.json"
    cmd = freeride_cmd(
        "profile", "--runtime-dir", str(job_dir), "--out", str(out), "--", *_train(schedule, "--steps", "5")
    )
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_plain_env())
    assert done.returncode == 0, done.stderr[-4000:]
    return out, _losses(done.stdout)


@pytest.fixture
def served_with_profile(runtime_dir: Path, profiled: Profiled) -> Iterator[None]:
    with serving(runtime_dir, "--profile", str(profiled[0]), env=_plain_env()):
        yield


def test_profile_has_the_bubbles_of_megatrons_schedule(schedule: str, profiled: Profiled) -> None:
    profile = load_profile(profiled[0])
    assert [s.stage for s in profile.stages] == [0, 1]
    first, last = profile.stages
    assert first.device != last.device and first.device.startswith("cpu:")
    assert all(s.framework == "megatron" and s.spare_memory > 0 and s.steps == 4 for s in profile.stages)
    chunks = 2 if schedule == "interleaved" else 1
    plan = megatron_schedule(schedule, 2, 4, chunks, 2)
    durations = Durations(
        forward=tuple(s.forward_ns / 1e9 for s in profile.stages),
        backward=tuple(s.backward_ns / 1e9 for s in profile.stages),
    )
    groups = tuple(iterations(plan, s) for s in range(2))
    for stage in profile.stages:
        priors = schedule_priors(plan, stage.stage, durations, merge_tail=True, groups=groups)
        long = {str(k) for k, ns in priors.items() if ns >= 4 * MS}
        assert long <= {b.key for b in stage.bubbles}, (stage.stage, long, stage.bubbles)
        assert 0.05 < stage.bubble_fraction < 0.5


def test_side_tasks_run_in_the_bubbles_of_a_megatron_job(
    schedule: str, runtime_dir: Path, profiled: Profiled, served_with_profile: None
) -> None:
    devices = load_profile(profiled[0]).devices
    submit_spin_steps(runtime_dir, devices, STEP_MS)

    steps = 20
    load = OtherWork()
    launched = subprocess.run(
        freeride_cmd("launch", "--runtime-dir", str(runtime_dir), "--", *_train(schedule, "--steps", str(steps))),
        capture_output=True,
        text=True,
        timeout=300,
        env=_plain_env(),
    )
    assert launched.returncode == 0, launched.stderr[-4000:]
    losses = _losses(launched.stdout)
    assert len(losses) == steps and losses[:5] == profiled[1]  # side tasks change nothing in training

    reply = status(runtime_dir)
    by_device = {d.device: d for d in reply.devices}
    for device in devices:
        d = by_device[device]
        assert d.steps == steps
        assert d.bubbles >= steps - 1
    tasks = {t.device: t for t in reply.tasks}
    assert all(tasks[device].steps > 0 and tasks[device].state == "running" for device in devices)
    assert isinstance(reply.latency, p.LatencySummary) and reply.latency.count > 0
    # a side task at the lowest priority gets little of a core other work keeps busy, and its steps
    # stretch past their estimates
    require_quiet(load.share(), "the served megatron run")
    for device in devices:
        d = by_device[device]
        # loose: on a shared 2-core machine the side task gets its core only part of the time
        # (bubbles here are 5-30 ms); the benchmark reports the real share
        # of the bubble time offered: a short job's held-back steps can be a large share of it
        assert d.used_ns > 0.15 * d.offered_ns, (device, d.used_ns, d.offered_ns, d.bubble_ns)
        # side work past bubble ends, against the bubble time offered (not the time used: that falls as
        # held-back steps take more of a short job, while the overrun grows with the bubbles' count).
        # Quiet, 3 runs: 0.2-1.9 % (interleaved: 130-190 bubbles, tens of us late each). Steps of 2 ms
        # that ignored the bubbles' ends would leave about 1 ms past each: 11 % (1f1b) to 28 %
        assert d.overrun_ns <= 0.05 * d.offered_ns, (device, d.overrun_ns, d.offered_ns, d.used_ns)
