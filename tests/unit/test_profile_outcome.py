"""``freeride profile``'s stop rule and picture, and the ranks' file written the moment they have enough steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from freeride.backends.observations import ENV_PROFILE_STEPS, ObservationLog, profile_steps_from_env
from freeride.cli.profile_run import ProfileOptions, enough_steps
from freeride.observe.picture import profile_trace, render_profile, require_matplotlib
from freeride.profile import BubbleProfile, Profile, RankObservations, StageProfile, StepRecord, read_observations

MS = 1_000_000


def _obs(rank: int, stage: int, steps: int, num_stages: int = 2) -> RankObservations:
    return RankObservations(
        framework="sim",
        rank=rank,
        stage=stage,
        num_stages=num_stages,
        device=f"cpu:{rank}",
        num_microbatches=4,
        steps=[StepRecord(step=i, duration_ns=100 * MS) for i in range(steps)],
    )


def test_enough_steps_needs_every_stage_and_every_rank_on_record() -> None:
    assert not enough_steps([], 3)
    assert not enough_steps([_obs(0, 0, 5)], 3)  # stage 1 has not written yet
    assert not enough_steps([_obs(0, 0, 5), _obs(1, 1, 2)], 3)
    assert enough_steps([_obs(0, 0, 5), _obs(1, 1, 3)], 3)
    assert enough_steps([_obs(0, 0, 3, num_stages=1)], 3)
    assert not enough_steps([_obs(0, 0, 5), _obs(1, 1, 5)], 0)  # 0: run the job to its end


def test_the_file_is_written_the_moment_the_asked_steps_are_recorded(tmp_path: Path) -> None:
    now = [0]
    log = ObservationLog(_obs(0, 0, 0), tmp_path, every_ns=10**15, clock=lambda: now[0], write_at=3)
    for step in range(4):
        log.add(StepRecord(step=step, duration_ns=MS))
        (on_disk,) = read_observations(tmp_path)
        # the first step at once (the file exists), the third as asked, never the others before 10^6 s
        assert len(on_disk.steps) == {0: 1, 1: 1, 2: 3, 3: 3}[step]
    log.close()
    assert len(read_observations(tmp_path)[0].steps) == 4


def test_the_asked_steps_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert profile_steps_from_env({ENV_PROFILE_STEPS: "7"}) == 7
    assert profile_steps_from_env({ENV_PROFILE_STEPS: "seven"}) == 0
    assert profile_steps_from_env({}) == 0
    monkeypatch.setenv(ENV_PROFILE_STEPS, "4")
    log = ObservationLog(_obs(0, 0, 0), None)
    assert log._write_at == 4


def test_profile_options_are_checked() -> None:
    with pytest.raises(ValueError, match="training command after --"):
        ProfileOptions(command=[], out=Path("x.json"), events="ipc:///nowhere")
    with pytest.raises(ValueError, match="steps must be >= 0"):
        ProfileOptions(command=["true"], out=Path("x.json"), events="ipc:///nowhere", steps=-1)


def _profile() -> Profile:
    stages = []
    for stage, (offset, length) in enumerate([(20, 20), (0, 10)]):
        bubble = BubbleProfile(
            index=0, key=f"{stage}F0", offset_ns=offset * MS, duration_ns=length * MS, p5_ns=0, p95_ns=0, count=4
        )
        stages.append(
            StageProfile(
                stage=stage,
                rank=stage,
                device=f"cpu:{stage}",
                framework="sim",
                num_stages=2,
                num_microbatches=4,
                steps=4,
                step_time_ns=160 * MS,
                bubble_ns=length * MS,
                bubbles=[bubble],
            )
        )
    return Profile(stages=stages)


def test_the_picture_has_a_row_per_stage_with_its_bubbles(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    profile = _profile()
    trace = profile_trace(profile)
    assert [(d.stage, d.bubbles, d.steps) for d in trace.devices.values()] == [
        (0, [(20 * MS, 40 * MS)], {0: (0, 160 * MS)}),
        (1, [(0, 10 * MS)], {0: (0, 160 * MS)}),
    ]
    out = tmp_path / "job.png"
    figure = render_profile(profile, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    (axes,) = figure.axes
    assert [t.get_text() for t in axes.get_yticklabels()] == ["stage 0\ncpu:0", "stage 1\ncpu:1"]
    assert "sim: 2 stages, 4 micro-batches" in axes.get_title()
    with pytest.raises(ValueError, match="no stages"):
        render_profile(Profile(), out)


def test_without_matplotlib_the_profile_command_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from freeride.cli.main import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    with pytest.raises(ImportError, match="pip install"):
        require_matplotlib()
    code = main(["profile", "--out", str(tmp_path / "p.json"), "--picture", str(tmp_path / "p.png"), "--", "true"])
    assert code == 2
    assert "pip install 'matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()  # refused before the job ran
