"""Where a Megatron rank waits within a step, and how long each wait should last.

Pure logic, no megatron and no torch: the adapter reports compute actions
(``forward_step`` / ``backward_step`` calls) and receive waits, and the
:class:`StepTracker` maps every wait to its place in the rank's schedule, the
action that follows it (``2F0`` notation), or ``None`` for the tail. The
expected duration of a wait comes from the last waits at the same place
(:class:`~backends.predict.BubblePredictor`, which errs low: at places
where waits are mostly p2p latency, an occasional long one is not announced),
and before any was measured from the gap the schedule simulator finds there
with this rank's measured forward and backward times.

Megatron has no pipeline-wide sync at the end of a step unless a
``finalize_model_grads_func`` (or an optimizer all-reduce) makes one: a rank's
tail bubble then runs into the first receive of the next step, so that first
wait is predicted as head plus tail.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from backends.megatron.plan import megatron_timeline
from backends.predict import BubblePredictor
from backends.schedule import Action, Durations, Kind, Schedule, bubbles, simulate
from freeride.profile import StepRecord, WaitRecord

__all__ = ["TAIL_KEY", "BubbleSink", "PlanKey", "StepPlan", "StepTracker", "place_key", "schedule_priors"]

logger = logging.getLogger(__name__)

PlanKey = tuple[str, int, int, int, int]
"""(schedule name, p, m, v, stage): one way a rank can run a step."""


class BubbleSink(Protocol):
    """What the tracker reports to (a :class:`~backends.session.BackendSession`)."""

    def bubble_started(self, step: int, expected_ns: int, *, spare_memory: int | None = None) -> bool: ...

    def bubble_ended(self) -> int: ...

    def step_finished(self, step: int, duration_ns: int) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPlan:
    """The schedule one rank runs in one ``forward_backward`` call."""

    schedule: Schedule
    stage: int
    merge_tail: bool
    """No sync ends the step, so the tail bubble lands in the next step's first wait."""
    groups: tuple[tuple[int, ...], ...] | None = None
    """Per rank, the actions run between two blocking p2p calls (see
    :func:`~backends.megatron.plan.iterations`); None: one each."""

    @property
    def key(self) -> PlanKey:
        s = self.schedule
        return (s.name, s.num_stages, s.num_microbatches, s.num_chunks, self.stage)

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.schedule.actions[self.stage]


TAIL_KEY = "tail:end"
"""Profile key of a wait after the rank's last action of a step."""


def place_key(before: Action | None) -> str:
    """Profile key of the place before ``before`` (see :class:`freeride.profile.WaitRecord`)."""
    return TAIL_KEY if before is None else str(before)


def schedule_priors(
    schedule: Schedule,
    stage: int,
    durations: Durations,
    *,
    merge_tail: bool,
    groups: tuple[tuple[int, ...], ...] | None = None,
) -> dict[Action | None, int]:
    """Simulated idle time of ``stage`` before each of its actions, in ns.

    With ``merge_tail`` the tail is added to the first action's gap, where
    megatron makes the rank wait for it. ``groups`` (see :class:`StepPlan`)
    replays megatron's blocking p2p calls between iterations.
    """
    timeline = simulate(schedule, durations) if groups is None else megatron_timeline(schedule, durations, groups)
    gaps: dict[Action | None, int] = {}
    for window in bubbles(timeline)[stage]:
        gaps[window.before] = gaps.get(window.before, 0) + round(window.duration * 1e9)
    tail = gaps.pop(None, 0)
    if tail > 0:
        first = schedule.actions[stage][0]
        place = first if merge_tail else None
        gaps[place] = gaps.get(place, 0) + tail
    return gaps


@dataclass(slots=True)
class _Step:
    plan: StepPlan
    number: int
    t0: int
    spare_memory: int
    cursor: int = 0
    valid: bool = True
    waits: list[WaitRecord] = field(default_factory=list)
    forward_ns: list[int] = field(default_factory=list)
    backward_ns: list[int] = field(default_factory=list)
    # the place being waited at (several waits before one action add up)
    place_start: int = -1
    place_waited: int = 0
    place_expected: int = -1
    wait_t0: int = -1
    open_announced: bool = False


