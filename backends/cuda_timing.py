"""Bubbles on the device's timeline: announced when the GPU reaches a wait, timed by CUDA events.

On a GPU the host is not the device. An NCCL receive returns to the host as
soon as it is queued (DeepSpeed's p2p, Megatron's ``_p2p_ops`` without
``batch_p2p_sync``, ``torch.distributed.pipelining``'s ``isend``/``irecv``):
the compute stream waits for the data later, when it gets there. A bubble
announced when the host reaches the wait would start while the device is still
busy with the kernels queued before it, and its length would be the host's.

:class:`DeviceTimeline` records a CUDA event on the stage's compute stream right
before each wait and one right after (the stream reaches the second only once
the received data is there). A helper thread waits for each event (blocking
sync, so it sleeps rather than spins) and then sends ``BubbleStarted`` or
``BubbleEnded`` with device times converted to the host's monotonic clock by a
calibration pair (a host reading around an event on an idle stream). The
training thread only records events and appends to a queue: it never waits,
and all sends happen on the helper thread, which owns the session's socket from
then on. Durations come from ``elapsed_time`` between the two events and go
back to the :class:`~freeride.backends.tracker.StepTracker`, whose predictions are then
device times.

Which clock an adapter uses is :func:`choose_timing`'s: the device's when the
stage's tensors are on CUDA and its p2p goes through NCCL (the host does not
block there), the host's otherwise (CPU, gloo); ``FREERIDE_BUBBLE_TIMING`` (or
an adapter's ``timing`` argument) forces either.

No CUDA exists on CPU machines, so the unit tests drive this through a
stand-in for the few event and stream calls used (:class:`DeviceApi`).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from freeride.backends.device_clock import Calibration, DeviceApi, DeviceEvent, calibrate, torch_device_api
from freeride.backends.rank_gate import RankGate, rank_gate_for
from freeride.backends.session import BackendSession
from freeride.backends.tracker import StepTracker
from freeride.profile import StepRecord

__all__ = [
    "ENV_TIMING",
    "Accuracy",
    "DeviceTimeline",
    "Timing",
    "choose_timing",
    "p2p_backend",
    "timeline_for",
    "track_steps",
    "timing_from_env",
]

logger = logging.getLogger(__name__)

Timing = Literal["auto", "host", "device"]
"""How bubbles are timed: chosen by where the wait blocks, or forced."""

ENV_TIMING = "FREERIDE_BUBBLE_TIMING"
"""Environment variable forcing the timing of every rank (``host``, ``device`` or ``auto``)."""

_RECALIBRATE_NS = 10_000_000_000
"""GPU and host clocks drift apart by parts per million: calibrate again this often."""
_MAX_QUEUED = 100_000
"""Beyond this many unprocessed events (a hung device) new waits go untimed."""


def timing_from_env(environ: Mapping[str, str] | None = None) -> Timing:
    """The timing ``FREERIDE_BUBBLE_TIMING`` asks for (``auto`` when unset).

    Raises:
        ValueError: The variable holds something else.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_TIMING, "") or "auto"
    if raw not in ("auto", "host", "device"):
        raise ValueError(f"{ENV_TIMING} must be 'auto', 'host' or 'device', got {raw!r}")
    return raw  # type: ignore[return-value]  # narrowed by the check above


def choose_timing(forced: Timing, *, device_type: str, p2p_backend: str) -> Literal["host", "device"]:
    """Host or device timing for a stage whose tensors live on ``device_type``.

    Args:
        forced: ``host`` or ``device`` wins; ``auto`` decides by where waits block.
        device_type: ``cuda`` or ``cpu`` (torch's device type of the stage).
        p2p_backend: The process group's backend (``nccl``, ``gloo``, ...); empty if unknown.

    Returns:
        ``device`` only on CUDA: with NCCL a receive returns before the device has
        waited; gloo copies through the host, which blocks until the data is there.
    """
    if device_type != "cuda":
        if forced == "device":
            logger.warning("[attach] device timing asked for on a %s stage: timing on the host", device_type)
        return "host"
    if forced != "auto":
        return forced
    return "device" if p2p_backend in ("nccl", "") else "host"


