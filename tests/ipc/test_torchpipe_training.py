"""The whole path on real torch.distributed.pipelining jobs (gloo, CPU): 1F1B, interleaved 1F1B, ZBV.

For each schedule: the unmodified training script runs once without FreeRide
(the reference losses); ``freeride profile`` runs it and writes the bubble
profile; ``freeride serve --profile --trace`` knows both devices from it and
records every announced bubble; one ``SpinSteps`` side task is pinned to each
stage's device; ``freeride launch`` runs the training with ``--recv-timers``,
the script's own timing of torch's p2p waits (a hook of its own around
``_wait_batch_p2p``, outside FreeRide's).

Checked: bubbles reach the manager from every stage, the announced bubbles
cover the measured waits and lie inside them (within 10 %), the losses are
those of the run without FreeRide, and the side tasks get steps.
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
from conftest import freeride_cmd, poll, serving, status

from freeride.observe.timeline import load_trace
from freeride.profile import load_profile

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "torchpipe_gpt.py"
STEP_MS = 2.0
MS = 1_000_000
SCHEDULES = ("1f1b", "interleaved", "zbv")
STEPS = 16
SETTLED = 6
"""Steps from which every long wait is announced: a place is predicted by the least of its last
3 waits (ZBV has no simulated prior), so a place whose first waits were short is announced
only once those have left the history."""


def _train(schedule: str, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--spawn",
        "2",
        "--compute",
        "sleep",
        "--micro-batches",
        "4",
        "--layers",
        "4",
        # long passes: the waits stand well above the jitter of a shared 2-core machine
        "--sleep-forward-ms",
        "10",
        "--sleep-backward-ms",
        "20",
        "--schedule",
        schedule,
        "--steps",
        str(steps),
        *extra,
    ]


def _plain_env() -> dict[str, str]:
    """Without FreeRide variables; PYTHONPATH (the test tasks' folder) stays for the workers."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_")}


def _records(stdout: str) -> list[dict[str, Any]]:
    records = []
    for line in stdout.splitlines():
        if line.startswith("{") and '"step"' in line:
            record: dict[str, Any] = json.loads(line)
            records.append(record)
    return records


def _losses(stdout: str) -> list[float]:
    records = sorted(_records(stdout), key=lambda r: r["step"])
    return [r["loss"] for r in records if r["loss"] is not None]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_plain_env())
    assert done.returncode == 0, done.stderr[-4000:]
    assert "differs from FreeRide's" not in done.stderr, done.stderr[-4000:]  # the plan is the order torch runs
    return done


@pytest.fixture(scope="module", params=SCHEDULES)
def schedule(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def job_dir(schedule: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="frtp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(schedule: str) -> list[float]:
    """The losses of 5 steps without FreeRide."""
    return _losses(_run(_train(schedule, 5)).stdout)


@pytest.fixture(scope="module")
def profiled(job_dir: Path, schedule: str) -> Path:
    out = job_dir / "job.profile.json"
    done = _run(freeride_cmd("profile", "--runtime-dir", str(job_dir), "--out", str(out), "--", *_train(schedule, 5)))
    assert done.stderr.count("[attach] torchpipe rank") == 2, done.stderr[-4000:]
    return out


def test_profile_describes_both_stages(schedule: str, profiled: Path) -> None:
    profile = load_profile(profiled)
    assert [s.stage for s in profile.stages] == [0, 1]
    assert all(s.framework == "torchpipe" and s.steps == 4 for s in profile.stages)
    assert profile.stages[0].device != profile.stages[1].device
    for stage in profile.stages:
        assert stage.bubbles, stage  # every stage of these schedules waits for its neighbour
        assert 0.03 < stage.bubble_fraction < 0.6, (stage.stage, stage.bubble_fraction)


def _inside(spans: list[tuple[int, int]], start: int, end: int) -> int:
    return sum(max(0, min(e, end) - max(s, start)) for s, e in spans)


def test_bubbles_match_waits_and_side_tasks_run_in_them(
    schedule: str, runtime_dir: Path, reference: list[float], profiled: Path
) -> None:
    devices = load_profile(profiled).devices
    trace_path = runtime_dir / "trace.json"
    with serving(runtime_dir, "--profile", str(profiled), "--trace", str(trace_path), env=_plain_env()):
        for device in devices:
            submitted = subprocess.run(
                freeride_cmd(
                    "submit",
                    "--runtime-dir",
                    str(runtime_dir),
                    "_tasks:SpinSteps",
                    "--opt",
                    f"step_ms={STEP_MS}",
                    "--step-time",
                    f"{STEP_MS}ms",
                    "--device",
                    device,
                ),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert submitted.returncode == 0, submitted.stderr
        poll(
            lambda: sum(t.state == "running" for t in status(runtime_dir).tasks) == len(devices),
            90,
            "side tasks set up on both devices",
        )
        launched = _run(
            freeride_cmd("launch", "--runtime-dir", str(runtime_dir), "--", *_train(schedule, STEPS, "--recv-timers"))
        )
        assert "manager reachable" in launched.stderr, launched.stderr[-4000:]
        reply = status(runtime_dir)

    # training computes what it computes alone
    losses = _losses(launched.stdout)
    assert len(losses) == STEPS and losses[: len(reference)] == reference

    # bubbles reached the manager from both stages, and the side tasks ran in them
    by_device = {d.device: d for d in reply.devices}
    tasks = {t.device: t for t in reply.tasks}
    for device in devices:
        d = by_device[device]
        assert d.steps == STEPS and d.bubbles >= STEPS - SETTLED, (device, d.steps, d.bubbles)
        assert d.used_ns > 0, (device, d.used_ns, d.bubble_ns)
        assert tasks[device].steps > 0

    # the announced bubbles against the waits the script measured itself
    trace = load_trace(trace_path)
    records = _records(launched.stdout)
    for stage, device in enumerate(devices):
        announced = trace.devices[device].bubbles
        waits = [
            (t0, t0 + ns)
            for r in records
            if r["rank"] == stage and r["step"] >= SETTLED
            for t0, ns in r["recv"]
            if ns >= 4 * MS
        ]
        assert waits, (stage, records)
        measured = sum(e - s for s, e in waits)
        covered = sum(_inside(announced, s, e) for s, e in waits)
        missed = [
            (r["step"], i, ns // 1000, _inside(announced, t0, t0 + ns) // 1000)
            for r in records
            if r["rank"] == stage and r["step"] >= SETTLED
            for i, (t0, ns) in enumerate(r["recv"])
            if ns >= 4 * MS and _inside(announced, t0, t0 + ns) < 0.9 * ns
        ]
        assert covered >= 0.9 * measured, (stage, covered, measured, missed)
        all_waits = [
            (t0, t0 + ns) for r in records if r["rank"] == stage and r["step"] >= SETTLED for t0, ns in r["recv"]
        ]
        first = min(s for s, _ in all_waits)
        late = [(s, e) for s, e in announced if s >= first]
        outside = sum(e - s for s, e in late) - sum(_inside(late, s, e) for s, e in all_waits)
        assert outside <= 0.1 * sum(e - s for s, e in late), (stage, outside, late)
