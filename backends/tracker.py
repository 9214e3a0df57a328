"""Where a training rank waits within a step, and how long each wait should last.

Pure logic, no framework and no torch. A framework adapter reports, from its
hooks, the steps of its rank (``begin_step`` / ``end_step``), the compute
passes (``action_started``, ``record_compute``) and the waits
(``wait_started`` / ``wait_ended``); the :class:`StepTracker` gives every wait a
place key, announces it as a bubble with the duration expected there, and
hands each finished step to ``on_step`` as a :class:`~freeride.profile.StepRecord`.

A place key is, by default, the rank's next scheduled action in ``2F0``
notation (``"1B3c1"``: the wait before it), or the plan's tail key after the
last one; an adapter may name a place itself (``"send:0B1"``, ``"tail:loss"``).
Waits at one place that follow each other add up to one wait.

The expected duration of a wait is what the last few waits at the same place
lasted (:class:`~freeride.backends.predict.BubblePredictor`, which errs low: at places
where waits are mostly p2p latency, an occasional long one is not announced),
and before any was measured the gap :func:`freeride.backends.schedule.simulate` finds
there with this rank's measured compute times (every rank is taken to be as
fast as this one).

Without a pipeline-wide sync at the end of a step (Megatron without a
``finalize_model_grads_func``, DeepSpeed without gradient clipping), a rank's
tail bubble runs into the first receive of the next step, so that first wait
is predicted as head plus tail (``merge_tail``).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from freeride.backends.predict import BubblePredictor
from freeride.backends.schedule import Action, Durations, Groups, Kind, Schedule, bubbles, simulate
from freeride.profile import StepRecord, WaitRecord

__all__ = ["TAIL_KEY", "BubbleSink", "DeviceWaits", "PlanKey", "StepPlan", "StepTracker", "schedule_priors"]

logger = logging.getLogger(__name__)

PlanKey = tuple[str, int, int, int, int]
"""(schedule name, p, m, v, stage): one way a rank can run a step."""

TAIL_KEY = "tail:end"
"""Default place key of a wait after the rank's last action of a step."""


class BubbleSink(Protocol):
    """What the tracker reports to (a :class:`~freeride.backends.session.BackendSession`)."""

    def bubble_started(self, step: int, expected_ns: int, *, spare_memory: int | None = None) -> bool: ...

    def bubble_ended(self) -> int: ...

    def step_finished(self, step: int, duration_ns: int) -> None: ...


class DeviceWaits(Protocol):
    """Times waits on the device (a :class:`~freeride.backends.cuda_timing.DeviceTimeline`).

    The tracker marks each wait's start and end; the device's durations come
    back later, by ticket, from :meth:`drain`. An announced wait is announced
    through :meth:`wait_began`, when the device gets there.
    """

    def wait_began(self, announce: tuple[int, int, int | None] | None = None) -> None: ...

    def wait_finished(self, ticket: object) -> None: ...

    def drain(self) -> list[tuple[object, int]]: ...


@dataclass(slots=True)
class _DevicePlace:
    """A place whose waits the device is still timing."""

    key: Hashable
    learn: bool
    """A step to learn from (valid, not warm-up)."""
    pending: int = 0
    total_ns: int = 0
    flushed: bool = False
    record: tuple[list[WaitRecord], int] | None = None
    """Where the place's :class:`WaitRecord` is, to get the device's duration."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """The schedule one rank runs in one step."""

    schedule: Schedule
    stage: int
    merge_tail: bool
    """No sync ends the step, so the tail bubble lands in the next step's first wait."""
    groups: tuple[tuple[int, ...], ...] | None = None
    """Per rank, the actions run between two blocking p2p calls (see
    :func:`freeride.backends.schedule.simulate`); None: one each."""
    tail_key: str = TAIL_KEY
    """Place key of the wait the simulated tail bubble is expected at (unless merged)."""
    simulated: bool = True
    """Predict waits from the simulated schedule until they are measured; False where
    :func:`freeride.backends.schedule.simulate` cannot model the stages' placement (V-shaped)."""
    priors: Callable[[Durations], Mapping[str, int]] | None = None
    """Predicts the waits, place key -> ns, from this rank's measured compute times
    instead of :func:`schedule_priors` (a framework whose own instruction lists say
    where a rank blocks, as DeepSpeed's DualPipeV); may raise ``ValueError``."""

    @property
    def key(self) -> PlanKey:
        s = self.schedule
        return (s.name, s.num_stages, s.num_microbatches, s.num_chunks, self.stage)

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.schedule.actions[self.stage]

    def place_key(self, before: Action | None) -> str:
        """Key of the place before ``before`` (see :class:`freeride.profile.WaitRecord`)."""
        return self.tail_key if before is None else str(before)


