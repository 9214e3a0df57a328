"""Profile mode's observation file: rewritten while the job runs, so a killed rank keeps its steps."""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from pathlib import Path

import pytest

from freeride.backends.observations import MAX_RECORDED_STEPS, ObservationLog
from freeride.profile import RankObservations, StepRecord, observation_path, read_observations

S = 1_000_000_000


@dataclass
class Clock:
    now: int = 100 * S

    def __call__(self) -> int:
        return self.now


def _base() -> RankObservations:
    return RankObservations(
        framework="megatron", rank=3, stage=1, num_stages=2, device="cpu:3", num_microbatches=4, schedule="1f1b"
    )


def _steps_on_disk(directory: Path) -> list[int]:
    (obs,) = read_observations(directory)
    return [s.step for s in obs.steps]


def test_the_file_is_rewritten_by_time_while_running(tmp_path: Path) -> None:
    clock = Clock()
    log = ObservationLog(_base(), tmp_path, spare_memory=lambda: 123, every_ns=5 * S, clock=clock)
    log.add(StepRecord(step=0, duration_ns=S))
    assert _steps_on_disk(tmp_path) == [0]  # the first step is on disk at once
    for step in range(1, 4):
        clock.now += S
        log.add(StepRecord(step=step, duration_ns=S))
    assert _steps_on_disk(tmp_path) == [0]  # short steps do not rewrite a growing file each time
    clock.now += 2 * S
    log.add(StepRecord(step=4, duration_ns=S))
    assert _steps_on_disk(tmp_path) == [0, 1, 2, 3, 4]
    log.add(StepRecord(step=5, duration_ns=S))
    log.close()
    (obs,) = read_observations(tmp_path)
    assert [s.step for s in obs.steps] == list(range(6)) and obs.spare_memory == 123
    assert obs.schedule == "1f1b" and obs.rank == 3
    log.close()  # idempotent


def test_close_runs_at_exit_until_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[object] = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", registered.remove)
    log = ObservationLog(_base(), tmp_path)
    assert registered == [log.close]
    log.close()
    assert registered == []
    assert not observation_path(tmp_path, 3).exists()  # nothing recorded, nothing written


def test_without_a_directory_steps_stay_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    log = ObservationLog(_base(), None)
    monkeypatch.setattr("freeride.backends.observations.MAX_RECORDED_STEPS", 2)
    for step in range(3):
        log.add(StepRecord(step=step, duration_ns=S))
    assert [s.step for s in log.observations().steps] == [0, 1]
    assert log.write() is None
    assert MAX_RECORDED_STEPS == 10_000


def test_a_failing_write_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = ObservationLog(_base(), blocker / "sub", spare_memory=lambda: 1 // 0)
    log.add(StepRecord(step=0, duration_ns=S))
    assert log.write() is None
    log.close()
