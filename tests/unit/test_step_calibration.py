"""Estimates of kinds measured only a few times are scaled by how far such kinds' steps ran past theirs."""

from __future__ import annotations

import logging

import pytest

from freeride import protocol as p
from freeride.sidetask import IterativeTask, StepEstimates
from freeride.sidetask.estimates import TRUSTED_RUNS, Calibration
from freeride.worker import pending as pending_module
from freeride.worker.ledger import GrantLedger
from freeride.worker.pending import PendingStep
from freeride.worker.warmup import WarmUp

MS = 1_000_000


def _rehearsed(estimates: StepEstimates, kinds: list[str], took_ns: int = 2 * MS) -> None:
    for kind in kinds:
        for _ in range(2):
            estimates.observe(kind, took_ns, rehearsal=True)


def test_kinds_that_run_slower_in_bubbles_than_rehearsed_raise_the_estimates_of_little_measured_kinds() -> None:
    """Rehearsed at 2 ms, each kind's steps in bubbles take 2.2-3.0 ms: the 90th percentile ratio scales the rest."""
    estimates = StepEstimates()
    kinds = [f"u{i}" for i in range(24)]
    _rehearsed(estimates, kinds)
    assert estimates.estimate_ns("u23") == 2 * MS  # before any step in a bubble: the rehearsed time
    for i, kind in enumerate(kinds[:20]):
        estimates.observe(kind, 2 * MS + i * MS // 10)  # ratios 1.00 .. 1.95
    assert abs(estimates.calibration.factor - 1.85) < 1e-9  # the 18th of 20, nearest rank
    assert estimates.estimate_ns("u23") == 3_700_000
    assert estimates.known_ns("u23") == estimates.estimate_ns("u23")  # what the manager fits is scaled too


def test_a_kind_measured_often_in_bubbles_stands_on_its_own_percentile() -> None:
    estimates = StepEstimates()
    _rehearsed(estimates, [f"k{i}" for i in range(20)])
    for i in range(20):
        estimates.observe(f"k{i}", 3 * MS)  # every kind 1.5x its rehearsal
    assert estimates.calibration.factor == 1.5
    for _ in range(TRUSTED_RUNS - 1):
        estimates.observe("k0", 3 * MS)
    assert estimates.estimate_ns("k0") == 3 * MS  # 8 steps in bubbles: no factor on top of them
    # one step in a bubble: its own percentile (the middle of 2, 2 and 3 ms) is still scaled
    assert estimates.estimate_ns("k1") == 2 * MS * 1.5


def test_rehearsals_teach_nothing_and_faster_steps_never_scale_an_estimate_down() -> None:
    estimates = StepEstimates()
    kinds = [f"k{i}" for i in range(24)]
    _rehearsed(estimates, kinds, took_ns=4 * MS)
    for kind in kinds:
        estimates.observe(kind, 9 * MS, rehearsal=True)  # a rehearsed outlier: not a step in a bubble
    assert estimates.calibration.factor == 1.0
    for kind in kinds[:20]:
        estimates.observe(kind, 1 * MS)  # faster in bubbles
    assert estimates.calibration.factor == 1.0
    assert estimates.estimate_ns("k23") == 4 * MS


def test_the_first_step_of_a_kind_seeded_from_an_earlier_run_is_a_warm_up_and_teaches_nothing() -> None:
    estimates = StepEstimates()
    for i in range(20):
        estimates.seed(f"k{i}", [2 * MS] * 3, first_ns=40 * MS)
    for i in range(20):
        estimates.observe(f"k{i}", 40 * MS)  # the fresh process's first step of each kind pays its warm-up
    assert estimates.calibration.factor == 1.0
    for i in range(20):
        estimates.observe(f"k{i}", 3 * MS)  # the second is a step like any other
    assert estimates.calibration.factor > 1.0


def test_the_warm_up_seeds_its_steps_as_rehearsals() -> None:
    record = WarmUp(max_steps=10, max_ns=10**9)
    record.measured = [(f"k{i}", 2 * MS) for i in range(20)] * 2
    estimates = StepEstimates()
    record.seed(estimates)
    record.close()
    for i in range(20):
        estimates.observe(f"k{i}", 3 * MS)  # the first step in a bubble of each rehearsed kind teaches
    assert estimates.calibration.factor == 1.5


def test_too_few_ratios_scale_nothing() -> None:
    calibration = Calibration(least=8)
    for _ in range(7):
        calibration.add(5 * MS, 1 * MS)
    assert calibration.factor == 1.0
    calibration.add(5 * MS, 1 * MS)
    assert calibration.factor == 5.0
    calibration.add(5 * MS, -1)  # nothing known to compare with
    calibration.add(5 * MS, 0)
    assert calibration.factor == 5.0


def test_the_worker_logs_the_scale_when_it_moves_and_then_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Pieces(IterativeTask):
        def step(self) -> None:
            pass

    estimates = StepEstimates()
    _rehearsed(estimates, [f"k{i}" for i in range(40)])
    assign = p.Assign(
        task_id=1,
        spec=p.IterativeSpec(target="x:Y"),
        device="cpu:0",
        checkpoint_path="",
        margin_ns=0,
        checkpoint_every_ns=1 << 62,
    )
    pending = PendingStep(Pieces(), estimates, GrantLedger(assign))
    now = [10**12]
    monkeypatch.setattr(pending_module.time, "monotonic_ns", lambda: now[0])

    def run(first: int, last: int, took_ns: int) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="freeride.worker.pending"):
            for i in range(first, last):
                pending.kind = f"k{i}"
                pending.ran(took_ns)
        return [r.getMessage() for r in caplog.records]

    logged = run(0, 20, 3 * MS)  # 1.5x the rehearsal: the scale is set once 16 ratios are known
    assert len(logged) == 1 and "scaled x1.50" in logged[0]
    assert run(20, 30, 6 * MS) == []  # the scale doubles within the minute: not logged again
    now[0] += 61 * 10**9
    logged = run(30, 31, 6 * MS)
    assert len(logged) == 1 and "scaled x3.00" in logged[0]
