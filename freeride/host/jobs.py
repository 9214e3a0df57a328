"""Training jobs a node's manager serves, for managers that ``freeride launch`` starts.

``freeride launch`` registers its own process (which becomes the training
command when it ``exec``s, keeping its pid) as a file in ``RUNTIME_DIR/jobs``.
A manager started by launch runs with ``serve --exit-with-jobs``: a
:class:`JobWatch` stops it once no registered job is alive any more, and its
side tasks are then checkpointed and stopped as at any other exit.

A job is named by its pid and the kernel's start time of that process
(``/proc/PID/stat``), so a pid used again by an unrelated process never counts
as the job. The file ``keep`` (``launch --keep-manager``) keeps the manager
running after every job has ended.

Starting and stopping race on one lock, ``RUNTIME_DIR/launch.lock``: a launch
holds it while it looks for (or starts) the manager and registers its job; the
watch takes it before it decides that no job is left, and holds it until the
manager has closed. So a launch never registers with a manager that is about
to exit, and never starts a second one beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "JOBS_DIR",
    "KEEP",
    "LAUNCH_LOCK",
    "Job",
    "JobWatch",
    "LaunchLock",
    "keep_manager",
    "live_jobs",
    "register_job",
]

logger = logging.getLogger(__name__)

JOBS_DIR = "jobs"
"""Registered jobs, below the runtime directory."""
KEEP = "keep"
"""A file in the jobs directory that keeps the manager after the last job."""
LAUNCH_LOCK = "launch.lock"
"""Serialises launches and a manager's decision to exit, in the runtime directory."""


@dataclass(frozen=True, slots=True)
class Job:
    """One process of a training job, as the kernel knows it."""

    pid: int
    start_ticks: int
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22)."""

    @property
    def file_name(self) -> str:
        return f"{self.pid}-{self.start_ticks}"

    @classmethod
    def from_file_name(cls, name: str) -> Job | None:
        pid, sep, ticks = name.partition("-")
        if not sep or not pid.isdigit() or not ticks.isdigit():
            return None
        return cls(int(pid), int(ticks))

    @classmethod
    def of(cls, pid: int) -> Job | None:
        """The running process ``pid``, or ``None`` if there is none (or only its zombie)."""
        stat = _read_stat(pid)
        if stat is None:
            return None
        state, ticks = stat
        return None if state in ("Z", "X") else cls(pid, ticks)

    def alive(self) -> bool:
        return Job.of(self.pid) == self


def _read_stat(pid: int) -> tuple[str, int] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = raw[raw.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


def register_job(runtime_dir: Path, pid: int | None = None) -> Job:
    """Register process ``pid`` (default: this one) as a job of the node's manager.

    Call it holding the :class:`LaunchLock`.
    """
    job = Job.of(os.getpid() if pid is None else pid)
    if job is None:
        raise ValueError(f"no running process {pid}")
    jobs = runtime_dir / JOBS_DIR
    jobs.mkdir(mode=0o700, exist_ok=True)
    (jobs / job.file_name).touch(mode=0o600)
    return job


def keep_manager(runtime_dir: Path) -> None:
    """Keep the node's manager after its last job (``launch --keep-manager``)."""
    jobs = runtime_dir / JOBS_DIR
    jobs.mkdir(mode=0o700, exist_ok=True)
    (jobs / KEEP).touch(mode=0o600)


def live_jobs(runtime_dir: Path, *, prune: bool = False) -> list[Job]:
    """The registered jobs still running; with ``prune``, the files of ended ones are removed."""
    jobs = runtime_dir / JOBS_DIR
    try:
        names = sorted(os.listdir(jobs))
    except FileNotFoundError:
        return []
    alive: list[Job] = []
    for name in names:
        job = Job.from_file_name(name)
        if job is None:
            continue
        if job.alive():
            alive.append(job)
        elif prune:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(jobs / name)
    return alive


class LaunchLock:
    """An exclusive ``flock`` on ``RUNTIME_DIR/launch.lock`` (close-on-exec: never inherited)."""

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / LAUNCH_LOCK
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free now."""
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def acquire(self, timeout_s: float) -> None:
        """Take the lock, waiting at most ``timeout_s``.

        Raises:
            TimeoutError: another launch (or a manager closing) held it all along.
        """
        deadline = time.monotonic() + timeout_s
        while not self.try_acquire():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} stayed locked for {timeout_s:g}s")
            time.sleep(0.05)

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> LaunchLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class JobWatch:
    """Stops a manager once the jobs registered with it have ended (``serve --exit-with-jobs``).

    Usage (the lock, once taken, is held until the manager has closed)::

        with JobWatch(runtime_dir) as watch:
            async with Manager(config) as manager, asyncio.TaskGroup() as tg:
                tg.create_task(watch.stop_when_done(stop), name="serve-jobs")
                await manager.run(stop)
    """

    def __init__(self, runtime_dir: Path, *, poll_s: float = 0.5) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.runtime_dir = runtime_dir
        self.poll_s = poll_s
        self._lock = LaunchLock(runtime_dir)

    def done(self) -> bool:
        """Whether no job is left and none can register any more (the lock is then ours for good)."""
        if (self.runtime_dir / JOBS_DIR / KEEP).exists():
            return False
        if not self._lock.try_acquire():
            return False  # a launch is registering a job right now
        if live_jobs(self.runtime_dir, prune=True) or (self.runtime_dir / JOBS_DIR / KEEP).exists():
            self._lock.release()
            return False
        return True

    async def stop_when_done(self, stop: asyncio.Event) -> None:
        """Set ``stop`` once :meth:`done`; return early when ``stop`` is set otherwise."""
        while not stop.is_set():
            if self.done():
                logger.info("[shutdown] manager: every job of %s has ended; stopping", self.runtime_dir)
                stop.set()
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):
                    await stop.wait()

    def close(self) -> None:
        """Release the lock (idempotent): after the manager has closed, a launch may start the next one."""
        self._lock.release()

    def __enter__(self) -> JobWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