def schedule_priors(
    schedule: Schedule, stage: int, durations: Durations, *, merge_tail: bool, groups: Groups | None = None
) -> dict[Action | None, int]:
    """Simulated idle time of ``stage`` before each of its actions (None: the tail), in ns.

    With ``merge_tail`` the tail is added to the first action's gap, where the
    rank waits for it. ``groups`` replays blocking p2p calls between iterations.

    Raises:
        ValueError: The schedule cannot be simulated with ``durations`` and ``groups``.
    """
    gaps: dict[Action | None, int] = {}
    for window in bubbles(simulate(schedule, durations, groups=groups))[stage]:
        gaps[window.before] = gaps.get(window.before, 0) + round(window.duration * 1e9)
    tail = gaps.pop(None, 0)
    if tail > 0:
        place = schedule.actions[stage][0] if merge_tail else None
        gaps[place] = gaps.get(place, 0) + tail
    return gaps


@dataclass(slots=True)
class _Step:
    plan: StepPlan | None
    number: int
    t0: int
    spare_memory: int
    warm: bool
    """A warm-up step: recorded, but neither announced nor learned from."""
    valid: bool
    cursor: int = 0
    waits: list[WaitRecord] = field(default_factory=list)
    forward_ns: list[int] = field(default_factory=list)
    backward_ns: list[int] = field(default_factory=list)
    # the place being waited at (several waits in a row add up)
    place: str | None = None
    place_start: int = -1
    place_waited: int = 0
    place_expected: int = -1
    wait_t0: int = -1
    open_announced: bool = False
    place_serial: int = -1
    """The place's ticket with the device timer (device timing only)."""


