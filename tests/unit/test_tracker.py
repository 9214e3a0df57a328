"""The rank-side step tracker: where a rank waits, what it predicts, what it announces.

The tracker is driven here the way the Megatron adapter drives it from
``forward_step`` / ``backward_step`` / p2p calls (waits keyed by the next
scheduled action), and the way the DeepSpeed adapter does (waits it keys
itself, a warm-up step), with a fake clock and sink.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from freeride.backends.megatron.plan import iterations
from freeride.backends.schedule import Action, Durations, Schedule, interleaved, one_f_one_b, simulate
from freeride.backends.tracker import TAIL_KEY, StepPlan, StepTracker, schedule_priors
from freeride.profile import StepRecord

MS = 1_000_000


@dataclass
class Clock:
    now: int = 1_000 * MS

    def __call__(self) -> int:
        return self.now


@dataclass
class Sink:
    clock: Clock
    started: list[tuple[int, int, int]] = field(default_factory=list)
    """(step, expected ns, t)"""
    ended: list[int] = field(default_factory=list)
    steps: list[tuple[int, int]] = field(default_factory=list)
    accept: bool = True

    def bubble_started(self, step: int, expected_ns: int, *, spare_memory: int | None = None) -> bool:
        self.started.append((step, expected_ns, self.clock()))
        return self.accept

    def bubble_ended(self) -> int:
        self.ended.append(self.clock())
        return 0

    def step_finished(self, step: int, duration_ns: int) -> None:
        self.steps.append((step, duration_ns))


def make(min_bubble_ns: int = MS) -> tuple[StepTracker, Sink, Clock, list[StepRecord]]:
    clock = Clock()
    sink = Sink(clock)
    records: list[StepRecord] = []
    tracker = StepTracker(sink, min_bubble_ns=min_bubble_ns, clock=clock, on_step=records.append)
    return tracker, sink, clock, records


def run_step(
    tracker: StepTracker,
    clock: Clock,
    plan: StepPlan,
    waits: dict[Action | None, list[int]],
    f_ns: int = 10 * MS,
    b_ns: int = 20 * MS,
) -> None:
    """Replay one step: the waits listed before each action, then the action."""
    tracker.begin_step(plan)
    for action in (*plan.actions, None):
        for ns in waits.get(action, []):
            tracker.wait_started()
            clock.now += ns
            tracker.wait_ended()
        if action is None:
            break
        tracker.action_started(action.kind)
        dur = f_ns if action.kind == "F" else b_ns
        clock.now += dur
        tracker.record_compute(action.kind, dur)
    tracker.end_step()


def plan_1f1b(stage: int, p: int = 2, m: int = 4, *, merge_tail: bool = True) -> StepPlan:
    return StepPlan(schedule=one_f_one_b(p, m), stage=stage, merge_tail=merge_tail)


# ---------------------------------------------------------------- priors


def test_priors_of_two_stage_1f1b_follow_the_schedule() -> None:
    f, b = 0.010, 0.020
    schedule = one_f_one_b(2, 4)
    # Stage 0 waits for stage 1's first backward (its F0 then B0, minus its own F1),
    # and at the end for stage 1's last forward.
    first = schedule_priors(schedule, 0, Durations.uniform(2, f, b), merge_tail=True)
    assert first == {Action(0, "B", 0): round(b * 1e9), Action(0, "B", 3): round(f * 1e9)}
    # Stage 1 waits f for its first input; its tail (stage 0's last backward) lands there too.
    last = schedule_priors(schedule, 1, Durations.uniform(2, f, b), merge_tail=True)
    assert last == {Action(1, "F", 0): round((f + b) * 1e9)}
    assert schedule_priors(schedule, 1, Durations.uniform(2, f, b), merge_tail=False) == {
        Action(1, "F", 0): round(f * 1e9),
        None: round(b * 1e9),
    }


def test_interleaved_priors_add_up_to_the_simulated_idle_time() -> None:
    schedule = interleaved(2, 4, 2)
    f, b = 0.005, 0.010
    durations = Durations.uniform(2, f, b)
    timeline = simulate(schedule, durations)
    for stage in range(2):
        gaps = schedule_priors(schedule, stage, durations, merge_tail=True)
        busy = sum(t.end - t.start for t in timeline.per_rank[stage])
        assert sum(gaps.values()) == pytest.approx((timeline.makespan - busy) * 1e9, abs=len(gaps))
        assert all(before is not None and before.stage == stage for before in gaps)


def test_place_keys_use_the_2F0_notation() -> None:
    plan = plan_1f1b(1)
    assert plan.place_key(Action(1, "B", 3, 1)) == "1B3c1"
    assert plan.place_key(None) == TAIL_KEY
    assert (
        StepPlan(schedule=plan.schedule, stage=1, merge_tail=False, tail_key="tail:opt0").place_key(None) == "tail:opt0"
    )


# ---------------------------------------------------------- announcements


def test_waits_are_not_announced_before_compute_times_are_known() -> None:
    tracker, sink, clock, _ = make()
    plan = plan_1f1b(1)
    tracker.begin_step(plan)
    tracker.wait_started()  # stage 1 waits for its first input before any compute
    clock.now += 30 * MS
    tracker.wait_ended()
    assert sink.started == []


def test_schedule_prediction_is_announced_then_measurements_take_over() -> None:
    tracker, sink, clock, records = make()
    plan = plan_1f1b(0)
    b0, b3 = Action(0, "B", 0), Action(0, "B", 3)
    # Step 0: F0, F1 measured; the wait before B0 comes before any backward was measured.
    run_step(tracker, clock, plan, {b0: [24 * MS], b3: [13 * MS]})
    assert [e for _, e, _ in sink.started] == [10 * MS]  # only B3 (after B0 ran): the simulated f
    # Step 1: B0 was measured once (24 ms) and B3 once (13 ms): history wins over the prior.
    run_step(tracker, clock, plan, {b0: [22 * MS], b3: [12 * MS]})
    assert [e for s, e, _ in sink.started if s == 1] == [24 * MS, 13 * MS]
    # Step 2: the predictor errs low: the shortest of the recent measurements.
    run_step(tracker, clock, plan, {b0: [26 * MS], b3: [14 * MS]})
    assert [e for s, e, _ in sink.started if s == 2] == [22 * MS, 12 * MS]
    assert len(sink.ended) == len(sink.started)
    assert [s for s, _ in sink.steps] == [0, 1, 2]
    assert [w.key for w in records[2].waits] == ["0B0", "0B3"]
    assert [w.duration_ns for w in records[2].waits] == [26 * MS, 14 * MS]


def test_bubble_spans_exactly_the_wait() -> None:
    tracker, sink, clock, _ = make()
    plan = plan_1f1b(0)
    b3 = Action(0, "B", 3)
    run_step(tracker, clock, plan, {b3: [13 * MS]})
    run_step(tracker, clock, plan, {b3: [13 * MS]})
    (_, _, t_start), t_end = sink.started[-1], sink.ended[-1]
    assert t_end - t_start == 13 * MS


def test_noisy_short_waits_are_not_announced() -> None:
    tracker, sink, clock, _ = make(min_bubble_ns=MS)
    plan = plan_1f1b(0)
    b1 = Action(0, "B", 1)
    for ns in (MS // 2, 3 * MS, 2 * MS):  # median above 1 ms, but some are p2p latency only
        run_step(tracker, clock, plan, {b1: [ns]})
    assert sink.started == []


def test_short_waits_are_measured_but_not_announced() -> None:
    tracker, sink, clock, records = make(min_bubble_ns=2 * MS)
    plan = plan_1f1b(0)
    b1 = Action(0, "B", 1)
    for _ in range(3):
        run_step(tracker, clock, plan, {b1: [MS // 2]})
    assert sink.started == []
    assert [w.duration_ns for r in records for w in r.waits] == [MS // 2] * 3


def test_waits_at_one_place_add_up_and_share_one_expectation() -> None:
    tracker, sink, clock, records = make()
    plan = plan_1f1b(0)
    b0 = Action(0, "B", 0)
    run_step(tracker, clock, plan, {b0: [6 * MS, 14 * MS]})
    run_step(tracker, clock, plan, {b0: [6 * MS, 14 * MS]})
    step1 = [e for s, e, _ in sink.started if s == 1]
    assert step1 == [20 * MS, 14 * MS]  # the second wait announces what is left
    assert records[1].waits[0].duration_ns == 20 * MS


def test_tail_merges_into_the_next_steps_first_wait() -> None:
    tracker, sink, _, records = make()
    tracker.begin_step(plan_1f1b(1))
    tracker.record_compute("F", 10 * MS)
    tracker.record_compute("B", 20 * MS)
    tracker.wait_started()  # stage 1's first receive: its head (f) plus last step's tail (b)
    assert sink.started[-1][1] == 30 * MS
    tracker.wait_ended()
    tracker.abandon_step()
    assert records == []


def test_measured_first_wait_beats_the_prior() -> None:
    tracker, sink, clock, records = make()
    plan = plan_1f1b(1)
    f0 = Action(1, "F", 0)
    run_step(tracker, clock, plan, {f0: [12 * MS]})
    run_step(tracker, clock, plan, {f0: [31 * MS]})
    assert [e for s, e, _ in sink.started if s == 1] == [12 * MS]
    assert records[1].waits[0].key == "1F0"


def test_without_merge_no_tail_is_predicted_at_the_head() -> None:
    tracker, sink, _, _ = make()
    tracker.begin_step(plan_1f1b(1, merge_tail=False))
    tracker.record_compute("F", 10 * MS)
    tracker.record_compute("B", 20 * MS)
    tracker.wait_started()
    assert sink.started[-1][1] == 10 * MS


def test_a_different_order_than_the_schedule_stops_announcing(caplog: pytest.LogCaptureFixture) -> None:
    tracker, sink, clock, _ = make()
    plan = plan_1f1b(0)
    b0 = Action(0, "B", 0)
    run_step(tracker, clock, plan, {b0: [20 * MS]})
    run_step(tracker, clock, plan, {b0: [20 * MS]})
    announced = len(sink.started)
    assert announced > 0
    with caplog.at_level(logging.WARNING):
        tracker.begin_step(plan)
        tracker.action_started("B")  # the schedule starts with F0
        tracker.end_step()
    assert "differs" in caplog.text
    run_step(tracker, clock, plan, {b0: [20 * MS]})
    assert len(sink.started) == announced
    assert len(sink.steps) == 4  # steps are still reported


def test_waits_outside_a_step_and_nested_waits_are_ignored() -> None:
    tracker, sink, clock, records = make()
    tracker.wait_started()
    tracker.wait_ended()
    plan = plan_1f1b(0)
    run_step(tracker, clock, plan, {Action(0, "B", 0): [20 * MS]})
    tracker.begin_step(plan)
    tracker.action_started("F")
    tracker.action_started("F")
    tracker.wait_started()
    clock.now += 5 * MS
    tracker.wait_started()  # re-entrant: already waiting
    clock.now += 5 * MS
    tracker.wait_ended()
    tracker.wait_ended()
    tracker.abandon_step()
    assert len(sink.started) == len(sink.ended)
    assert len(records) == 1


def test_abandoned_step_closes_its_open_bubble() -> None:
    tracker, sink, clock, _ = make()
    plan = plan_1f1b(0)
    run_step(tracker, clock, plan, {Action(0, "B", 0): [20 * MS]})
    tracker.begin_step(plan)
    tracker.action_started("F")
    tracker.action_started("F")
    tracker.wait_started()
    assert len(sink.started) == len(sink.ended) + 1
    tracker.abandon_step()
    assert len(sink.started) == len(sink.ended)
    assert not tracker.in_step


def test_settle_runs_around_announced_bubbles_only() -> None:
    calls: list[int] = []
    clock = Clock()
    sink = Sink(clock)
    tracker = StepTracker(sink, clock=clock, settle=lambda: calls.append(clock.now))
    plan = plan_1f1b(0)
    run_step(tracker, clock, plan, {Action(0, "B", 0): [20 * MS], Action(0, "B", 1): [MS // 10]})
    assert calls == []
    run_step(tracker, clock, plan, {Action(0, "B", 0): [20 * MS], Action(0, "B", 1): [MS // 10]})
    assert len(calls) == 2 * len(sink.started) == 2


def test_refused_announcement_is_not_ended() -> None:
    tracker, sink, clock, _ = make()
    sink.accept = False
    plan = plan_1f1b(0)
    for _ in range(2):
        run_step(tracker, clock, plan, {Action(0, "B", 0): [20 * MS]})
    assert sink.started and sink.ended == []


def test_interleaved_rank_records_every_wait_place() -> None:
    tracker, _, clock, records = make()
    schedule: Schedule = interleaved(2, 4, 2)
    plan = StepPlan(schedule=schedule, stage=0, merge_tail=True)
    places: dict[Action | None, list[int]] = {a: [3 * MS] for a in plan.actions[::3]}
    run_step(tracker, clock, plan, places, f_ns=5 * MS, b_ns=10 * MS)
    assert [w.key for w in records[0].waits] == [str(a) for a in plan.actions[::3]]
    offsets = [w.offset_ns for w in records[0].waits]
    assert offsets == sorted(offsets)
    assert len(records[0].forward_ns) == len(records[0].backward_ns) == 8


# ------------------------------------------------- adapter-named places


def test_named_places_warm_up_then_learn() -> None:
    """The DeepSpeed way: the adapter names sends and end-of-step syncs; the first step only primes."""
    clock = Clock()
    sink = Sink(clock)
    records: list[StepRecord] = []
    tracker = StepTracker(sink, clock=clock, warmup_steps=1, on_step=records.append)
    plan = StepPlan(schedule=one_f_one_b(2, 2), stage=1, merge_tail=False, tail_key="tail:opt0")
    for number in (7, 8, 9):
        tracker.begin_step(plan, number=number)
        for action in plan.actions:
            tracker.wait_started()  # before the action: keyed by it
            clock.now += 4 * MS
            tracker.wait_ended()
            tracker.action_started(action.kind)
            clock.now += 10 * MS
            tracker.record_compute(action.kind, 10 * MS)
            tracker.wait_started(f"send:{tracker.next_action or 'tail'}")
            clock.now += 2 * MS
            tracker.wait_ended()
        for key in ("tail:opt0", "tail:loss"):
            tracker.wait_started(key)
            clock.now += 3 * MS
            tracker.wait_ended()
        tracker.end_step()
    assert [s for s, _ in sink.steps] == [7, 8, 9]
    assert {s for s, _, _ in sink.started} == {8, 9}  # nothing announced while warming up
    keys = ["1F0", "send:1B0", "1B0", "send:1F1", "1F1", "send:1B1", "1B1", "send:tail", "tail:opt0", "tail:loss"]
    assert [w.key for w in records[0].waits] == keys
    assert all(w.expected_ns == -1 for w in records[0].waits)
    # step 8: the schedule's prediction (tail at tail:opt0); step 9: what step 8 measured
    expected_8 = {w.key: w.expected_ns for w in records[1].waits}
    assert expected_8["1F0"] == 10 * MS and expected_8["tail:opt0"] == 10 * MS  # head f, tail b
    assert [e for s, e, _ in sink.started if s == 9] == [w.duration_ns for w in records[1].waits]


def test_steps_without_a_plan_are_keyed_and_predicted_by_measurement() -> None:
    tracker, sink, clock, records = make()
    for _ in range(2):
        tracker.begin_step(None)
        tracker.action_started("F")  # no schedule to check the order against
        tracker.wait_started("CommitP2P#0")
        clock.now += 5 * MS
        tracker.wait_ended()
        tracker.end_step()
    assert [w.key for w in records[1].waits] == ["CommitP2P#0"]
    assert [e for _, e, _ in sink.started] == [5 * MS]
    assert tracker.plan is None and tracker.next_action is None


def test_weight_passes_prime_a_zero_bubble_plan() -> None:
    tracker, sink, _, records = make()
    schedule = Schedule.from_csv("0F0,0B0,0W0\n1F0,1B0,1W0\n", name="zb", num_microbatches=1)
    plan = StepPlan(schedule=schedule, stage=0, merge_tail=False)
    tracker.begin_step(plan)
    tracker.action_started("F")
    tracker.record_compute("F", 10 * MS)
    tracker.action_started("B")
    tracker.record_compute("B", 20 * MS)
    tracker.action_started("W")
    tracker.record_compute("W", 30 * MS)
    tracker.end_step()
    assert sink.started == [] and records[0].backward_ns == [20 * MS]  # W times are not in the profile
    tracker.begin_step(plan)
    tracker.action_started("F")
    tracker.wait_started()
    # from 0F0's end to 0B0: rank 1's F0 and B0; its W0 is nobody's input
    assert [e for _, e, _ in sink.started] == [30 * MS]


def test_blocking_iterations_move_the_priors() -> None:
    schedule = interleaved(2, 4, 2)
    durations = Durations.uniform(2, 0.001, 0.002)
    groups = tuple(iterations(schedule, s) for s in range(2))
    grouped = schedule_priors(schedule, 0, durations, merge_tail=False, groups=groups)
    plain = schedule_priors(schedule, 0, durations, merge_tail=False)
    assert [str(a) for a in grouped] == ["0F2", "0B3c1"]
    assert set(grouped) != set(plain)
