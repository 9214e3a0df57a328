"""Bubble profile format: building from per-rank observations, files, lookups."""

from __future__ import annotations

import statistics
from pathlib import Path

import msgspec
import pytest

from freeride.profile import (
    FORMAT_VERSION,
    Profile,
    RankObservations,
    StepRecord,
    WaitRecord,
    build_profile,
    load_profile,
    observation_path,
    read_observations,
    typical_bubble_ns,
    write_observations,
    write_profile,
)

MS = 1_000_000


def _rank(rank: int, steps: list[StepRecord], *, device: str | None = None) -> RankObservations:
    return RankObservations(
        framework="deepspeed",
        rank=rank,
        stage=rank,
        num_stages=2,
        device=device or f"cpu:{rank}",
        num_microbatches=4,
        spare_memory=(rank + 1) << 30,
        device_memory=8 << 30,
        steps=steps,
    )


def _step(step: int, duration_ms: float, waits: dict[str, tuple[float, float]]) -> StepRecord:
    """``waits``: key -> (offset ms, duration ms)."""
    return StepRecord(
        step=step,
        duration_ns=round(duration_ms * MS),
        waits=[WaitRecord(key=k, offset_ns=round(o * MS), duration_ns=round(d * MS)) for k, (o, d) in waits.items()],
        forward_ns=[10 * MS + step, 11 * MS],
        backward_ns=[20 * MS, 21 * MS + step],
    )


def _stage0_steps() -> list[StepRecord]:
    # step 0 is the slow warm-up; the tiny "0B1" wait is noise, not a bubble
    steps = [_step(0, 400, {"0B0": (60, 90), "0B1": (100, 0.2), "0B3": (300, 40)})]
    for i, jitter in enumerate([0.0, 1.0, -1.0, 2.0, 0.5], start=1):
        steps.append(
            _step(i, 150 + jitter, {"0B0": (20 + jitter, 20 + jitter), "0B1": (60, 0.3), "0B3": (120, 10 - jitter)})
        )
    return steps


def _stage1_steps() -> list[StepRecord]:
    return [_step(i, 150, {"tail:opt0": (130, 20 + i), "1F0": (0.1, 10)}) for i in range(6)]


def test_build_profile_per_stage_bubbles_in_time_order() -> None:
    stage0, stage1 = _stage0_steps(), _stage1_steps()
    profile = build_profile([_rank(1, stage1), _rank(0, stage0)], warmup_steps=1)

    assert [s.stage for s in profile.stages] == [0, 1]
    s0 = profile.stage("cpu:0")
    assert s0 is not None
    assert [b.key for b in s0.bubbles] == ["0B0", "0B3"]
    assert [b.index for b in s0.bubbles] == [0, 1]
    measured = [w.duration_ns for s in stage0[1:] for w in s.waits if w.key == "0B0"]
    b0 = s0.bubbles[0]
    assert b0.count == len(measured) == 5
    assert b0.duration_ns == round(statistics.median(measured))
    cuts = statistics.quantiles(sorted(measured), n=20, method="inclusive")
    assert b0.p5_ns == round(cuts[0])
    assert b0.p95_ns == round(cuts[-1])
    assert b0.offset_ns == round(statistics.median(w.offset_ns for s in stage0[1:] for w in s.waits if w.key == "0B0"))
    assert s0.step_time_ns == round(statistics.median(s.duration_ns for s in stage0[1:]))
    assert s0.bubble_ns == sum(b.duration_ns for b in s0.bubbles)
    assert s0.bubble_fraction == pytest.approx(s0.bubble_ns / s0.step_time_ns)
    assert s0.forward_ns == round(statistics.median(t for s in stage0[1:] for t in s.forward_ns))
    assert s0.spare_memory == 1 << 30 and s0.device_memory == 8 << 30
    assert s0.bubble("0B1") is None  # median 0.3 ms: below the default 1 ms

    s1 = profile.for_stage(1)
    assert len(s1) == 1
    assert [b.key for b in s1[0].bubbles] == ["1F0", "tail:opt0"]  # ordered by offset, not by name
    assert profile.devices == ["cpu:0", "cpu:1"]
    assert profile.stage("cuda:0") is None


