"""A step kind not measured yet is estimated from its cost and the kinds measured: high, never low."""

from __future__ import annotations

import random

import pytest

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.sidetask import IterativeTask, StepEstimates
from freeride.worker.gate import GrantGate

COSTS = {f"k{i}": float(cost) for i, cost in enumerate([2e6, 5e6, 1e7, 2e7, 4e7, 8e7, 3e6, 6e7])}


def _true_ns(cost: float, rng: random.Random) -> int:
    """A step: a fixed part and a part proportional to its cost, each a little noisy."""
    return int(300_000 * rng.uniform(0.8, 1.2) + cost * 0.5 * rng.uniform(0.8, 1.2))


def test_an_unmeasured_kind_is_estimated_from_its_cost_and_errs_high() -> None:
    rng = random.Random(0)
    kinds = list(COSTS)
    for first in range(1, len(kinds)):
        estimates = StepEstimates(cost=COSTS.get)
        for kind in kinds[:first]:
            for _ in range(5):
                estimates.observe(kind, _true_ns(COSTS[kind], rng))
        for kind in kinds[first:]:
            typical = 300_000 + COSTS[kind] * 0.5
            assert estimates.estimate_ns(kind) >= typical, (first, kind)
            assert estimates.estimate_ns(kind) < typical * 6, (first, kind)  # still of use in a bubble


def test_a_tiny_kind_dominated_by_its_fixed_part_does_not_blow_up_a_large_one() -> None:
    costs = {"head": 2e4, "conv": 2e7, "big": 4e7}
    estimates = StepEstimates(cost=costs.get)
    estimates.observe("head", 600_000)  # 30 ns per unit of cost: all overhead
    estimates.observe("conv", 4_000_000)  # 0.2 ns per unit
    assert 8_000_000 <= estimates.estimate_ns("big") <= 12_000_000  # not 40e6 * 30 ns = 1.2 s


def test_a_piece_smaller_than_every_measured_kind_is_estimated_below_them_but_high() -> None:
    # Packing (fit_piece) asks for pieces of a step none of which ran yet: half a
    # mini-batch must look as if it fits where the whole did not, yet not err low.
    estimates = StepEstimates(cost=lambda kind: float(kind[1:]))
    whole = 100_000 + 4096 * 1000  # a fixed part and 1 us per edge
    estimates.observe("e4096", whole)
    for n in (2048, 1024, 256, 64):
        assert 100_000 + n * 1000 <= estimates.estimate_ns(f"e{n}") < whole, n
    estimates.observe("e64", 164_000)
    assert 100_000 + 128 * 1000 <= estimates.estimate_ns("e128") <= 2 * 164_000  # from the nearest smaller kind


def test_without_a_cost_or_a_measured_kind_the_estimate_stays_unknown() -> None:
    assert StepEstimates(cost=COSTS.get).estimate_ns("k1") == -1  # nothing measured yet
    no_cost = StepEstimates()
    no_cost.observe("k0", 1000)
    assert no_cost.estimate_ns("k1") == -1
    partial = StepEstimates(cost={"k0": 1.0}.get)
    partial.observe("k0", 1000)
    assert partial.estimate_ns("other") == -1  # the task does not know this kind's cost
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        odd = StepEstimates(cost={"k0": 1.0, "k1": bad}.get)
        odd.observe("k0", 1000)
        assert odd.estimate_ns("k1") == -1, bad


def test_a_measurement_wins_over_the_cost_and_the_hint_over_both() -> None:
    estimates = StepEstimates(hint_ns=50, cost=COSTS.get)
    estimates.observe("k0", 1_000_000)
    assert estimates.estimate_ns("k1") > 1_000_000
    estimates.observe("k1", 7)
    assert estimates.estimate_ns("k1") == 7
    assert estimates.estimate_ns("") == 50  # the hint of the default kind


class _Costed(IterativeTask):
    def __init__(self) -> None:
        self.kind = "small"

    def step(self) -> None:
        pass

    def step_kind(self) -> str:
        return self.kind

    def step_cost(self, kind: str) -> float | None:
        return {"small": 1.0, "large": 4.0}.get(kind)


class _Link:
    def __init__(self) -> None:
        self.inbox: list[p.ManagerToWorker] = []
        """What has arrived."""
        self.later: list[p.ManagerToWorker] = []
        """What arrives once the gate waits."""
        self.sent: list[p.WorkerToManager] = []

    def recv_nowait(self) -> p.ManagerToWorker | None:
        return self.inbox.pop(0) if self.inbox else None

    async def recv(self) -> p.ManagerToWorker:
        if not self.later:
            raise AssertionError("the gate parked with nothing to come")
        return self.later.pop(0)

    def send_nowait(self, msg: p.WorkerToManager) -> None:
        self.sent.append(msg)


