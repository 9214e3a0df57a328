"""The training job's measured cost: held-back steps, the cost meter, the slowdown budget.

The holdback schedule and the meter are pure; the end-to-end tests drive a
device scheduler (with runners that record grants) and a stand-in job whose
step time rises by a known amount for each bubble that side work got, as a
job sharing its device with side work would, and check that the meter finds
that amount and that the budget backs harvesting off until the bound holds.
"""

from __future__ import annotations

import random
import statistics

import msgspec
import pytest
from test_scheduler import MS, Harness, done

from freeride import protocol as p
from freeride.holdback import HoldbackSchedule, granted
from freeride.observe.stats import LatencyRecorder, median_interval
from freeride.serve.budget import LEVELS, SlowdownBudget
from freeride.serve.costs import TrainingCosts
from freeride.serve.meter import CostMeter
from freeride.serve.scheduler import DeviceScheduler

# -- the schedule ---------------------------------------------------------------


def _blocks(schedule: HoldbackSchedule, steps: int) -> list[tuple[int, str | None]]:
    """(cycle, role) of each block, from each block's first step."""
    c = schedule.config
    out = []
    for first in range(c.start_step, steps, c.block_steps):
        slot = schedule.slot(first)
        assert slot is not None
        out.append((slot.cycle, slot.role))
    return out


def test_each_cycle_holds_back_one_block_next_to_its_harvested_partner() -> None:
    schedule = HoldbackSchedule(p.Holdback(job="j", block_steps=4, every=8, max_every=32, doubling_cycles=4))
    blocks = _blocks(schedule, 2 + 4 * (8 * 4 + 16 * 4 + 32 * 4))
    cycles: dict[int, list[tuple[int, str | None]]] = {}
    for k, (cycle, role) in enumerate(blocks):
        cycles.setdefault(cycle, []).append((k, role))
    # 4 cycles of 8 blocks, 4 of 16, then 32 each
    assert [len(b) for _, b in sorted(cycles.items())] == [8] * 4 + [16] * 4 + [32] * 4
    held_first = 0
    for members in cycles.values():
        roles = {role: k for k, role in members if role is not None}
        assert set(roles) == {"held", "harvested"} and abs(roles["held"] - roles["harvested"]) == 1
        held_first += roles["held"] < roles["harvested"]
        assert sum(role == "held" for _, role in members) == 1
    assert 0 < held_first < len(cycles)  # the coin falls both ways
    # every step of a held block is held; the first step of each block is not measured
    for step in range(2, 400):
        slot = schedule.slot(step)
        assert slot is not None
        assert schedule.held(step) == (slot.role == "held")
        assert slot.measured == (slot.role is not None and (step - 2) % 4 != 0)
    assert schedule.slot(0) is None and schedule.slot(1) is None and not schedule.held(1)


def test_the_held_steps_are_a_function_of_the_job_alone() -> None:
    config = p.Holdback(job="job-a")
    one, two = HoldbackSchedule(config), HoldbackSchedule(p.Holdback(job="job-a"))
    other = HoldbackSchedule(p.Holdback(job="job-b"))
    assert [one.held(s) for s in range(5000)] == [two.held(s) for s in range(5000)]
    assert [one.held(s) for s in range(5000)] != [other.held(s) for s in range(5000)]
    # about one block in `every` at first, one in `max_every` later
    assert sum(one.held(s) for s in range(2, 2 + 4 * 8 * 32)) == 4 * 32
    assert one.held_share(10) == 1 / 8 and one.held_share(10**7) == 1 / 32


def test_holding_back_can_be_turned_off() -> None:
    off = HoldbackSchedule(p.Holdback(every=0))
    assert not any(off.held(s) for s in range(1000)) and off.slot(10) is None and off.held_share(10) == 0.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_steps": 1}, "block_steps"),
        ({"every": 3}, "every"),
        ({"every": 8, "max_every": 12}, "max_every"),
        ({"doubling_cycles": 0}, "doubling_cycles"),
    ],
)
def test_a_bad_holdback_is_refused_by_name(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        p.Holdback(**fields)  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError, match=message):  # and on the wire
        msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "holdback", **fields}), type=p.Holdback)


# -- the meter ------------------------------------------------------------------


