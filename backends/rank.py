"""What every adapter of a training rank holds: its place, its session, its step tracker, its profile log.

A framework adapter (DeepSpeed, torch.distributed.pipelining) learns from the
framework's own objects where its rank stands (:class:`RankPlace`) and hands
it to :class:`RankAdapter`, which opens the channel to the manager: the
session, the device's timeline where waits block on the device, and the
:class:`~freeride.backends.tracker.StepTracker` that turns the rank's waits
into bubbles. The framework's hooks stay in the subclass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from freeride.backends.cuda_timing import DeviceTimeline, Timing, track_steps
from freeride.backends.launch import Mode, read_mode
from freeride.backends.memory import device_memory
from freeride.backends.observations import ObservationLog
from freeride.backends.session import BackendConfig, BackendSession, events_endpoint_from_env
from freeride.profile import RankObservations, StepRecord

__all__ = ["HEARTBEAT_NS", "AdapterOptions", "RankAdapter", "RankPlace"]

logger = logging.getLogger(__name__)

HEARTBEAT_NS = 1_000_000_000
"""A rank quiet this long says at its next step that it is alive."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlace:
    """Where one training rank stands, as the manager is told in its ``Hello``."""

    framework: str
    rank: int
    """The global rank."""
    stage: int
    """The rank's place in its pipeline (FreeRide's stage)."""
    num_stages: int
    device: str
    """FreeRide's device name (``cuda:0``, ``cpu:3``)."""
    device_type: str
    """torch's device type of the stage."""
    device_index: int


class AdapterOptions(TypedDict, total=False):
    """The options every rank adapter takes (see :class:`RankAdapter`)."""

    session: BackendSession | None
    mode: Mode | None
    profile_dir: Path | None
    min_bubble_ns: int
    clock: Callable[[], int]
    timing: Timing | None
    timeline: DeviceTimeline | None


class RankAdapter:
    """The channel of one training rank to its manager.

    Args:
        place: Where the rank stands.
        session: Where events go; by default a :class:`BackendSession` to the
            launcher's events endpoint.
        mode: ``profile`` also writes every wait to ``profile_dir``; default from
            the launcher's environment.
        profile_dir: Where profile observations go (``rank-<rank>.json``).
        min_bubble_ns: Waits expected to be shorter are not announced.
        clock: Monotonic ns clock (injectable for tests).
        timing: ``host`` or ``device`` forces how bubbles are timed; ``auto``
            chooses by where waits block (the device's timeline on CUDA with
            NCCL, whose waits return to the host before the stream has waited);
            None reads ``FREERIDE_BUBBLE_TIMING``.
        timeline: A device timeline to use instead of building one (tests).
    """

    def __init__(
        self,
        place: RankPlace,
        *,
        session: BackendSession | None = None,
        mode: Mode | None = None,
        profile_dir: Path | None = None,
        min_bubble_ns: int = 1_000_000,
        clock: Callable[[], int] = time.monotonic_ns,
        timing: Timing | None = None,
        timeline: DeviceTimeline | None = None,
    ) -> None:
        env_mode, env_dir = read_mode()
        self.mode: Mode = env_mode if mode is None else mode
        self.profile_dir = env_dir if profile_dir is None else profile_dir
        if self.mode == "profile" and self.profile_dir is None:
            logger.warning("[attach] profile mode without a profile dir: observations are not written")
        self.place = place
        self.spare_memory, self.device_memory = device_memory(place.device_type, place.device_index)
        if session is None:
            config = BackendConfig(
                endpoint=events_endpoint_from_env(),
                rank=place.rank,
                stage=place.stage,
                num_stages=place.num_stages,
                device=place.device,
                framework=place.framework,
                spare_memory=self.spare_memory,
                device_memory=self.device_memory,
                min_bubble_ns=min_bubble_ns,
            )
            session = BackendSession(config)
        self.session = session
        # the first step runs slow (buffers, shapes, meta exchange): it only primes the schedule's prediction
        self.timeline, self.tracker = track_steps(
            session,
            device_type=place.device_type,
            timing=timing,
            timeline=timeline,
            min_bubble_ns=min_bubble_ns,
            warmup_steps=1,
            clock=clock,
            on_step=self._step_finished,
        )
        """The device's timeline (None: bubbles timed on the host; else it owns the session's socket)."""
        self.log: ObservationLog | None = None
        """Profile mode's record (created with the first training step)."""
        self.closed = False
        self._clock = clock
        self._last_event_ns = clock()

    @property
    def device(self) -> str:
        """FreeRide's name of the rank's device (``cuda:0``, ``cpu:3``)."""
        return self.place.device

    def _heartbeat_if_quiet(self) -> None:
        """Say the rank is alive when nothing went out for :data:`HEARTBEAT_NS`."""
        if self._clock() - self._last_event_ns > HEARTBEAT_NS:
            (self.session if self.timeline is None else self.timeline).heartbeat()

    def _new_log(self, *, num_microbatches: int, schedule: str) -> ObservationLog:
        """Profile mode's record of this rank's steps, from now on."""
        place = self.place
        base = RankObservations(
            framework=place.framework,
            rank=place.rank,
            stage=place.stage,
            num_stages=place.num_stages,
            device=place.device,
            num_microbatches=num_microbatches,
            schedule=schedule,
            device_memory=self.device_memory,
        )
        self.log = ObservationLog(base, self.profile_dir, spare_memory=lambda: self.spare_memory, clock=self._clock)
        return self.log

    def _step_finished(self, record: StepRecord) -> None:
        self._last_event_ns = self._clock()
        if self.log is not None:
            self.log.add(record)

    def _close_channel(self) -> None:
        """Write the profile and say goodbye (the timeline, where there is one, owns the session)."""
        if self.log is not None:
            self.log.close()
        if self.timeline is not None:
            self.timeline.close()
        else:
            self.session.close()
