"""Bubble profiles: what ``freeride profile`` measures and the manager plans with.

In profile mode every training rank records, step by step, each wait it went
through (a :class:`WaitRecord`: where in the step, how long, what was predicted)
and writes them as one :class:`RankObservations` file per rank
(``rank-<rank>.json``, see :func:`observation_path`). :func:`build_profile`
folds those files into a :class:`Profile`: per stage (one per device), each
bubble's position in the step and duration distribution, the step time and
the memory the stage leaves free::

    profile = build_profile(read_observations(profile_dir))
    write_profile(profile, Path("job.profile.json"))
    ...
    stage = load_profile(Path("job.profile.json")).stage("cuda:1")
    if stage is not None:
        print(stage.spare_memory, [b.duration_ns for b in stage.bubbles])

Everything is plain JSON on disk (msgspec Structs), durations in nanoseconds.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable
from pathlib import Path

import msgspec

from freeride.host.files import replace_atomically

__all__ = [
    "FORMAT_VERSION",
    "BubbleProfile",
    "Profile",
    "RankObservations",
    "StageProfile",
    "StepRecord",
    "WaitRecord",
    "build_profile",
    "load_profile",
    "observation_path",
    "read_observations",
    "typical_bubble_ns",
    "write_observations",
    "write_profile",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version of the files written here; readers reject other versions."""


def typical_bubble_ns(durations: Iterable[int]) -> int:
    """The length that half of the bubble time lies in bubbles at least as long as (0: no bubbles).

    The median weighted by time: side work sized for it fits the bubbles that
    hold most of the time, not the many short ones that hold little (a
    DeepSpeed stage's 2 ms waits between its 20-30 ms ones).
    """
    lengths = sorted((d for d in durations if d > 0), reverse=True)
    half = sum(lengths) / 2
    seen = 0
    for length in lengths:
        seen += length
        if seen >= half:
            return length
    return 0