class StepTracker:
    """Follows one rank through its steps and announces its waits as bubbles.

    Args:
        sink: Receives ``bubble_started`` / ``bubble_ended`` / ``step_finished``.
        min_bubble_ns: Waits expected shorter than this are not announced.
        history: Measurements per place the prediction looks back on.
        warmup_steps: First steps whose waits are recorded but neither announced nor
            learned from (their compute times still prime the schedule's prediction).
        clock: Monotonic ns clock (injectable for tests).
        settle: Called right before a bubble is announced and after it ends; on
            a GPU it waits for queued kernels, so the bubble is the device's.
        on_step: Called with the :class:`~freeride.profile.StepRecord` of every
            finished step (profile mode, tests).
        device: Times waits on the device instead of the host (predictions then
            learn device durations) and announces bubbles when the device
            reaches them; ``sink`` is then the same object's.
    """

    def __init__(
        self,
        sink: BubbleSink,
        *,
        min_bubble_ns: int = 1_000_000,
        history: int = 3,
        warmup_steps: int = 0,
        clock: Callable[[], int] = time.monotonic_ns,
        settle: Callable[[], None] | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        device: DeviceWaits | None = None,
    ) -> None:
        self._sink = sink
        self._device = device
        self._device_places: dict[int, _DevicePlace] = {}
        self._serial = 0
        self._min_ns = min_bubble_ns
        self._warmup = warmup_steps
        self._clock = clock
        self._settle = settle
        self._on_step = on_step
        self.predictor = BubblePredictor(history=history, policy="min")  # framework waits are noisy: see predict
        self._compute: dict[Kind, deque[int]] = {k: deque(maxlen=32) for k in ("F", "B", "W")}
        self._waits: deque[int] = deque(maxlen=32)
        self._primed: set[PlanKey] = set()
        self._broken: set[PlanKey] = set()
        self._step: _Step | None = None
        self.steps = 0
        """Steps begun so far."""
        self.steps_done = 0
        """Steps finished so far."""
        self.last_step: StepRecord | None = None
        """The record of the last finished step."""

    # ---------------------------------------------------------------- step
    @property
    def in_step(self) -> bool:
        return self._step is not None

    @property
    def plan(self) -> StepPlan | None:
        """The plan of the step in flight (None: none, or a step without a known schedule)."""
        return self._step.plan if self._step is not None else None

    @property
    def next_action(self) -> Action | None:
        """The next scheduled action of the step in flight (None: none, or past the last)."""
        st = self._step
        return self._next(st) if st is not None else None

    def begin_step(self, plan: StepPlan | None, *, number: int | None = None, spare_memory: int = -1) -> int:
        """Start tracking a step; returns its number (by default, the steps begun before it).

        ``plan`` None tracks a step whose schedule is not known: its waits are keyed
        by the adapter only, and predicted from measurements only.
        """
        self.abandon_step()
        number = self.steps if number is None else number
        self.steps += 1
        self._step = _Step(
            plan=plan,
            number=number,
            t0=self._clock(),
            spare_memory=spare_memory,
            warm=self.steps <= self._warmup,
            valid=plan is None or plan.key not in self._broken,
        )
        return number

    def end_step(self) -> StepRecord | None:
        """Close the step: flush its last wait, report ``step_finished``; returns its record."""
        st = self._step
        if st is None:
            return None
        self._close_wait(st)
        self._flush_place(st)
        self._drain_device()
        if st.plan is not None and st.valid and st.cursor != len(st.plan.actions):
            self._break(st, f"ran {st.cursor} of {len(st.plan.actions)} actions")
        self._step = None
        duration = self._clock() - st.t0
        self._sink.step_finished(st.number, duration)
        record = StepRecord(
            step=st.number, duration_ns=duration, waits=st.waits, forward_ns=st.forward_ns, backward_ns=st.backward_ns
        )
        self.last_step = record
        self.steps_done += 1
        if self._on_step is not None:
            self._on_step(record)
        return record

    def abandon_step(self) -> None:
        """Forget the current step (the schedule raised); closes an open bubble."""
        st = self._step
        if st is not None:
            self._close_wait(st)
            self._device_places.pop(st.place_serial, None)
            self._step = None

    # ------------------------------------------------------------- compute
    def action_started(self, kind: Kind) -> None:
        """A forward (``"F"``), backward (``"B"``) or weight-gradient (``"W"``) pass begins."""
        st = self._step
        if st is None:
            return
        self._close_wait(st)
        self._flush_place(st)
        if st.plan is not None and st.valid:
            actions = st.plan.actions
            if st.cursor >= len(actions) or actions[st.cursor].kind != kind:
                want = str(actions[st.cursor]) if st.cursor < len(actions) else "nothing"
                self._break(st, f"action {st.cursor} is {kind}, the schedule has {want}")
        st.cursor += 1

    def record_compute(self, kind: Kind, duration_ns: int) -> None:
        """How long one pass (of one model chunk) took."""
        self._compute[kind].append(duration_ns)
        st = self._step
        if st is not None and kind != "W":  # the profile format has no weight-gradient times
            (st.forward_ns if kind == "F" else st.backward_ns).append(duration_ns)

    # ---------------------------------------------------------------- waits
    def wait_started(self, key: str | None = None) -> None:
        """The rank is about to block at ``key`` (None: before its next scheduled action)."""
        st = self._step
        if st is None or st.wait_t0 >= 0:
            return
        self._drain_device()
        if key is None:
            key = st.plan.place_key(self._next(st)) if st.plan is not None else TAIL_KEY
        if st.place is not None and st.place != key:
            self._flush_place(st)
        if st.place is None:
            st.place = key
            st.place_start = self._clock() - st.t0
            st.place_expected = self._expect(st, key) if st.valid and not st.warm else -1
            if self._device is not None:
                st.place_serial = self._serial
                self._serial += 1
                learn = st.valid and not st.warm
                self._device_places[st.place_serial] = _DevicePlace(key=self._predictor_key(st, key), learn=learn)
        remaining = st.place_expected - st.place_waited
        announce = st.valid and not st.warm and remaining >= max(self._min_ns, 1)
        if announce and self._settle is not None:
            self._settle()
        # from before the announcement: the bubble the manager sees includes sending it
        st.wait_t0 = self._clock()
        if self._device is not None:
            self._device.wait_began((st.number, remaining, st.spare_memory) if announce else None)
            st.open_announced = announce
            place = self._device_places.get(st.place_serial)
            if place is not None:
                place.pending += 1
        elif announce:
            st.open_announced = self._sink.bubble_started(st.number, remaining, spare_memory=st.spare_memory)

    def wait_ended(self) -> None:
        """The wait returned."""
        st = self._step
        if st is not None:
            self._close_wait(st)

    # ------------------------------------------------------------ internals
    def _close_wait(self, st: _Step) -> None:
        if st.wait_t0 < 0:
            return
        if st.open_announced and self._settle is not None:
            self._settle()  # the wait lasts until what was received is on the device
        st.place_waited += self._clock() - st.wait_t0
        st.wait_t0 = -1
        if self._device is not None:
            self._device.wait_finished(st.place_serial)
            st.open_announced = False
        elif st.open_announced:
            st.open_announced = False
            self._sink.bubble_ended()

    def _drain_device(self) -> None:
        if self._device is None:
            return
        for ticket, ns in self._device.drain():
            if not isinstance(ticket, int):
                continue
            place = self._device_places.get(ticket)
            if place is not None:
                place.pending -= 1
                place.total_ns += ns
                self._learn_device(ticket, place)

    def _learn_device(self, serial: int, place: _DevicePlace) -> None:
        if place.flushed and place.pending <= 0:
            del self._device_places[serial]
            if place.learn:
                self.predictor.observe(place.key, place.total_ns)
                self._waits.append(place.total_ns)
            if place.record is not None:  # the step's record (profile mode) gets the device's duration
                waits, i = place.record
                waits[i] = msgspec.structs.replace(waits[i], duration_ns=place.total_ns)

    @staticmethod
    def _next(st: _Step) -> Action | None:
        if st.plan is None:
            return None
        actions = st.plan.actions
        return actions[st.cursor] if st.cursor < len(actions) else None

    def _predictor_key(self, st: _Step, place: str) -> Hashable:
        return (st.plan.key if st.plan is not None else None, place)

    def _flush_place(self, st: _Step) -> None:
        if st.place is None:
            return
        if self._device is None and st.valid and not st.warm:
            self.predictor.observe(self._predictor_key(st, st.place), st.place_waited)
            self._waits.append(st.place_waited)
        st.waits.append(
            WaitRecord(
                key=st.place, offset_ns=st.place_start, duration_ns=st.place_waited, expected_ns=st.place_expected
            )
        )
        place = self._device_places.get(st.place_serial) if self._device is not None else None
        if place is not None:  # learnt from, and recorded, once the device has timed all its waits
            place.flushed = True
            place.record = (st.waits, len(st.waits) - 1)
            self._learn_device(st.place_serial, place)
        st.place, st.place_start, st.place_waited, st.place_expected = None, -1, 0, -1

    def _expect(self, st: _Step, place: str) -> int:
        plan = st.plan
        if plan is not None and plan.key not in self._primed:
            self._prime(plan)
        return self.predictor.expect(self._predictor_key(st, place))

    def _prime(self, plan: StepPlan) -> None:
        """Set the schedule's prediction, once this rank's compute times are known."""
        if not plan.simulated:
            self._primed.add(plan.key)
            return
        needed: tuple[Kind, ...] = ("F", "B", "W") if plan.schedule.has_weight_passes else ("F", "B")
        if plan.schedule.forward_only:
            needed = ("F",)  # a forward-only step (evaluation) is primed before any backward ran
        if not all(self._compute[k] for k in needed):
            return
        f = statistics.median(self._compute["F"]) / 1e9
        b = statistics.median(self._compute["B"]) / 1e9 if self._compute["B"] else f
        w = statistics.median(self._compute["W"]) / 1e9 if "W" in needed else None
        durations = Durations.uniform(plan.schedule.num_stages, f, b, comm=self._comm_s(f, b), weight=w)
        try:
            if plan.priors is not None:
                by_place = dict(plan.priors(durations))
            else:
                gaps = schedule_priors(
                    plan.schedule, plan.stage, durations, merge_tail=plan.merge_tail, groups=plan.groups
                )
                by_place = {plan.place_key(before): ns for before, ns in gaps.items()}
        except ValueError:
            logger.warning("[predict] could not simulate %s; using measured waits only", plan.key)
            by_place = {}
        for place, ns in by_place.items():
            self.predictor.set_prior((plan.key, place), ns)
        self._primed.add(plan.key)
        logger.debug("[predict] %s primed with f=%.2fms b=%.2fms: %s", plan.key, f * 1e3, b * 1e3, by_place)

    def _comm_s(self, f: float, b: float) -> float:
        """Latency of one p2p hop: the median wait for data that had already arrived."""
        short = [ns for ns in self._waits if ns < 0.25e9 * min(f, b)]
        return statistics.median(short) / 1e9 if short else 0.0

    def _break(self, st: _Step, why: str) -> None:
        st.valid = False
        plan = st.plan
        if plan is not None and plan.key not in self._broken:
            self._broken.add(plan.key)
            logger.warning(
                "[predict] the framework's order differs from FreeRide's %s schedule (%s); "
                "bubbles of this schedule are no longer announced",
                plan.schedule.name,
                why,
            )