def p2p_backend() -> str:
    """The default process group's backend (``nccl``, ``gloo``, ...); empty before it exists."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
    except (ImportError, RuntimeError, ValueError):
        pass
    return ""


def timeline_for(
    session: BackendSession, *, device_type: str, timing: Timing | None = None, api: DeviceApi | None = None
) -> DeviceTimeline | None:
    """A :class:`DeviceTimeline` for a stage whose waits block on the device; None: time on the host.

    Args:
        session: The rank's session.
        device_type: torch's device type of the stage.
        timing: Forced timing; None reads ``FREERIDE_BUBBLE_TIMING`` (a bad value
            is logged and ignored: nothing here may stop training).
        api: The CUDA calls (tests pass a stand-in).
    """
    if timing is None:
        try:
            timing = timing_from_env()
        except ValueError as exc:
            logger.warning("[attach] %s; choosing by the device", exc)
            timing = "auto"
    backend = p2p_backend()
    mode = choose_timing(timing, device_type=device_type, p2p_backend=backend)
    logger.info("[attach] bubbles timed on the %s (%s, p2p %s, asked %s)", mode, device_type, backend or "?", timing)
    if mode != "device":
        return None
    return DeviceTimeline(session, api=api, gate=rank_gate_for(session.config.endpoint, session.config.device))


def track_steps(
    session: BackendSession,
    *,
    device_type: str,
    timing: Timing | None = None,
    timeline: DeviceTimeline | None = None,
    api: DeviceApi | None = None,
    min_bubble_ns: int,
    warmup_steps: int = 0,
    clock: Callable[[], int] = time.monotonic_ns,
    settle: Callable[[], None] | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> tuple[DeviceTimeline | None, StepTracker]:
    """A rank's timeline (None: its waits are timed on the host) and the tracker of its steps.

    Args:
        session: The rank's session; the timeline, when there is one, owns its socket.
        device_type: torch's device type of the stage.
        timing: Forced timing (see :func:`timeline_for`).
        timeline: A timeline to use instead of building one (tests).
        api: The CUDA calls (tests pass a stand-in).
        min_bubble_ns: Waits expected to be shorter are not announced.
        warmup_steps: Steps that only prime the schedule's prediction.
        clock: Monotonic ns clock.
        settle: Waits for the device's queued work before a host-timed wait
            (unused with a timeline, which times the device itself).
        on_step: Called with each finished step's record.
    """
    if timeline is None:
        timeline = timeline_for(session, device_type=device_type, timing=timing, api=api)
    tracker = StepTracker(
        session if timeline is None else timeline,
        min_bubble_ns=min_bubble_ns,
        warmup_steps=warmup_steps,
        clock=clock,
        settle=settle if timeline is None else None,
        on_step=on_step,
        device=timeline,
    )
    return timeline, tracker


@dataclass(slots=True)
class Accuracy:
    """How the device timeline's bubbles compare with what was announced."""

    announced: int = 0
    """Bubbles sent as ``BubbleStarted``."""
    lag_ns: list[int] = field(default_factory=list)
    """Per announced bubble: when the host learnt the device reached it, minus when it did."""
    error_ns: list[int] = field(default_factory=list)
    """Per announced bubble: the expected duration minus the one measured by events."""
    waits: int = 0
    """Waits timed by events (announced or not)."""
    dropped: int = 0
    """Waits left untimed because the queue was full."""
    calibration_ns: int = -1
    """Half the width of the best calibration pair: the bound on its error."""

    def summary(self) -> dict[str, float]:
        """Medians and 99th percentiles in ms (NaN when nothing was measured)."""

        def q(values: list[int], p: float) -> float:
            if not values:
                return float("nan")
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))] / 1e6

        return {
            "announced": float(self.announced),
            "waits": float(self.waits),
            "lag_p50_ms": q(self.lag_ns, 0.5),
            "lag_p99_ms": q(self.lag_ns, 0.99),
            "abs_error_p50_ms": statistics.median(abs(e) for e in self.error_ns) / 1e6
            if self.error_ns
            else float("nan"),
            "error_p50_ms": q(self.error_ns, 0.5),
            "calibration_ms": self.calibration_ns / 1e6,
        }


