"""``freeride profile`` and the no-bubble status on real DeepSpeed jobs (CPU, gloo).

A 2-stage job given 300 steps is stopped by the profiler once both ranks
recorded 3; a 1-stage job under ``freeride launch`` is named in ``status`` as
a job without pipeline bubbles. Each rank says once that it attached.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from _deepspeed import train_cmd
from conftest import freeride_cmd, poll, serving, status

from freeride.profile import load_profile

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 300
TRAIN = ["--compute", "sleep", "--micro-batches", "4", "--sleep-forward-ms", "2", "--sleep-backward-ms", "4"]


def _train(stages: int, steps: int) -> list[str]:
    return train_cmd("--stages", str(stages), "--steps", str(steps), *TRAIN, ranks=stages)


def test_profile_stops_a_deepspeed_job_after_the_steps_it_needs(runtime_dir: Path) -> None:
    out = runtime_dir / "job.json"
    cmd = freeride_cmd("profile", "--runtime-dir", str(runtime_dir), "--out", str(out), "--steps", "3", "--")
    done = subprocess.run([*cmd, *_train(2, 300)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "the job was stopped after 3 steps" in done.stdout, done.stdout[-2000:]
    # its ranks were stopped, not the launcher: it ended normally, without a traceback
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    steps = [s.steps for s in load_profile(out).stages]
    assert len(steps) == 2 and all(2 <= n < 100 for n in steps), steps
    attach = [line for line in done.stderr.splitlines() if "[attach] deepspeed rank" in line]
    assert len(attach) == 2 and all("profile mode: no manager at" in line for line in attach), done.stderr[-4000:]


def test_status_names_a_one_stage_deepspeed_job(runtime_dir: Path) -> None:
    with serving(runtime_dir):
        cmd = freeride_cmd("launch", "--runtime-dir", str(runtime_dir), "--", *_train(1, 3000))
        job = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            poll(lambda: any(d.no_bubbles for d in status(runtime_dir).devices), 240, "the no-bubble reason")
            (device,) = status(runtime_dir).devices
            assert (device.framework, device.no_bubbles) == ("deepspeed", "no pipeline bubbles: pipeline size 1")
        finally:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                _, err = job.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                _, err = job.communicate()
    assert err.count("[attach] deepspeed rank 0 stage 0/1") == 1 and "manager reachable" in err, err[-4000:]