class _NoDelay:
    def ns(self) -> int:
        return 0

    def close(self) -> None:
        pass


async def test_the_gate_starts_an_unmeasured_kind_mid_grant_when_its_cost_scaled_estimate_fits() -> None:
    clock = ManualClock()
    link = _Link()
    spec = p.IterativeSpec(target="x:Y")
    assign = p.Assign(
        task_id=1, spec=spec, device="cpu:0", checkpoint_path="", margin_ns=0, checkpoint_every_ns=1 << 62
    )
    task = _Costed()
    gate = GrantGate(link, assign, task, 0, save=lambda *_: False, clock=clock, run_delay=_NoDelay())
    now = clock.now_ns()
    link.inbox.append(p.Grant(grant_id=1, bubble_t_ns=now, deadline_ns=now + 100_000_000))
    async with gate.step("small"):
        clock.advance(1_000_000)
        task.kind = "large"
    assert 4_000_000 <= gate.estimates.estimate_ns("large") < 100_000_000
    assert gate.estimate_ns == -1  # what the manager is told: unmeasured, grant it a bubble's start
    async with gate.step("large"):  # without a cost: unknown, so it would wait for the next grant's start
        clock.advance(4_000_000)
    assert gate.steps == 2


@pytest.mark.parametrize("kinds", [0, 1])
def test_no_cost_hook_keeps_unknown_kinds_unknown(kinds: int) -> None:
    class Plain(IterativeTask):
        def step(self) -> None:
            pass

    estimates = StepEstimates(cost=Plain().step_cost)
    for i in range(kinds):
        estimates.observe(f"k{i}", 1000)
    assert estimates.estimate_ns("new") == -1


async def test_a_kind_measured_in_an_earlier_run_takes_its_warm_up_at_a_grant_start() -> None:
    # A fresh process pays a kind's warm-up again: its first step starts mid-grant only where
    # the earlier run's first step of the kind would fit, else at the start of the next grant.
    clock = ManualClock()
    link = _Link()
    spec = p.IterativeSpec(target="x:Y")
    assign = p.Assign(
        task_id=1, spec=spec, device="cpu:0", checkpoint_path="", margin_ns=0, checkpoint_every_ns=1 << 62
    )
    task = _Costed()
    gate = GrantGate(link, assign, task, 0, save=lambda *_: False, clock=clock, run_delay=_NoDelay())
    gate.estimates.seed("small", [1_000_000])
    gate.estimates.seed("large", [1_000_000], first_ns=5_000_000)
    assert gate.estimates.estimate_ns("large") == 1_000_000  # what the manager fits
    now = clock.now_ns()
    link.inbox.append(p.Grant(grant_id=1, bubble_t_ns=now, deadline_ns=now + 4_000_000))
    async with gate.step("small"):
        clock.advance(1_000_000)
        task.kind = "large"
    now = clock.now_ns()
    link.later.append(p.Grant(grant_id=2, bubble_t_ns=now, deadline_ns=now + 4_000_000))
    async with gate.step("large"):
        clock.advance(5_000_000)
    (done,) = [m for m in link.sent if isinstance(m, p.GrantDone)]
    assert done.grant_id == 1 and done.steps == 1 and done.reason == "no_fit"  # 3 ms left: not for the warm-up
    assert gate.steps == 2 and gate.estimates.cold_ns("large") == -1


async def test_an_unmeasured_kind_too_long_by_its_cost_still_probes_at_a_grant_start() -> None:
    # The cost-scaled estimate errs high: one longer than every bubble must not keep the kind
    # out of all of them (the manager would probe it only after many), so it runs as a probe.
    clock = ManualClock()
    link = _Link()
    spec = p.IterativeSpec(target="x:Y")
    assign = p.Assign(
        task_id=1, spec=spec, device="cpu:0", checkpoint_path="", margin_ns=0, checkpoint_every_ns=1 << 62
    )
    task = _Costed()
    gate = GrantGate(link, assign, task, 0, save=lambda *_: False, clock=clock, run_delay=_NoDelay())
    gate.estimates.seed("small", [2_000_000])
    task.kind = "large"
    now = clock.now_ns()
    link.inbox.append(p.Grant(grant_id=1, bubble_t_ns=now, deadline_ns=now + 3_000_000))
    assert gate.estimates.estimate_ns("large") > 3_000_000
    async with gate.step("large"):
        clock.advance(2_500_000)
    assert gate.steps == 1