def _run_job(
    meter: CostMeter,
    *,
    steps: int,
    effect: float,
    ranks: int = 2,
    seed: int = 0,
    drift: float = 0.0,
    noise: float = 0.01,
) -> None:
    """A job whose steps take 100 ms x (1 + drift) + noise, ``effect`` more where side work runs."""
    rng = random.Random(seed)
    level = 1.0
    for step in range(steps):
        level = 1.0 + drift * (level - 1.0) + drift * rng.gauss(0, 0.02)  # slow AR(1) wander
        held = meter.schedule.held(step)
        for rank in range(ranks):
            ms = 100.0 * level * (1 + (0.0 if held else effect)) * (1 + rng.gauss(0, noise))
            meter.step_finished(rank, step, int(ms * 1e6))


def test_the_meter_recovers_a_known_cost_within_its_interval() -> None:
    meter = CostMeter(HoldbackSchedule(p.Holdback(job="j", every=4, max_every=4)))
    _run_job(meter, steps=4000, effect=0.02)
    est = meter.estimate()
    assert est is not None and est.n >= 200 and est.coverage >= 0.95
    assert est.low <= 0.02 <= est.high and abs(est.median - 0.02) < 0.004
    assert meter.steps == 4000 and meter.pairs == est.n


def test_under_drift_a_job_without_cost_stays_inside_the_interval() -> None:
    # strongly autocorrelated step times: each pair's coin keeps the interval honest
    covered = 0
    for seed in range(20):
        meter = CostMeter(HoldbackSchedule(p.Holdback(job=f"j{seed}", every=4, max_every=4)))
        _run_job(meter, steps=600, effect=0.0, drift=0.98, seed=seed)
        est = meter.estimate()
        assert est is not None and est.coverage >= 0.95
        covered += est.low <= 0.0 <= est.high
    assert covered >= 17  # 95 % nominal; 17 of 20 or more has probability > 0.98 at 95 %


def test_the_meter_skips_a_blocks_first_step_and_a_rank_missing_from_one_block() -> None:
    schedule = HoldbackSchedule(p.Holdback(job="j", every=2, max_every=2, block_steps=2, start_step=0))
    meter = CostMeter(schedule)
    for step in range(4):
        # first steps of blocks (0, 2) take 10x: they must not count
        meter.step_finished(0, step, (1000 if step % 2 == 0 else 100) * (2 if not schedule.held(step) else 1))
        if schedule.held(step):
            meter.step_finished(1, step, 999)  # rank 1 only in the held block: left out of the pair
    assert meter.step_finished(0, 4, 100) == pytest.approx(1.0)  # step 4 closes the pair: 200 / 100 - 1
    assert meter.pairs == 1


def test_a_job_that_starts_over_is_measured_again() -> None:
    meter = CostMeter(HoldbackSchedule(p.Holdback(job="j", every=2, max_every=2)))
    _run_job(meter, steps=400, effect=0.0)
    pairs = meter.pairs
    _run_job(meter, steps=400, effect=0.0)  # step numbers from 0 again
    assert meter.pairs >= 2 * pairs - 1 and meter.steps == 800


# -- the budget -----------------------------------------------------------------


def test_the_budget_steps_down_past_its_bound_and_back_up_well_inside_it() -> None:
    budget = SlowdownBudget(0.005, judge_pairs=12)
    over = median_interval([0.01] * 6)  # the whole interval above the budget: at once
    assert budget.update(over) and budget.share == LEVELS[1] and "lower bound" in budget.reason
    assert not budget.update(median_interval([0.01] * 5))  # too few pairs to guarantee 95 %: not acted on
    noisy = median_interval([-0.01, 0.0, 0.002, 0.004, 0.006, 0.02])  # a wide interval across the budget
    assert not budget.update(noisy)  # six noisy pairs are no evidence either way
    assert budget.update(median_interval([-0.01, 0.0, 0.002, 0.004, 0.006, 0.02] * 2)) and budget.share == LEVELS[2]
    assert "upper bound" in budget.reason
    assert not budget.update(median_interval([0.0] * 11))  # inside, but not settled yet
    assert budget.update(median_interval([0.0] * 12)) and budget.share == LEVELS[1]
    assert budget.update(median_interval([0.0] * 12)) and budget.share == 1.0 and budget.reason == ""


