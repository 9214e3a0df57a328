"""``freeride profile``: run a training command in profile mode, stop it once it has enough, keep what it measured.

The ranks write their observations (:mod:`freeride.backends.observations`) into a
temporary directory; this module watches that directory and, once every rank
of every stage has recorded ``steps`` training steps, ends the job: SIGTERM to
each rank that named its process (they end with status 0, so the launcher
ends normally, without a traceback), then, if the job is still running after
a grace period, SIGTERM to the job's process group (it runs in a session of
its own, so ``deepspeed``, ``torchrun`` and every rank they started get it)
and SIGKILL. The profile is then built from the files, which is also what happens
when the job ends on its own, successfully or not: a job that crashes after
some steps still leaves a (partial) profile, and its exit status is passed on::

    outcome = run_profile(ProfileOptions(command=["torchrun", ...], out=Path("job.json"), events=endpoint))
    print(outcome.message)
    sys.exit(outcome.exit_code)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from freeride.backends.launch import launch_env
from freeride.backends.observations import ENV_PROFILE_STEPS
from freeride.host.procs import descends_from
from freeride.profile import Profile, RankObservations, build_profile, read_observations, write_profile

__all__ = [
    "DEFAULT_PROFILE_STEPS",
    "ProfileOptions",
    "ProfileOutcome",
    "enough_steps",
    "run_profile",
    "without_pipeline",
]

logger = logging.getLogger(__name__)

DEFAULT_PROFILE_STEPS = 10
"""Training steps each rank runs under ``freeride profile`` by default (the first is left out as warm-up)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    """One ``freeride profile`` run."""

    command: Sequence[str]
    """The training command, as a list of words."""
    out: Path
    """Where the profile goes."""
    events: str
    """The manager's events endpoint (events go there as under ``freeride launch``)."""
    steps: int = DEFAULT_PROFILE_STEPS
    """Stop the job once every rank recorded this many steps; 0 runs it to its end."""
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    """The environment to run it in (FreeRide's variables are added)."""
    poll_s: float = 0.2
    """How often the observation files are looked at."""
    grace_s: float = 20.0
    """After SIGTERM, how long the job may take to end before SIGKILL."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError(
                "command: give the training command after --, e.g. freeride profile --out job.json -- torchrun ..."
            )
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {self.poll_s}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOutcome:
    """What a profile run came to."""

    exit_code: int
    """What ``freeride profile`` exits with: the job's status, or 0 when the job was stopped
    by us after enough steps; 1 when nothing at all was recorded after a clean exit."""
    job_exit_code: int
    """The training command's own status (negative: ended by that signal)."""
    stopped: bool
    """Whether we ended the job after enough steps."""
    profile: Profile | None
    """What was written to ``out`` (None: nothing was recorded)."""
    message: str
    """One line for the user."""

    @property
    def partial(self) -> bool:
        """A profile was written, but the job failed before it was stopped."""
        return self.profile is not None and self.exit_code != 0


def _stages_complete(observations: list[RankObservations]) -> bool:
    """Every stage of the pipeline has at least one rank on record."""
    if not observations:
        return False
    stages = {o.stage for o in observations}
    return all(stages >= set(range(o.num_stages)) for o in observations)


def enough_steps(observations: list[RankObservations], steps: int) -> bool:
    """Whether every stage is on record and every rank on record has ``steps`` steps.

    The ranks of a pipeline step together, so once one rank has recorded two
    steps every rank has written its file (each writes at its first step).
    """
    return steps > 0 and _stages_complete(observations) and all(len(o.steps) >= steps for o in observations)


def without_pipeline(observations: list[RankObservations]) -> bool:
    """Every rank on record runs with pipeline size 1: the job has no pipeline bubbles to profile."""
    return bool(observations) and all(o.num_stages == 1 for o in observations)


def _read(directory: Path) -> list[RankObservations]:
    try:
        return read_observations(directory)
    except (OSError, ValueError) as exc:  # replaced atomically, so this is a foreign file: looked at again later
        logger.debug("[profile] observations not readable yet: %s", exc)
        return []