class StepTracker:
    """Follows one rank through its steps and announces its waits as bubbles.

    Args:
        sink: Receives ``bubble_started`` / ``bubble_ended`` / ``step_finished``.
        min_bubble_ns: Waits expected shorter than this are not announced.
        history: Measurements per place the prediction looks back on.
        clock: Monotonic ns clock (injectable for tests).
        settle: Called right before a bubble is announced and after it ends; on
            a GPU it waits for queued kernels, so the bubble is the device's.
        on_step: Called with the :class:`~freeride.profile.StepRecord` of every
            finished step (profile mode, tests).
    """

    def __init__(
        self,
        sink: BubbleSink,
        *,
        min_bubble_ns: int = 1_000_000,
        history: int = 3,
        clock: Callable[[], int] = time.monotonic_ns,
        settle: Callable[[], None] | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self._sink = sink
        self._min_ns = min_bubble_ns
        self._clock = clock
        self._settle = settle
        self._on_step = on_step
        self.predictor = BubblePredictor(history=history)
        self._forward: deque[int] = deque(maxlen=32)
        self._backward: deque[int] = deque(maxlen=32)
        self._waits: deque[int] = deque(maxlen=32)
        self._primed: set[PlanKey] = set()
        self._broken: set[PlanKey] = set()
        self._step: _Step | None = None
        self.steps = 0
        """Steps begun so far (the next step's number)."""

    # ---------------------------------------------------------------- step
    @property
    def in_step(self) -> bool:
        return self._step is not None

    def begin_step(self, plan: StepPlan, *, spare_memory: int = -1) -> int:
        """Start tracking a step; returns its number."""
        self.abandon_step()
        number = self.steps
        self.steps += 1
        self._step = _Step(
            plan=plan,
            number=number,
            t0=self._clock(),
            spare_memory=spare_memory,
            valid=plan.key not in self._broken,
        )
        return number

    def end_step(self) -> None:
        """Close the step: flush its last wait and report ``step_finished``."""
        st = self._step
        if st is None:
            return
        self._close_wait(st)
        self._flush_place(st)
        if st.valid and st.cursor != len(st.plan.actions):
            self._break(st, f"ran {st.cursor} of {len(st.plan.actions)} actions")
        self._step = None
        duration = self._clock() - st.t0
        self._sink.step_finished(st.number, duration)
        if self._on_step is not None:
            self._on_step(
                StepRecord(
                    step=st.number,
                    duration_ns=duration,
                    waits=st.waits,
                    forward_ns=st.forward_ns,
                    backward_ns=st.backward_ns,
                )
            )

    def abandon_step(self) -> None:
        """Forget the current step (the schedule raised); closes an open bubble."""
        st = self._step
        if st is not None:
            self._close_wait(st)
            self._step = None

    # ------------------------------------------------------------- compute
    def action_started(self, kind: Kind) -> None:
        """A ``forward_step`` (``"F"``) or ``backward_step`` (``"B"``) begins."""
        st = self._step
        if st is None:
            return
        self._close_wait(st)
        self._flush_place(st)
        actions = st.plan.actions
        if st.valid and (st.cursor >= len(actions) or actions[st.cursor].kind != kind):
            want = str(actions[st.cursor]) if st.cursor < len(actions) else "nothing"
            self._break(st, f"action {st.cursor} is {kind}, the schedule has {want}")
        st.cursor += 1

    def record_compute(self, kind: Kind, duration_ns: int) -> None:
        """How long one forward or backward (of one model chunk) took."""
        (self._forward if kind == "F" else self._backward).append(duration_ns)
        st = self._step
        if st is not None:
            (st.forward_ns if kind == "F" else st.backward_ns).append(duration_ns)

    # ---------------------------------------------------------------- waits
    def wait_started(self) -> None:
        """The rank is about to block on a receive."""
        st = self._step
        if st is None or st.wait_t0 >= 0:
            return
        if st.place_start < 0:
            st.place_start = self._clock() - st.t0
            st.place_expected = self._expect(st) if st.valid else -1
        remaining = st.place_expected - st.place_waited
        if st.valid and remaining >= max(self._min_ns, 1):
            if self._settle is not None:
                self._settle()
            st.open_announced = self._sink.bubble_started(st.number, remaining, spare_memory=st.spare_memory)
        st.wait_t0 = self._clock()

    def wait_ended(self) -> None:
        """The receive returned."""
        st = self._step
        if st is not None:
            self._close_wait(st)

    # ------------------------------------------------------------ internals
    def _close_wait(self, st: _Step) -> None:
        if st.wait_t0 < 0:
            return
        if st.open_announced and self._settle is not None:
            self._settle()
        st.place_waited += self._clock() - st.wait_t0
        st.wait_t0 = -1
        if st.open_announced:
            st.open_announced = False
            self._sink.bubble_ended()

    def _place(self, st: _Step) -> Action | None:
        actions = st.plan.actions
        return actions[st.cursor] if st.cursor < len(actions) else None

    def _flush_place(self, st: _Step) -> None:
        if st.place_start < 0:
            return
        before = self._place(st)
        if st.valid:
            self.predictor.observe((st.plan.key, before), st.place_waited)
            self._waits.append(st.place_waited)
        st.waits.append(
            WaitRecord(
                key=place_key(before),
                offset_ns=st.place_start,
                duration_ns=st.place_waited,
                expected_ns=st.place_expected,
            )
        )
        st.place_start, st.place_waited, st.place_expected = -1, 0, -1

    def _expect(self, st: _Step) -> int:
        key = st.plan.key
        if key not in self._primed and self._forward and self._backward:
            self._prime(st.plan)
        return self.predictor.expect((key, self._place(st)))

    def _prime(self, plan: StepPlan) -> None:
        # A rank measures only itself: every rank is taken to be as fast as this one.
        f = statistics.median(self._forward) / 1e9
        b = statistics.median(self._backward) / 1e9
        durations = Durations.uniform(plan.schedule.num_stages, f, b, comm=self._comm_s(f, b))
        try:
            gaps = schedule_priors(plan.schedule, plan.stage, durations, merge_tail=plan.merge_tail, groups=plan.groups)
        except ValueError:
            logger.warning("[predict] could not simulate %s; using measured waits only", plan.key)
            gaps = {}
        for before, ns in gaps.items():
            self.predictor.set_prior((plan.key, before), ns)
        self._primed.add(plan.key)
        logger.debug("[predict] %s primed with f=%.2fms b=%.2fms: %s", plan.key, f * 1e3, b * 1e3, gaps)

    def _comm_s(self, f: float, b: float) -> float:
        """Latency of one p2p hop: the median wait for data that had already arrived."""
        short = [ns for ns in self._waits if ns < 0.25e9 * min(f, b)]
        return statistics.median(short) / 1e9 if short else 0.0

    def _break(self, st: _Step, why: str) -> None:
        st.valid = False
        if st.plan.key not in self._broken:
            self._broken.add(st.plan.key)
            logger.warning(
                "[predict] megatron's order differs from FreeRide's %s schedule (%s); "
                "bubbles of this schedule are no longer announced",
                st.plan.schedule.name,
                why,
            )