class _Rec(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the on-disk records."""


# --------------------------------------------------------------------------
# what a rank records
# --------------------------------------------------------------------------


class WaitRecord(_Rec, frozen=True, kw_only=True):
    """One wait of a rank inside one training step."""

    key: str
    """Place of the wait in the step, stable from step to step: the action it precedes
    in ``2F0`` notation (``"1F0"``: before stage 1's forward of micro-batch 0), a send
    that blocked before that action (``"send:1F2"``), or ``"tail:..."`` for the
    end-of-step syncs (``"tail:opt0"``, ``"tail:loss"``)."""
    offset_ns: int
    """Start of the wait, from the start of the step."""
    duration_ns: int
    expected_ns: int = -1
    """What the adapter predicted when the wait began (-1: nothing yet)."""


class StepRecord(_Rec, frozen=True, kw_only=True):
    """One training step of one rank."""

    step: int
    duration_ns: int
    waits: list[WaitRecord] = []
    forward_ns: list[int] = []
    """Per micro-batch forward compute time, in execution order."""
    backward_ns: list[int] = []


class RankObservations(_Rec, frozen=True, kw_only=True):
    """Everything one rank recorded in profile mode."""

    format_version: int = FORMAT_VERSION
    framework: str
    rank: int
    stage: int
    num_stages: int
    device: str
    num_microbatches: int
    schedule: str = ""
    """Framework name of the schedule, e.g. ``TrainSchedule``."""
    spare_memory: int = -1
    """Device memory the stage leaves free, bytes (-1 unknown)."""
    device_memory: int = -1
    steps: list[StepRecord] = []


# --------------------------------------------------------------------------
# the profile
# --------------------------------------------------------------------------


class BubbleProfile(_Rec, frozen=True, kw_only=True):
    """A bubble that recurs at the same place in every step."""

    index: int
    """Position among the stage's bubbles of a step, in time order."""
    key: str
    """Place in the step (see :attr:`WaitRecord.key`)."""
    offset_ns: int
    """Median start, from the start of the step."""
    duration_ns: int
    """Median duration."""
    p5_ns: int
    p95_ns: int
    count: int
    """Measurements behind the numbers (one per profiled step)."""


class StageProfile(_Rec, frozen=True, kw_only=True):
    """The bubbles and resources of one pipeline stage on one device."""

    stage: int
    rank: int
    device: str
    framework: str
    num_stages: int
    num_microbatches: int
    steps: int
    """Profiled steps (after the warm-up steps that were left out)."""
    step_time_ns: int
    """Median step time."""
    bubble_ns: int
    """Sum of the median durations of :attr:`bubbles`."""
    spare_memory: int = -1
    device_memory: int = -1
    forward_ns: int = -1
    """Median forward compute time of one micro-batch (-1 unknown)."""
    backward_ns: int = -1
    bubbles: list[BubbleProfile] = []

    @property
    def typical_bubble_ns(self) -> int:
        """Half the stage's bubble time lies in bubbles at least this long (see :func:`typical_bubble_ns`)."""
        return typical_bubble_ns(b.duration_ns for b in self.bubbles)

    @property
    def bubble_fraction(self) -> float:
        """Share of the step the stage is idle in its bubbles."""
        return self.bubble_ns / self.step_time_ns if self.step_time_ns > 0 else 0.0

    def bubble(self, key: str) -> BubbleProfile | None:
        """The bubble at ``key``, if the profile has one there."""
        return next((b for b in self.bubbles if b.key == key), None)


class Profile(_Rec, frozen=True, kw_only=True):
    """Per-stage bubble profile of a training job."""

    format_version: int = FORMAT_VERSION
    stages: list[StageProfile] = []

    def stage(self, device: str) -> StageProfile | None:
        """The stage computing on ``device`` (e.g. ``cuda:1``, ``cpu:0``), if profiled."""
        return next((s for s in self.stages if s.device == device), None)

    def for_stage(self, stage: int) -> list[StageProfile]:
        """Every device running pipeline stage ``stage`` (more than one with data parallelism)."""
        return [s for s in self.stages if s.stage == stage]

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]


# --------------------------------------------------------------------------
# building
# --------------------------------------------------------------------------


def _percentile(sorted_values: list[int], q: float) -> int:
    """Linear-interpolated percentile ``q`` in [0, 100] of non-empty sorted values."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    value = sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
    return round(value)


def _median(values: list[int]) -> int:
    return round(statistics.median(values)) if values else -1


def _stage_profile(obs: RankObservations, *, warmup_steps: int, min_bubble_ns: int) -> StageProfile:
    if len(obs.steps) > warmup_steps:
        steps = obs.steps[warmup_steps:]
    else:
        steps = obs.steps
        if warmup_steps:
            logger.warning("[profile] rank %d: only %d steps recorded; warm-up kept", obs.rank, len(steps))
    durations: dict[str, list[int]] = {}
    offsets: dict[str, list[int]] = {}
    for step in steps:
        for wait in step.waits:
            durations.setdefault(wait.key, []).append(wait.duration_ns)
            offsets.setdefault(wait.key, []).append(wait.offset_ns)
    kept: list[tuple[int, str]] = []
    for key, values in durations.items():
        if _median(values) >= min_bubble_ns:
            kept.append((_median(offsets[key]), key))
    kept.sort()
    bubbles: list[BubbleProfile] = []
    for index, (offset, key) in enumerate(kept):
        values = sorted(durations[key])
        bubbles.append(
            BubbleProfile(
                index=index,
                key=key,
                offset_ns=offset,
                duration_ns=_median(values),
                p5_ns=_percentile(values, 5),
                p95_ns=_percentile(values, 95),
                count=len(values),
            )
        )
    return StageProfile(
        stage=obs.stage,
        rank=obs.rank,
        device=obs.device,
        framework=obs.framework,
        num_stages=obs.num_stages,
        num_microbatches=obs.num_microbatches,
        steps=len(steps),
        step_time_ns=_median([s.duration_ns for s in steps]),
        bubble_ns=sum(b.duration_ns for b in bubbles),
        spare_memory=obs.spare_memory,
        device_memory=obs.device_memory,
        forward_ns=_median([t for s in steps for t in s.forward_ns]),
        backward_ns=_median([t for s in steps for t in s.backward_ns]),
        bubbles=bubbles,
    )


def build_profile(
    observations: Iterable[RankObservations], *, warmup_steps: int = 1, min_bubble_ns: int = 1_000_000
) -> Profile:
    """Fold per-rank observations into a profile.

    Args:
        observations: One entry per rank (see :func:`read_observations`).
        warmup_steps: Leading steps of each rank left out (the first steps run slow);
            kept when a rank recorded no more than this.
        min_bubble_ns: Places whose median wait is shorter are not bubbles.

    Returns:
        A profile with one stage entry per device, ordered by stage then rank.

    Raises:
        ValueError: No observations, a rank without steps, a file of another format
            version, or two ranks on the same device.
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if min_bubble_ns < 0:
        raise ValueError(f"min_bubble_ns must be >= 0, got {min_bubble_ns}")
    stages: list[StageProfile] = []
    seen: dict[str, int] = {}
    for obs in observations:
        if obs.format_version != FORMAT_VERSION:
            raise ValueError(
                f"rank {obs.rank}: observations have format_version {obs.format_version}, expected {FORMAT_VERSION}"
            )
        if not obs.steps:
            raise ValueError(f"rank {obs.rank}: no training steps were recorded")
        if obs.device in seen:
            raise ValueError(f"ranks {seen[obs.device]} and {obs.rank} both report device {obs.device!r}")
        seen[obs.device] = obs.rank
        stages.append(_stage_profile(obs, warmup_steps=warmup_steps, min_bubble_ns=min_bubble_ns))
    if not stages:
        raise ValueError("no observations: did the training job run any step under the profiler?")
    stages.sort(key=lambda s: (s.stage, s.rank))
    return Profile(stages=stages)


# --------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------


def observation_path(directory: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its observations in ``directory``."""
    return directory / f"rank-{rank}.json"


def _write_json(obj: msgspec.Struct, path: Path) -> None:
    data = msgspec.json.format(msgspec.json.encode(obj), indent=2)
    replace_atomically(path, lambda f: f.write(data))


def write_observations(observations: RankObservations, directory: Path) -> Path:
    """Write ``observations`` to :func:`observation_path` atomically; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = observation_path(directory, observations.rank)
    _write_json(observations, path)
    return path


_obs_decoder = msgspec.json.Decoder(RankObservations)
_profile_decoder = msgspec.json.Decoder(Profile)


def read_observations(directory: Path) -> list[RankObservations]:
    """Every ``rank-*.json`` in ``directory``, in rank order.

    Raises:
        ValueError: A file is not a valid observation file (the message names it).
    """
    result: list[RankObservations] = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            result.append(_obs_decoder.decode(path.read_bytes()))
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}: not a FreeRide observation file: {exc}") from exc
    result.sort(key=lambda o: o.rank)
    return result


def write_profile(profile: Profile, path: Path) -> None:
    """Write ``profile`` as indented JSON (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(profile, path)


def load_profile(path: Path) -> Profile:
    """Read a profile written by :func:`write_profile`.

    Raises:
        OSError: The file cannot be read.
        ValueError: It is not a profile, or one of another format version.
    """
    try:
        profile = _profile_decoder.decode(path.read_bytes())
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: not a FreeRide profile: {exc}") from exc
    if profile.format_version != FORMAT_VERSION:
        raise ValueError(f"{path}: profile format_version {profile.format_version}, expected {FORMAT_VERSION}")
    return profile