def _ranks_of(proc: subprocess.Popen[bytes], directory: Path) -> list[int]:
    """The pids the job's ranks wrote (``rank-<rank>.pid``), of processes the job started (a launcher may put
    its workers in sessions of their own)."""
    pids = []
    for path in sorted(directory.glob("rank-*.pid")):
        with contextlib.suppress(OSError, ValueError):
            pid = int(path.read_text())
            if pid > 0 and descends_from(pid, proc.pid):  # not a pid reused by someone else since
                pids.append(pid)
    return pids


def _end_job(proc: subprocess.Popen[bytes], directory: Path, grace_s: float) -> int:
    """Stop the ranks that asked to be stopped quietly and let the launcher end; else end the whole group."""
    ranks = _ranks_of(proc, directory)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    if ranks:
        try:
            code = proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.info("[profile] the job did not end after its ranks: stopping its process group")
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # what it left behind
            return code
    return _end_group(proc, grace_s)


def _end_group(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM the job's process group, SIGKILL it after ``grace_s``; returns the job's status."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            logger.warning("[profile] the job did not end %.0fs after %s", wait_s, signal.Signals(sig).name)
    return proc.wait()


def _watch(proc: subprocess.Popen[bytes], directory: Path, options: ProfileOptions) -> tuple[int, bool]:
    """Wait for the job's end, or for enough steps; returns (job status, whether we stopped it)."""
    while True:
        try:
            return proc.wait(options.poll_s), False
        except subprocess.TimeoutExpired:
            pass
        observations = _read(directory) if options.steps else []
        if without_pipeline(observations):
            logger.info("[profile] the job runs with pipeline size 1: stopping it, it has no bubbles to measure")
            return _end_job(proc, directory, options.grace_s), True
        if enough_steps(observations, options.steps):
            logger.info("[profile] every rank has %d steps: stopping the job", options.steps)
            return _end_job(proc, directory, options.grace_s), True


def _run_job(options: ProfileOptions, directory: Path) -> tuple[int, bool]:
    env = launch_env(options.env, events=options.events, mode="profile", profile_dir=directory)
    if options.steps:
        env[ENV_PROFILE_STEPS] = str(options.steps)
    # a session of its own: the launcher's ranks are ended together, and our terminal's ^C reaches us only
    proc = subprocess.Popen(list(options.command), env=env, start_new_session=True)
    try:
        return _watch(proc, directory, options)
    finally:
        if proc.poll() is None:  # we are interrupted: the job must not outlive us
            _end_group(proc, min(options.grace_s, 5.0))


def run_profile(options: ProfileOptions) -> ProfileOutcome:
    """Run the job in profile mode and write what it measured to ``options.out``.

    Raises:
        OSError: The command cannot be started, or the profile cannot be written.
        ValueError: The ranks' files cannot be folded into a profile (the message says why).
    """
    with tempfile.TemporaryDirectory(prefix="freeride-profile-") as tmp:
        directory = Path(tmp)
        code, stopped = _run_job(options, directory)
        observations = _read(directory)
    exit_code = 0 if stopped else code
    if without_pipeline(observations):
        stop = "; the job was stopped" if stopped else ""
        return ProfileOutcome(
            exit_code=exit_code or 1, job_exit_code=code, stopped=stopped, profile=None,
            message=f"the job runs with pipeline size 1: it has no pipeline bubbles, so no profile written{stop}",
        )  # fmt: skip
    if not any(o.steps for o in observations):
        why = f"training command exited with {code}" if code else "training command recorded no training step"
        hint = "" if code else " (is it a DeepSpeed, Megatron-core or torch pipelining job, or `freeride sim`?)"
        return ProfileOutcome(
            exit_code=exit_code or 1, job_exit_code=code, stopped=stopped, profile=None,
            message=f"{why}; no profile written{hint}",
        )  # fmt: skip
    profile = build_profile(o for o in observations if o.steps)
    write_profile(profile, options.out)
    steps = min(len(o.steps) for o in observations if o.steps)
    what = f"profile of {len(profile.stages)} stage(s) ({steps}+ steps per rank) written to {options.out}"
    if stopped:
        message = f"{what}; the job was stopped after {options.steps} steps"
    elif code != 0:
        incomplete = "" if _stages_complete(observations) else ", and some stages recorded nothing"
        message = f"training command exited with {code}: partial {what}{incomplete}"
    else:
        message = what
    return ProfileOutcome(exit_code=exit_code, job_exit_code=code, stopped=stopped, profile=profile, message=message)
