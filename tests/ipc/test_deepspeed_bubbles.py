"""A real 2-stage DeepSpeed pipeline on CPU, attached through the launcher's environment only.

Compute is emulated by sleeping blocks so that bubbles are deterministic. The
training script times DeepSpeed's own ``p2p.recv``, ``p2p.send`` and ``deepspeed.comm.all_reduce``
itself; those numbers are the independent reference for what the adapter reports.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _deepspeed import TrainRun, run_training, train_cmd
from _quiet import quietest, require_quiet

from freeride import protocol as p
from freeride.backends.launch import launch_env
from freeride.backends.schedule import Durations, bubbles, one_f_one_b, simulate
from freeride.cli.main import main
from freeride.profile import RankObservations, build_profile, read_observations, write_profile
from freeride.transport import Endpoints

pytestmark = pytest.mark.slow

STAGES, MICRO_BATCHES, STEPS = 2, 4, 8
SKIP = 2
"""Leading steps left out of comparisons: the first runs slow, the second still predicts from priors."""
MS = 1_000_000


@pytest.fixture(scope="module")
def sleep_run() -> Iterator[tuple[TrainRun, list[RankObservations]]]:
    runtime = Path(tempfile.mkdtemp(prefix="frds-", dir="/tmp"))
    events = Endpoints.ipc(runtime).events
    cmd = train_cmd(
        "--compute",
        "sleep",
        "--steps",
        str(STEPS),
        "--micro-batches",
        str(MICRO_BATCHES),
        "--stages",
        str(STAGES),
        "--recv-timers",
    )

    def attempt(i: int) -> tuple[TrainRun, list[RankObservations]]:
        profile_dir = runtime / f"profile-{i}"
        env = launch_env(os.environ, events=events, mode="profile", profile_dir=profile_dir)
        run = asyncio.run(run_training(cmd, env=env, events=events))
        assert run.returncode == 0, run.explain()
        return run, read_observations(profile_dir)

    try:
        (run, observations), run.other_work = quietest(attempt)
        yield run, observations
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def _quiet(run: TrainRun) -> None:
    require_quiet(run.other_work, "the profiled DeepSpeed run")


def _bubble_pairs(run: TrainRun, rank: int) -> list[tuple[p.BubbleStarted, p.BubbleEnded]]:
    ends = {(e.step, e.index): e for e in run.of(p.BubbleEnded, rank)}
    return [(s, ends[(s.step, s.index)]) for s in run.of(p.BubbleStarted, rank)]


def test_every_rank_is_seen_and_trains_to_the_end(sleep_run: tuple[TrainRun, list[RankObservations]]) -> None:
    run, observations = sleep_run
    # a rank repeats its Hello (once it publishes its bubble starts, and now and then): the last one counts
    hellos = list({h.rank: h for h in run.of(p.Hello)}.values())
    assert sorted(h.stage for h in hellos) == list(range(STAGES))
    assert {h.framework for h in hellos} == {"deepspeed"}
    assert len({h.device for h in hellos}) == STAGES and all(h.device.startswith("cpu:") for h in hellos)
    for rank in range(STAGES):
        assert [r["step"] for r in run.steps(rank)] == list(range(STEPS))
        assert [e.step for e in run.of(p.StepFinished, rank)] == list(range(STEPS))
        assert len(run.of(p.Goodbye, rank)) == 1
        starts = {(e.step, e.index) for e in run.of(p.BubbleStarted, rank)}
        assert starts and starts == {(e.step, e.index) for e in run.of(p.BubbleEnded, rank)}
    assert [o.rank for o in observations] == list(range(STAGES))
    assert all(len(o.steps) == STEPS for o in observations)


def test_bubble_time_matches_the_independently_measured_waits(
    sleep_run: tuple[TrainRun, list[RankObservations]],
) -> None:
    run, observations = sleep_run
    _quiet(run)
    for obs in observations:
        rank = obs.rank
        records = run.steps(rank)[SKIP:]
        steps = obs.steps[SKIP:]
        # the adapter's timings of every wait, place by place, against the script's own clocks
        recv_ms = sum(w.duration_ns for s in steps for w in s.waits if w.key[0].isdigit()) / MS
        assert recv_ms == pytest.approx(sum(r["recv_ms"] for r in records), rel=0.10)
        send_ms = sum(w.duration_ns for s in steps for w in s.waits if w.key.startswith("send:")) / MS
        assert send_ms == pytest.approx(sum(r["send_ms"] for r in records), rel=0.10, abs=len(steps))
        allreduce_ms = sum(w.duration_ns for s in steps for w in s.waits if w.key.startswith("tail:opt")) / MS
        assert allreduce_ms == pytest.approx(sum(r["allreduce_ms"] for r in records), rel=0.10, abs=len(steps))

        # what the manager saw: exactly the waits expected to last >= 1 ms, with their measured length
        announced_raw = 0
        for step in steps:
            announced = [w for w in step.waits if w.expected_ns >= MS]
            assert len([e for e in run.of(p.BubbleEnded, rank) if e.step == step.step]) == len(announced)
            announced_raw += sum(w.duration_ns for w in announced)
        ended = sum(e.duration_ns for e in run.of(p.BubbleEnded, rank) if e.step >= SKIP)
        assert ended == pytest.approx(announced_raw, rel=0.05)
        # ... which is most of the time the stage spends waiting (the rest: sub-ms jitter)
        reference_ms = sum(r["recv_ms"] + r["send_ms"] + r["allreduce_ms"] for r in records)
        announced_ms = sum(e.duration_ns for e in run.of(p.BubbleEnded, rank) if e.step >= SKIP) / MS
        assert 0.85 * reference_ms <= announced_ms <= 1.10 * reference_ms, (rank, announced_ms, reference_ms)


def test_bubbles_sit_where_the_schedule_puts_them(sleep_run: tuple[TrainRun, list[RankObservations]]) -> None:
    run, observations = sleep_run
    _quiet(run)
    forward = tuple(statistics.median(t for s in o.steps[SKIP:] for t in s.forward_ns) / 1e9 for o in observations)
    backward = tuple(statistics.median(t for s in o.steps[SKIP:] for t in s.backward_ns) / 1e9 for o in observations)
    # the schedule's bubbles are all at least one forward long; what the stages' small
    # differences in speed leave between them is not a bubble, in the simulation or in the run
    threshold = 0.4 * min(forward)
    timeline = simulate(one_f_one_b(STAGES, MICRO_BATCHES), Durations(forward=forward, backward=backward))
    windows = bubbles(timeline, min_duration=threshold)
    profile = build_profile(observations, warmup_steps=SKIP, min_bubble_ns=round(threshold * 1e9))
    for obs, stage in zip(observations, profile.stages, strict=True):
        expected = windows[obs.stage]
        keys = ["tail:opt0" if w.before is None else str(w.before) for w in expected]
        assert [b.key for b in stage.bubbles] == keys
        for bubble, window in zip(stage.bubbles, expected, strict=True):
            assert bubble.duration_ns / 1e9 == pytest.approx(window.duration, rel=0.3), bubble.key
    # stage 0 idles late (fill gap and cool-down), the last stage at the head and the tail
    assert [b.key for b in profile.stages[0].bubbles] == ["0B0", f"0B{MICRO_BATCHES - 1}"]
    assert [b.key for b in profile.stages[-1].bubbles] == [f"{STAGES - 1}F0", "tail:opt0"]
    assert profile.stages[-1].bubbles[0].offset_ns < profile.stages[0].bubbles[0].offset_ns


def test_expected_durations_track_the_measured_ones(sleep_run: tuple[TrainRun, list[RankObservations]]) -> None:
    run, _ = sleep_run
    _quiet(run)
    for rank in range(STAGES):
        pairs = [(s, e) for s, e in _bubble_pairs(run, rank) if s.step >= SKIP and e.duration_ns >= 5 * MS]
        assert len(pairs) >= 2 * (STEPS - SKIP)  # both of the schedule's bubbles, every step
        errors = [abs(s.expected_ns - e.duration_ns) / e.duration_ns for s, e in pairs]
        assert statistics.median(errors) <= 0.20, errors
        expected = sum(s.expected_ns for s, _ in pairs)
        measured = sum(e.duration_ns for _, e in pairs)
        # the predictor errs low on purpose (shortest of the last three waits), so a jittery
        # machine pulls the total down; it must still cover most of the time, and never run long
        assert 0.70 * measured <= expected <= 1.05 * measured, (rank, expected, measured)


def test_plan_reproduces_the_profiled_bubble_share(
    sleep_run: tuple[TrainRun, list[RankObservations]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``freeride plan`` fed with this job's profile models each stage's bubble share within 15 %.

    The plan takes the hand-over latency from the profile (each stage's first wait less
    the forwards before it). Blocked sends (``send:``) are left out of the measured side:
    gloo's send returns only once the peer received, so a late peer shows there as
    jitter the model has no place for (docs/plan.md gives their size). On a quiet
    machine the gap is within 8 %; a loaded one (a CI run, the two cores also busy with
    other work) made it 10.4 %, which is jitter the model replays as medians, not a
    fault in it: 15 % is what this check can hold to. A plan without the hand-over
    latency came out 11-19 % low on the last stage; ``comm_s`` is checked for that.
    """
    run, observations = sleep_run
    _quiet(run)
    profile = build_profile(observations, warmup_steps=SKIP)
    path = tmp_path / "job.profile.json"
    write_profile(profile, path)
    capsys.readouterr()
    assert main(["plan", "--profile", str(path), "--task", "graph-sgd", "--json", "--scale", "1024"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["stages"]) == STAGES
    assert plan["shape"]["comm_s"] > 0
    for modelled, stage in zip(plan["stages"], profile.stages, strict=True):
        waited = sum(b.duration_ns for b in stage.bubbles if not b.key.startswith("send:"))
        measured = waited / stage.step_time_ns
        assert modelled["bubble_share"] == pytest.approx(measured, rel=0.15), (stage.stage, modelled, measured)
        assert modelled["measured_share"] == pytest.approx(stage.bubble_fraction)
