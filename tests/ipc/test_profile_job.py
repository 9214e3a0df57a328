"""``freeride profile`` on real (simulated-pipeline) jobs, and ``status`` for a job without bubbles.

The simulated pipeline (``freeride sim``) runs real stage processes that wait
on each other through pipes, so its bubbles are real waits; under ``freeride
profile`` each stage records them as a framework adapter does.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from conftest import as_from_a_terminal, freeride_cmd, poll, serving, status

from freeride.profile import load_profile

RUN_TIMEOUT_S = 120
SIM = ["--forward", "5ms", "--backward", "10ms", "--microbatches", "4"]


def _sim(runtime_dir: Path, *extra: str) -> list[str]:
    return freeride_cmd("sim", "--runtime-dir", str(runtime_dir), *SIM, *extra)


def _profile(runtime_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = freeride_cmd("profile", "--runtime-dir", str(runtime_dir), "--out", str(out), *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def test_profile_stops_the_job_after_the_steps_it_needs(runtime_dir: Path) -> None:
    """A 2000-step job (minutes) ends once both stages recorded 4 steps; the picture has both stages."""
    out, picture = runtime_dir / "job.json", runtime_dir / "job.png"
    done = _profile(
        runtime_dir, out, "--steps", "4", "--picture", str(picture), "--", *_sim(runtime_dir, "--steps", "2000")
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the job was stopped after 4 steps" in done.stdout, done.stdout
    profile = load_profile(out)
    assert [s.stage for s in profile.stages] == [0, 1]
    assert all(3 <= s.steps < 100 and s.framework == "sim" and s.bubbles for s in profile.stages)
    assert picture.read_bytes()[:4] == b"\x89PNG"
    # one attach line per rank, in profile mode, with no manager running
    attach = [line for line in done.stderr.splitlines() if "[attach] sim rank" in line]
    assert len(attach) == 2 and all("profile mode: no manager at" in line for line in attach), done.stderr[-3000:]


def test_a_failing_job_leaves_a_partial_profile_and_its_exit_status(runtime_dir: Path) -> None:
    """The job trains 3 steps, then its command fails: the profile is kept, the status passed on."""
    out = runtime_dir / "job.json"
    job = " ".join(_sim(runtime_dir, "--steps", "3")) + "; exit 3"
    done = _profile(runtime_dir, out, "--steps", "10", "--", "sh", "-c", job)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "training command exited with 3: partial profile of 2 stage(s)" in done.stderr, done.stderr[-3000:]
    profile = load_profile(out)
    assert [s.steps for s in profile.stages] == [2, 2]  # 3 steps, the warm-up one left out


def test_a_job_that_recorded_nothing_leaves_no_profile(runtime_dir: Path) -> None:
    out = runtime_dir / "job.json"
    failed = _profile(runtime_dir, out, "--", "sh", "-c", "exit 4")
    assert failed.returncode == 4 and "exited with 4; no profile written" in failed.stderr
    clean = _profile(runtime_dir, out, "--", "true")
    assert clean.returncode == 1 and "recorded no training step; no profile written" in clean.stderr
    assert not out.exists()


def test_status_names_a_job_without_bubbles_and_why_tasks_wait(runtime_dir: Path) -> None:
    """A 1-stage pipeline never waits: status says so per device, and side tasks wait with that reason."""
    with serving(runtime_dir, "--settle", "1s"):
        submit = freeride_cmd(
            "submit", "--runtime-dir", str(runtime_dir), "--wait", "0", "pagerank", "--opt", "nodes=500"
        )
        subprocess.run(submit, check=True, capture_output=True, timeout=60)
        job = subprocess.Popen(  # stopped by SIGINT below, as Ctrl-C would
            as_from_a_terminal(_sim(runtime_dir, "--stages", "1", "--steps", "3000")), stderr=subprocess.PIPE, text=True
        )
        try:
            poll(lambda: any(d.no_bubbles for d in status(runtime_dir).devices), 60, "the device's no-bubble reason")
            reply = status(runtime_dir)
            (device,) = reply.devices
            assert device.no_bubbles == "no pipeline bubbles: pipeline size 1" and device.bubbles == 0
            (task,) = reply.tasks
            assert task.state == "pending" and "the training job has no pipeline bubbles" in task.pending_reason
            shown = subprocess.run(
                freeride_cmd("status", "--runtime-dir", str(runtime_dir)), capture_output=True, text=True, timeout=60
            )
            assert "cpu:0      no pipeline bubbles: pipeline size 1" in shown.stdout, shown.stdout
            assert "pending: the training job has no pipeline bubbles: pipeline size 1" in shown.stdout
            as_json = subprocess.run(
                freeride_cmd("status", "--runtime-dir", str(runtime_dir), "--json"),
                capture_output=True,
                text=True,
                timeout=60,
            )
            data = json.loads(as_json.stdout)
            assert data["devices"][0]["no_bubbles"] == "no pipeline bubbles: pipeline size 1"
            assert "no pipeline bubbles" in data["tasks"][0]["pending_reason"]
        finally:
            job.send_signal(signal.SIGINT)
            try:
                _, err = job.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                job.kill()
                _, err = job.communicate()
    assert err.count("[attach] sim rank 0 stage 0/1") == 1 and "manager reachable" in err, err[-3000:]