def test_a_share_of_bubbles_is_granted_by_a_fixed_rule() -> None:
    for share in LEVELS:
        picked = sum(granted(share, step, index) for step in range(2000) for index in range(3))
        assert abs(picked / 6000 - share) < 0.03
    assert [granted(0.5, s, 1) for s in range(50)] == [granted(0.5, s, 1) for s in range(50)]


# -- end to end: scheduler, stand-in job, meter, budget ------------------------


def _harness(costs: TrainingCosts) -> Harness:
    h = Harness()
    h.sched = DeviceScheduler("cpu:0", latency=LatencyRecorder(), margin_ns=0, clock=h.clock, costs=costs)
    return h


def _train(h: Harness, costs: TrainingCosts, *, steps: int, effect: float, seed: int = 1) -> list[bool]:
    """A one-rank job with two 20 ms bubbles a step: each granted one adds ``effect`` / 2 to the step's time.

    Returns which steps had side work.
    """
    rng = random.Random(seed)
    [task] = h.sched.tasks
    worked = []
    for step in range(steps):
        used = 0
        for index in range(2):
            h.sent.clear()
            start = h.started(20 * MS, step=step, index=index)
            grants = h.grants()
            if grants:
                used += 1
                h.report(task, done(task, grants[0][1], busy=5 * MS, end=start.t_ns + 5 * MS))
            h.ended(start, 20 * MS)
        worked.append(used > 0)
        duration = 100 * MS * (1 + effect * used / 2) * (1 + rng.gauss(0, 0.005))
        costs.step_finished(0, step, int(duration))
    return worked


def test_the_meter_finds_what_side_work_costs_a_stand_in_job() -> None:
    costs = TrainingCosts(p.Holdback(every=4, max_every=4), budget=0.0)
    h = _harness(costs)
    h.task(1, 2 * MS)
    worked = _train(h, costs, steps=3000, effect=0.03)
    held = [HoldbackSchedule(p.Holdback(every=4, max_every=4)).held(s) for s in range(3000)]
    assert not any(w and hd for w, hd in zip(worked, held, strict=True))  # no side work in a held step
    assert sum(worked) == sum(not hd for hd in held[2:]) + 2  # every other step had some
    [cost] = costs.status()
    assert cost.pairs > 100 and cost.coverage >= 0.95 and cost.harvest_share == 1.0
    assert cost.low <= 0.03 <= cost.high and abs(cost.slowdown - 0.03) < 0.003
    status = h.sched.status(_info())
    assert status.held_back_ns == 2 * 20 * MS * sum(held) and status.backed_off_ns == 0


def test_the_budget_backs_harvesting_off_until_the_bound_holds() -> None:
    seen: list[p.TrainingCost] = []
    costs = TrainingCosts(p.Holdback(every=4, max_every=4), budget=0.005, on_pair=seen.append)
    h = _harness(costs)
    h.task(1, 2 * MS)
    # each granted bubble costs 1 %: at full harvest 1 %, over the 0.5 % budget
    _train(h, costs, steps=6000, effect=0.02)
    [cost] = costs.status()
    assert cost.harvest_share < 1.0 and "budget" in cost.reason
    shares = [c.harvest_share for c in seen]
    assert shares[0] == 1.0 and min(shares) < 1.0
    # what the job paid over its last pairs, whatever the level of each: within the budget
    meter = costs.meter("")
    assert meter is not None
    latest = median_interval(meter.differences()[-100:])
    assert latest.coverage >= 0.95 and latest.high <= 0.005, latest
    assert h.sched.status(_info()).backed_off_ns > 0


def test_without_a_holdback_nothing_is_withheld_nor_measured() -> None:
    costs = TrainingCosts(p.Holdback(every=0), budget=0.005)
    h = _harness(costs)
    h.task(1, 2 * MS)
    worked = _train(h, costs, steps=200, effect=0.05)
    assert all(worked) and costs.status() == []


def test_a_rank_of_a_named_job_follows_that_jobs_schedule() -> None:
    costs = TrainingCosts(p.Holdback())
    costs.hello(3, "run-42")
    named = HoldbackSchedule(p.Holdback(job="run-42"))
    assert [costs.withheld(3, s, 0) == "held_back" for s in range(2000)] == [named.held(s) for s in range(2000)]
    # a rank not heard of yet (its Hello lost or late) trains in the node's one job
    assert costs.holdback(3) == p.Holdback(job="run-42") == costs.holdback(9)
    costs.hello(5, "run-43")  # two jobs on the node: an unknown rank is in neither
    assert costs.holdback(9) == p.Holdback(job="")


