"""Profile mode's record of one rank: every step's waits, kept on disk as the run goes.

Both framework adapters hand each finished :class:`~freeride.profile.StepRecord`
to one :class:`ObservationLog`, which rewrites the rank's
:class:`~freeride.profile.RankObservations` file (``rank-<rank>.json``, read by
``freeride profile``) while the job runs and once more when it ends.

Why rewrite while running, and why by time: a profiled job often does not end
cleanly (the launcher tears it down, the OOM killer or a ``SIGKILL`` stops a
rank), and then neither ``atexit`` nor a finalizer runs. Rewriting at most every
``every_ns`` (5 s) bounds what a killed rank loses to that much of the run, while
short steps do not pay for rewriting a growing file each time; the write goes
through a temporary file and ``os.replace``, so a rank killed mid-write leaves
the previous complete file. The rewrite runs after a step's end is taken, so it
adds to no step this rank records; other ranks may see it, at most once per
``every_ns``, as a longer first wait of the next step.

When ``freeride profile`` will stop the job (it named the steps it needs),
each rank also writes its pid (``rank-<rank>.pid``) and exits quietly, with
status 0 and its file written, on the SIGTERM the profiler then sends it: the
launcher (torchrun, ``deepspeed``) sees its ranks end normally instead of being
signalled itself and printing a traceback. A training script's own SIGTERM
handler is left alone.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from freeride.profile import RankObservations, StepRecord, write_observations

__all__ = [
    "ENV_PROFILE_STEPS",
    "MAX_RECORDED_STEPS",
    "WRITE_EVERY_NS",
    "ObservationLog",
    "pid_file",
    "profile_steps_from_env",
]

logger = logging.getLogger(__name__)

MAX_RECORDED_STEPS = 10_000
"""Steps kept per rank; later ones are dropped (the file stays a few MB)."""

WRITE_EVERY_NS = 5_000_000_000
"""Least time between two rewrites of the file while the job runs."""

ENV_PROFILE_STEPS = "FREERIDE_PROFILE_STEPS"
"""Steps ``freeride profile`` needs from each rank: the file is written the moment a rank has them,
so that the profiler can stop the job then."""


def pid_file(directory: Path, rank: int) -> Path:
    """Where a rank in profile mode names its process, for the profiler's SIGTERM."""
    return directory / f"rank-{rank}.pid"


def profile_steps_from_env(environ: dict[str, str] | None = None) -> int:
    """The steps ``freeride profile`` asked for (0: none named, or not a number)."""
    raw = (os.environ if environ is None else environ).get(ENV_PROFILE_STEPS, "")
    try:
        return max(0, int(raw))
    except ValueError:
        return 0


class ObservationLog:
    """Collects one rank's steps in profile mode and keeps its observation file current.

    Args:
        base: Who the rank is (its ``steps`` and ``spare_memory`` are filled in here).
        directory: Where the file goes; None keeps the steps in memory only.
        spare_memory: Reads the device memory the rank leaves free, at each write.
        every_ns: Least time between two rewrites while running.
        clock: Monotonic ns clock (injectable for tests).
        write_at: Also write the moment this many steps are recorded (``freeride profile`` stops
            the job once every rank has them); None reads :data:`ENV_PROFILE_STEPS`, 0 never.
    """

    def __init__(
        self,
        base: RankObservations,
        directory: Path | None,
        *,
        spare_memory: Callable[[], int] = lambda: -1,
        every_ns: int = WRITE_EVERY_NS,
        clock: Callable[[], int] = time.monotonic_ns,
        write_at: int | None = None,
    ) -> None:
        self._base = base
        self._write_at = profile_steps_from_env() if write_at is None else write_at
        self._directory = directory
        self._spare_memory = spare_memory
        self._every_ns = every_ns
        self._clock = clock
        self._written_ns: int | None = None
        self._closed = False
        self.steps: list[StepRecord] = []
        if directory is not None:
            atexit.register(self.close)
            if self._write_at > 0:
                self._stop_quietly_on_sigterm(directory)

    def _stop_quietly_on_sigterm(self, directory: Path) -> None:
        """Name this process to the profiler, and end it with status 0 on its SIGTERM (see the module)."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return  # the training script handles SIGTERM itself
            signal.signal(signal.SIGTERM, self._quiet_exit)
            path = pid_file(directory, self._base.rank)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, path)
        except (OSError, ValueError):
            logger.debug("[profile] cannot arrange a quiet stop", exc_info=True)

    def _quiet_exit(self, signum: int, frame: object) -> None:
        try:
            self.close()
        finally:
            os._exit(0)

    def add(self, record: StepRecord) -> None:
        """Keep ``record``; rewrite the file if the last write is ``every_ns`` old (or none was made)."""
        if len(self.steps) < MAX_RECORDED_STEPS:
            self.steps.append(record)
        now = self._clock()
        due = self._written_ns is None or now - self._written_ns >= self._every_ns
        if due or len(self.steps) == self._write_at:
            self._written_ns = now
            self.write()

    def observations(self) -> RankObservations:
        """What the rank has recorded so far."""
        try:
            spare = self._spare_memory()
        except Exception:
            logger.exception("[profile] cannot read spare memory")
            spare = -1
        return msgspec.structs.replace(self._base, steps=list(self.steps), spare_memory=spare)

    def write(self) -> Path | None:
        """Write the file now (never raises); returns its path, or None if nothing was written."""
        if self._directory is None or not self.steps:
            return None
        try:
            path = write_observations(self.observations(), self._directory)
        except Exception:
            logger.exception("[profile] rank %d: cannot write observations to %s", self._base.rank, self._directory)
            return None
        logger.debug("[profile] rank %d: %d steps written to %s", self._base.rank, len(self.steps), path)
        return path

    def close(self) -> None:
        """Write the file a last time (idempotent; also run at exit)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        path = self.write()
        if path is not None:
            logger.info("[profile] rank %d: %d steps written to %s", self._base.rank, len(self.steps), path)
