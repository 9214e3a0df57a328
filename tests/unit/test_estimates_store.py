"""Step-time estimates kept across runs: the file, its key, and what a bad file does (nothing)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from freeride.clock import ManualClock
from freeride.sidetask import IterativeTask, StepEstimates
from freeride.tasks.estimates import (
    EstimatesKey,
    EstimatesStore,
    KindTimes,
    canonical_options,
    cpu_threads,
    device_kind,
    estimates_path,
    load_estimates,
    save_estimates,
)

CPU = "cpu Test CPU x4"


class Sized(IterativeTask):
    def __init__(self, *, size: int = 8, mode: str = "fast") -> None:
        self.size, self.mode = size, mode

    def step(self) -> None:
        pass


def _key(*, device: str = CPU, **options: object) -> EstimatesKey:
    return EstimatesKey(target="m:Sized", options=canonical_options(Sized, dict(options)), device_kind=device)


def test_estimates_round_trip(tmp_path: Path) -> None:
    key = _key(size=4)
    kinds = {"forward0": KindTimes(recent=[3, 1, 2], first_ns=9), "": KindTimes(recent=[5])}
    path = estimates_path(tmp_path / "estimates", key)
    save_estimates(path, key, kinds)
    assert load_estimates(path, key) == kinds
    assert '"size": 4' in path.read_text()  # the key is readable in the file


def test_a_write_replaces_the_file_at_once_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = _key()
    path = estimates_path(tmp_path, key)
    save_estimates(path, key, {"a": KindTimes(recent=[1])})
    before = path.read_bytes()

    def crash(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        save_estimates(path, key, {"a": KindTimes(recent=[2])})
    assert path.read_bytes() == before  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # and no temporary file left


@pytest.mark.parametrize("content", [b"{not json", b'{"version": 1}', b'{"version": 99, "key": {}, "kinds": {}}', b""])
def test_a_corrupt_file_is_ignored_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    key = _key()
    path = estimates_path(tmp_path, key)
    path.write_bytes(content)
    estimates = StepEstimates()
    with caplog.at_level(logging.WARNING, logger="freeride.tasks.estimates"):
        assert EstimatesStore(path, key).seed(estimates) == 0
    assert estimates.recent() == {}
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_a_file_of_another_key_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mine, theirs = _key(size=4), _key(size=8)
    path = estimates_path(tmp_path, mine)
    save_estimates(path, theirs, {"a": KindTimes(recent=[1])})  # copied over, or a digest collision
    with caplog.at_level(logging.WARNING, logger="freeride.tasks.estimates"):
        assert load_estimates(path, mine) == {}
    assert "written for" in caplog.text


def test_the_key_separates_options_and_device_kinds_but_not_spellings_of_defaults() -> None:
    digests = {
        _key().digest(),
        _key(size=16).digest(),
        _key(mode="slow").digest(),
        _key(device="cpu Test CPU x8").digest(),
        _key(device="cuda NVIDIA H100 80GB HBM3").digest(),
    }
    assert len(digests) == 5
    assert _key(size=8, mode="fast").digest() == _key().digest()  # the defaults, given or not


def test_an_unknown_option_is_named_with_the_options_there_are() -> None:
    with pytest.raises(ValueError, match=r"bogus.*size, mode"):
        canonical_options(Sized, {"bogus": 1})


def test_the_cpu_kind_counts_the_threads_a_task_computes_with(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads() == 1 and device_kind("cpu").endswith(" x1")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads() == cores


def test_seeded_times_count_as_measured_and_are_written_back_at_most_every_period(tmp_path: Path) -> None:
    clock = ManualClock()
    key = _key()
    path = estimates_path(tmp_path, key)
    save_estimates(path, key, {"b": KindTimes(recent=[1000] * 16, first_ns=3000)})
    store = EstimatesStore(path, key, every_ns=5_000_000_000, clock=clock)
    estimates = StepEstimates()
    assert store.seed(estimates) == 1
    assert estimates.estimate_ns("b") == 1000 and estimates.cold_ns("b") == 3000  # and its warm-up
    estimates.observe("b", 1200)
    assert estimates.estimate_ns("b") == 1000 and estimates.cold_ns("b") == -1
    for _ in range(16):
        estimates.observe("b", 2000)  # new measurements displace the stored ones
    assert estimates.estimate_ns("b") == 2000
    store.save_if_due(estimates)
    assert load_estimates(path, key)["b"].recent == [1000] * 16  # not yet due
    clock.advance(5_000_000_000)
    store.save_if_due(estimates)
    assert load_estimates(path, key)["b"] == KindTimes(recent=[2000] * 16, first_ns=1200)


def test_a_failing_write_is_reported_once_and_never_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    key = _key()
    store = EstimatesStore(estimates_path(blocker / "estimates", key), key)  # a directory under a file
    estimates = StepEstimates()
    with caplog.at_level(logging.WARNING, logger="freeride.tasks.estimates"):
        for d in (1, 2):
            estimates.observe("a", d)
            assert store.save(estimates) is False
    assert len(caplog.records) == 1