def test_warmup_steps_are_left_out_unless_nothing_else_was_recorded() -> None:
    with_warmup = build_profile([_rank(0, _stage0_steps())], warmup_steps=0).stages[0]
    without = build_profile([_rank(0, _stage0_steps())], warmup_steps=1).stages[0]
    assert with_warmup.steps == without.steps + 1
    assert with_warmup.step_time_ns > without.step_time_ns or with_warmup.bubble_ns > without.bubble_ns

    only_one = build_profile([_rank(0, _stage0_steps()[:1])], warmup_steps=1).stages[0]
    assert only_one.steps == 1
    assert only_one.bubble("0B0") is not None


def test_min_bubble_threshold_decides_what_counts() -> None:
    low = build_profile([_rank(0, _stage0_steps())], min_bubble_ns=0).stages[0]
    high = build_profile([_rank(0, _stage0_steps())], min_bubble_ns=15 * MS).stages[0]
    assert [b.key for b in low.bubbles] == ["0B0", "0B1", "0B3"]
    assert [b.key for b in high.bubbles] == ["0B0"]


@pytest.mark.parametrize(
    ("observations", "message"),
    [
        ([], "no observations"),
        ([_rank(0, [])], "no training steps"),
        ([_rank(0, _stage1_steps()), _rank(1, _stage1_steps(), device="cpu:0")], "both report device"),
    ],
)
def test_build_profile_rejects_unusable_input(observations: list[RankObservations], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_profile(observations)


def test_build_profile_rejects_other_format_versions() -> None:
    old = msgspec.structs.replace(_rank(0, _stage1_steps()), format_version=FORMAT_VERSION + 1)
    with pytest.raises(ValueError, match="format_version"):
        build_profile([old])


def test_build_profile_validates_options() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        build_profile([_rank(0, _stage1_steps())], warmup_steps=-1)
    with pytest.raises(ValueError, match="min_bubble_ns"):
        build_profile([_rank(0, _stage1_steps())], min_bubble_ns=-1)


def test_observations_round_trip_through_a_directory(tmp_path: Path) -> None:
    ranks = [_rank(1, _stage1_steps()), _rank(0, _stage0_steps())]
    for obs in ranks:
        assert write_observations(obs, tmp_path / "obs") == observation_path(tmp_path / "obs", obs.rank)
    back = read_observations(tmp_path / "obs")
    assert [o.rank for o in back] == [0, 1]
    assert back == sorted(ranks, key=lambda o: o.rank)
    assert build_profile(back) == build_profile(ranks)


def test_read_observations_names_a_bad_file(tmp_path: Path) -> None:
    (tmp_path / "rank-3.json").write_text('{"rank": "three"}')
    with pytest.raises(ValueError, match=r"rank-3\.json"):
        read_observations(tmp_path)


def test_profile_round_trip_and_load_errors(tmp_path: Path) -> None:
    profile = build_profile([_rank(0, _stage0_steps()), _rank(1, _stage1_steps())])
    path = tmp_path / "sub" / "job.profile.json"
    write_profile(profile, path)
    assert load_profile(path) == profile
    assert b"\n  " in path.read_bytes()  # indented for people to read

    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_profile(bad)
    future = tmp_path / "future.json"
    future.write_bytes(msgspec.json.encode(Profile(format_version=FORMAT_VERSION + 1)))
    with pytest.raises(ValueError, match="format_version"):
        load_profile(future)
    with pytest.raises(OSError):
        load_profile(tmp_path / "missing.json")


def test_the_typical_bubble_is_the_one_that_holds_the_middle_of_the_bubble_time() -> None:
    # a DeepSpeed stage: two long waits and three short ones per step; the short ones are most
    # bubbles but a tenth of the time, and side work sized for them would waste the long ones
    assert typical_bubble_ns([25 * MS, 2 * MS, 1 * MS, 23 * MS, 2 * MS]) == 23 * MS
    assert typical_bubble_ns([32 * MS, 2 * MS, 1 * MS, 20 * MS, 2 * MS]) == 32 * MS
    assert typical_bubble_ns([5 * MS] * 3 + [2 * MS] * 20) == 2 * MS  # most of the time in short ones
    assert typical_bubble_ns([]) == typical_bubble_ns([0, -1]) == 0
    profiled = build_profile([_rank(0, _stage0_steps())]).stages[0]
    assert profiled.typical_bubble_ns == typical_bubble_ns(b.duration_ns for b in profiled.bubbles) > 0