def _info() -> object:
    from freeride.serve.ranks import DeviceInfo

    return DeviceInfo(name="cpu:0", first_seen_ns=0)


def test_the_meters_figures_are_stable_statistics() -> None:
    # the median of the pairs, not their mean: one pair with a 10x outlier step moves nothing
    meter = CostMeter(HoldbackSchedule(p.Holdback(job="j", every=2, max_every=2)))
    _run_job(meter, steps=600, effect=0.0, noise=0.0)
    before = meter.estimate()
    assert before is not None and before.median == pytest.approx(0.0, abs=1e-9)
    assert statistics.median(meter.differences()) == before.median


@pytest.mark.parametrize(
    ("env", "job"),
    [
        ({"FREERIDE_JOB": "mine", "SLURM_JOB_ID": "7"}, "mine"),
        ({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, "10.0.0.1:29500"),
        ({"TORCHELASTIC_RUN_ID": "rdzv-9"}, "rdzv-9"),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2"}, "7.2"),
        ({}, ""),
    ],
)
def test_a_ranks_job_is_named_by_its_launcher_the_same_on_every_node(env: dict[str, str], job: str) -> None:
    from freeride.backends.session import job_from_env

    assert job_from_env(env) == job


def test_the_cost_reads_as_status_prints_it() -> None:
    from freeride.observe.cost import cost_line, cost_lines

    assert cost_line(p.TrainingCost(job="", steps=5, pairs=0)) == (
        "training cost: measuring (5 steps, no held-back pair complete yet)"
    )
    few = p.TrainingCost(job="j", steps=40, pairs=3, slowdown=0.01, low=0.0, high=0.02, coverage=0.75, budget=0.005)
    assert cost_line(few) == (
        "training cost of job j +1.00 % (measuring: 3 of the 6 pairs a 95 % interval needs;"
        " +0.00 .. +2.00 % covers 75.0 %; 40 steps)"
    )
    full = p.TrainingCost(
        job="", steps=812, pairs=25, slowdown=0.0021, low=-0.001, high=0.0048, coverage=0.957, budget=0.005
    )
    assert cost_line(full) == "training cost +0.21 % (95 %: -0.10 .. +0.48 %, 812 steps, 25 pairs)"
    device = p.DeviceStatus(
        device="cpu:0", stage=0, rank=0, framework="sim", alive=True, bubbles=10, bubble_ns=1000, used_ns=0,
        overruns=0, overrun_ns=0, spare_memory=-1, steps=10, held_back_ns=125,
    )  # fmt: skip
    lines = cost_lines([msgspec.structs.replace(full, held_share=1 / 8)], [device])
    assert lines[1] == "  measuring it: 12.5 % of the bubble time held back so far (one step in 8 now)"
    assert lines[2] == "  slowdown budget 0.50 %: every bubble granted"
    assert "acted on from 16 pairs on" in cost_lines([msgspec.structs.replace(few, pairs=7, coverage=0.98)], [])[1]
    backed = msgspec.structs.replace(full, harvest_share=0.5, reason="why")
    assert cost_lines([backed], [device])[2] == "  slowdown budget 0.50 %: why (0.0 % of the bubble time so far)"


def test_the_share_used_is_of_the_bubble_time_offered() -> None:
    """Held-back and backed-off bubble time is not offered, so status and the demo count use against the rest."""
    from freeride.cli.status import format_status

    device = p.DeviceStatus(
        device="cpu:0", stage=0, rank=0, framework="sim", alive=True, bubbles=10, bubble_ns=1000, used_ns=300,
        overruns=0, overrun_ns=0, spare_memory=-1, steps=10, held_back_ns=250, backed_off_ns=150,
    )  # fmt: skip
    assert device.offered_ns == 600
    latency = p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0)
    reply = p.StatusReply(devices=[device], tasks=[], latency=latency, events=0, rejected_frames=0, uptime_ns=0)
    row = format_status(reply).splitlines()[1]
    assert " 50.0% " in row, row
    assert msgspec.structs.replace(device, held_back_ns=2000).offered_ns == 0
