"""``freeride launch`` finds the node's manager or starts one: real launches, managers and jobs.

The job in most of these is ``freeride status`` itself (it succeeds only if a
manager answers on the runtime dir), or a shell that waits on its stdin, so
that the test decides when the job ends.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import freeride_cmd, poll, serving, status

from freeride.cli.node_manager import serve_lock_pid
from freeride.host.jobs import JOBS_DIR, Job, JobWatch, LaunchLock, live_jobs, register_job

STARTED = re.compile(r"freeride: started a manager \(pid (\d+), log (\S+)\)")
USING = re.compile(r"freeride: using the manager \(pid (\d+)\)")


def _launch(runtime_dir: Path, *args: str, job: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = freeride_cmd("launch", "--runtime-dir", str(runtime_dir), *args, "--", *job)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def _status_job(runtime_dir: Path) -> list[str]:
    return freeride_cmd("status", "--runtime-dir", str(runtime_dir), "--json")


def _alive(pid: int) -> bool:
    return Job.of(pid) is not None


def _stop(pid: int) -> None:
    """Stop a manager a launch started (it is not our child: init reaps it)."""
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        poll(lambda: not _alive(pid), 30, f"manager {pid} to exit")


def test_launch_starts_a_manager_which_exits_after_the_job(runtime_dir: Path) -> None:
    done = _launch(runtime_dir, job=_status_job(runtime_dir))
    assert done.returncode == 0, done.stderr
    assert '"type":"status"' in done.stdout  # the job reached the manager
    started = STARTED.search(done.stderr)
    assert started, done.stderr
    pid, log = int(started[1]), Path(started[2])
    assert log == runtime_dir / "manager.log"
    poll(lambda: not _alive(pid), 30, "the manager to exit once the job ended")
    assert serve_lock_pid(runtime_dir) is None  # a clean exit
    assert "every job of" in log.read_text()
    assert live_jobs(runtime_dir) == []


def test_keep_manager_keeps_it_and_a_later_launch_uses_it(runtime_dir: Path) -> None:
    first = _launch(runtime_dir, "--keep-manager", job=["true"])
    assert first.returncode == 0, first.stderr
    started = STARTED.search(first.stderr)
    assert started and "stays after the job" in first.stderr, first.stderr
    pid = int(started[1])
    try:
        assert status(runtime_dir, timeout_s=30).uptime_ns > 0  # still there after its job
        second = _launch(runtime_dir, job=_status_job(runtime_dir))
        assert second.returncode == 0, second.stderr
        using = USING.search(second.stderr)
        assert using and int(using[1]) == pid, second.stderr
        assert _alive(pid)
    finally:
        _stop(pid)


# Two launches at once on one runtime dir (Slurm starts one per task): without the
# launch lock both saw no manager and both started one, and the second serve was refused.
def test_concurrent_launches_share_one_manager_which_waits_for_both_jobs(runtime_dir: Path) -> None:
    job = ["sh", "-c", f'{" ".join(_status_job(runtime_dir))} > "$0"; cat > /dev/null', ""]
    procs = []
    for i in range(2):
        cmd = freeride_cmd("launch", "--runtime-dir", str(runtime_dir), "--", *job[:3], str(runtime_dir / f"ok{i}"))
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    pid = 0
    try:
        oks = [runtime_dir / f"ok{i}" for i in range(2)]
        poll(lambda: all(ok.exists() and ok.stat().st_size > 0 for ok in oks), 60, "both jobs to reach a manager")
        pid = serve_lock_pid(runtime_dir) or 0
        assert pid and _alive(pid)
        assert len(live_jobs(runtime_dir)) == 2
        first, second = procs
        assert first.stdin is not None and second.stdin is not None
        first.stdin.close()
        assert first.wait(30) == 0
        assert status(runtime_dir, timeout_s=30).uptime_ns > 0  # the other job still runs: the manager stays
        assert _alive(pid)
        second.stdin.close()
        assert second.wait(30) == 0
        poll(lambda: not _alive(pid), 30, "the manager to exit after the last job")
        logs = [p.stderr.read() if p.stderr else "" for p in procs]
        started = [m for log in logs if (m := STARTED.search(log))]
        using = [m for log in logs if (m := USING.search(log))]
        assert len(started) == 1 and len(using) == 1, logs
        assert int(started[0][1]) == int(using[0][1]) == pid
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        if pid:
            _stop(pid)


def test_a_stale_runtime_dir_is_recovered(runtime_dir: Path) -> None:
    with serving(runtime_dir) as dead:
        os.killpg(dead.pid, signal.SIGKILL)  # as a crash: pid in the serve lock, socket files left
        dead.wait()
    assert serve_lock_pid(runtime_dir) == dead.pid and (runtime_dir / "control").exists()
    done = _launch(runtime_dir, job=_status_job(runtime_dir))
    assert done.returncode == 0, done.stderr
    assert '"type":"status"' in done.stdout
    notes = [line for line in done.stderr.splitlines() if "is gone" in line]
    assert notes == [f"freeride: the manager (pid {dead.pid}) of {runtime_dir} is gone; starting a new one"]
    started = STARTED.search(done.stderr)
    assert started, done.stderr
    poll(lambda: not _alive(int(started[1])), 30, "the new manager to exit after the job")


@pytest.mark.parametrize(
    ("serve_args", "says"),
    [
        ("--side-priority bogus", "not options of `freeride serve`"),
        ("--runtime-dir /elsewhere", "give --runtime-dir to launch itself"),
        ("--profile no-such.json", "profile: no such file"),
    ],
)
def test_bad_serve_args_fail_fast_before_anything_starts(runtime_dir: Path, serve_args: str, says: str) -> None:
    done = _launch(runtime_dir, "--serve-args", serve_args, job=["true"])
    assert done.returncode == 2
    assert says in done.stderr, done.stderr
    assert serve_lock_pid(runtime_dir) is None and not (runtime_dir / JOBS_DIR).exists()


def test_a_manager_that_cannot_start_leaves_the_training_running(runtime_dir: Path) -> None:
    # a state dir another user could write to: serve refuses it, the job still runs
    state = runtime_dir / "state-open"
    state.mkdir(mode=0o777)
    os.chmod(state, 0o777)
    done = _launch(runtime_dir, "--serve-args", f"--state-dir {state}", job=["sh", "-c", "echo trained"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trained"
    line = [x for x in done.stderr.splitlines() if x.startswith("freeride: no manager:")]
    assert len(line) == 1 and "exited" in line[0] and "training runs without FreeRide" in line[0], done.stderr


def test_jobs_are_told_apart_from_a_reused_pid(runtime_dir: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        job = register_job(runtime_dir, child.pid)
        assert live_jobs(runtime_dir) == [job]
        stranger = Job(child.pid, job.start_ticks + 1)  # same pid, another process
        assert not stranger.alive()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert live_jobs(runtime_dir, prune=True) == []
    assert os.listdir(runtime_dir / JOBS_DIR) == []


def test_the_watch_waits_for_a_launch_holding_the_lock(runtime_dir: Path) -> None:
    watch = JobWatch(runtime_dir)
    with LaunchLock(runtime_dir) as launch:
        launch.acquire(5)
        assert not watch.done()  # a launch may be registering: not yet
    try:
        assert watch.done()  # no job: done, and the lock is the watch's now
        other = LaunchLock(runtime_dir)
        assert not other.try_acquire()
    finally:
        watch.close()


def test_a_dead_managers_pid_given_to_another_process_is_not_waited_for(runtime_dir: Path) -> None:
    """The lock file still names a crashed manager's pid, which now belongs to an unrelated live process."""
    stranger = subprocess.Popen(["sleep", "120"])
    try:
        (runtime_dir / "serve.lock").write_text(f"{stranger.pid}\n")  # nobody holds its flock
        start = time.monotonic()
        done = _launch(runtime_dir, "--manager-timeout", "30", job=_status_job(runtime_dir))
        assert done.returncode == 0, done.stderr
        assert '"type":"status"' in done.stdout  # a new manager answered the job
        assert time.monotonic() - start < 25, "waited on the stranger"
        assert f"the manager (pid {stranger.pid}) of {runtime_dir} is gone; starting a new one" in done.stderr
        started = STARTED.search(done.stderr)
        assert started, done.stderr
        poll(lambda: not _alive(int(started[1])), 30, "the manager to exit once the job ended")
    finally:
        stranger.kill()
        stranger.wait()