@dataclass(frozen=True, slots=True)
class _Begin:
    event: DeviceEvent
    announce: tuple[int, int, int | None] | None
    """(step, expected ns, spare memory) of a bubble to announce; None: only time the wait."""
    device: Any = None
    """The compute stream's device, on the first wait only: the helper thread makes it its own."""


@dataclass(frozen=True, slots=True)
class _End:
    event: DeviceEvent
    ticket: object


@dataclass(frozen=True, slots=True)
class _Call:
    fn: Callable[[], None]


_STOP = _Call(lambda: None)


class DeviceTimeline:
    """A stage's bubble events on the device's timeline (see the module docstring).

    It is the :class:`~freeride.backends.tracker.BubbleSink` of a tracker in device mode,
    and its :meth:`wait_began` / :meth:`wait_finished` / :meth:`drain` time every
    wait. Once created, only its helper thread talks to ``session``: call
    :meth:`heartbeat` and :meth:`close` here instead.

    Args:
        session: Where events go.
        api: The CUDA calls (:func:`torch_device_api` by default).
        clock: The host's monotonic ns clock.
        gate: The device's bubble gate (:mod:`freeride.backends.rank_gate`): opened right before each announced
            wait for the side task the manager names, closed right after it. None: no gate.
    """

    def __init__(
        self,
        session: BackendSession,
        *,
        api: DeviceApi | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        gate: RankGate | None = None,
    ) -> None:
        self.session = session
        self.gate = gate
        self._gate_slot = 0  # training thread: the slot opened at the open wait's start
        self._api = torch_device_api() if api is None else api
        self._clock = clock
        self._queue: queue.SimpleQueue[_Begin | _End | _Call] = queue.SimpleQueue()
        self._queued = 0  # approximate: written by both threads, only compared with a large bound
        self._results: deque[tuple[object, int]] = deque()
        self._free: deque[DeviceEvent] = deque()
        self._open = False  # training thread: a wait began and has not finished
        self._device_sent = False  # training thread: the compute stream's device went to the helper thread
        self._skipped = False  # training thread: the open wait went untimed
        self._closed = False
        self.accuracy = Accuracy()
        self._cal_stream: Any = None
        self._cal: Calibration | None = None
        self._thread = threading.Thread(target=self._loop, name="freeride-device-timeline", daemon=True)
        self._thread.start()
        # registered after the session's own: runs first at exit, so the helper thread
        # has finished with the socket before the session says goodbye on it
        atexit.register(self.close)

    # ------------------------------------------------------- training thread
    def _event(self) -> DeviceEvent:
        try:
            return self._free.popleft()
        except IndexError:
            return self._api.event()

    def wait_began(self, announce: tuple[int, int, int | None] | None = None) -> None:
        """Mark the start of a wait on the compute stream; ``announce`` = (step, expected, spare memory)."""
        if self._closed or self._open:
            return
        self._open = True
        self._skipped = self._queued > _MAX_QUEUED
        if self._skipped:
            self.accuracy.dropped += 1
            return
        stream = self._api.current_stream()
        if announce is not None and self.gate is not None:
            # queued before the wait's event: the side task's step starts where the device gets here
            self._gate_slot = self.gate.open_at(stream, announce[0], announce[1], self.session.held)
        event = self._event()
        event.record(stream)
        device = None
        if not self._device_sent:
            device, self._device_sent = getattr(stream, "device", None), True
        self._put(_Begin(event, announce, device))

    def wait_finished(self, ticket: object) -> None:
        """Mark the end of the wait begun last; its device duration comes back from :meth:`drain` with ``ticket``."""
        if not self._open:
            return
        self._open = False
        if self._closed or self._skipped:
            return
        stream = self._api.current_stream()
        event = self._event()
        event.record(stream)
        if self._gate_slot:
            assert self.gate is not None
            self.gate.close_at(stream, self._gate_slot)  # queued after the wait: the device closes it there
            self._gate_slot = 0
        self._put(_End(event, ticket))

    def drain(self) -> list[tuple[object, int]]:
        """The (ticket, device ns) of the waits measured since the last call."""
        out: list[tuple[object, int]] = []
        while True:
            try:
                out.append(self._results.popleft())
            except IndexError:
                return out

    # BubbleSink, for the tracker: announcements go through wait_began/wait_finished
    def bubble_started(self, step: int, expected_ns: int, *, spare_memory: int | None = None) -> bool:
        """Announce a bubble starting where the device is now (a wait with no ticket)."""
        self.wait_began((step, expected_ns, spare_memory))
        return True

    def bubble_ended(self) -> int:
        """End the bubble of :meth:`bubble_started`; its duration is not known yet (0)."""
        self.wait_finished(None)
        return 0

    def step_finished(self, step: int, duration_ns: int) -> None:
        """Report a finished step after the bubbles queued before it."""
        self._call(lambda: self.session.step_finished(step, duration_ns))

    def heartbeat(self) -> None:
        self._call(self.session.heartbeat)

    @property
    def sent(self) -> int:
        return self.session.sent

    @property
    def dropped(self) -> int:
        return self.session.dropped

    def close(self, timeout_s: float = 5.0) -> None:
        """Let the helper thread finish what is queued (up to ``timeout_s``), then close the session."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("[close] device timeline: events still pending after %.1fs; not waiting", timeout_s)
            return  # the helper thread still owns the socket; atexit closes the session
        self.session.close()

    def _call(self, fn: Callable[[], None]) -> None:
        if not self._closed:
            self._put(_Call(fn))

    def _put(self, item: _Begin | _End | _Call) -> None:
        self._queued += 1
        self._queue.put(item)

    # ---------------------------------------------------------- helper thread
    def _loop(self) -> None:
        begin: _Begin | None = None
        announced = False
        while True:
            item = self._queue.get()
            self._queued -= 1
            try:
                match item:
                    case _Begin(announce=announce):
                        if item.device is not None:
                            self._api.use_device(item.device)  # a new thread starts on device 0
                        begin, announced = item, False
                        if announce is not None:
                            announced = self._announce(item.event, announce)
                    case _End():
                        if begin is not None:
                            self._finish(begin, item, announced)
                            self._free.extend((begin.event, item.event))
                        begin, announced = None, False
                    case _Call():
                        if item is _STOP:
                            return
                        item.fn()
            except Exception:
                # never into training: a failed event or send costs this bubble only
                logger.exception("[bubble] device timeline failed on %s", type(item).__name__)

    def _announce(self, event: DeviceEvent, announce: tuple[int, int, int | None]) -> bool:
        event.synchronize()
        woke = self._clock()
        t_ns = self._host_ns(event)
        step, expected, spare = announce
        sent = self.session.bubble_started(step, expected, spare_memory=spare, t_ns=t_ns)
        if sent:
            self.accuracy.announced += 1
            self.accuracy.lag_ns.append(max(0, woke - t_ns))
        if self.gate is not None:
            self.gate.attach_due()  # here CUDA is current, and the training thread is not kept waiting
        return sent

    def _finish(self, begin: _Begin, end: _End, announced: bool) -> None:
        end.event.synchronize()
        duration = max(0, round(begin.event.elapsed_time(end.event) * 1e6))
        self.accuracy.waits += 1
        if announced:
            self.session.bubble_ended(t_ns=self.session.open_since_ns + duration)
            if begin.announce is not None:
                self.accuracy.error_ns.append(begin.announce[1] - duration)
        if end.ticket is not None:
            self._results.append((end.ticket, duration))

    def _host_ns(self, event: DeviceEvent) -> int:
        """When the device reached ``event``, on the host's monotonic clock."""
        now = self._clock()
        if self._cal is None or now - self._cal.taken_ns > _RECALIBRATE_NS:
            if self._cal_stream is None:
                self._cal_stream = self._api.stream()  # idle: only calibration events go there
            self._cal = calibrate(self._api, self._cal_stream, clock=self._clock)
            self.accuracy.calibration_ns = self._cal.error_ns
        return self._cal.host_time(event)
