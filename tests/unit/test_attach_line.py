"""Each rank writes one line when FreeRide attaches: framework, rank, stage, device, mode, manager or not."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import pytest

from freeride import protocol as p
from freeride.backends.launch import ENV_MODE
from freeride.backends.session import BackendConfig, BackendSession, attach_logger
from freeride.transport import EventEmitter


class _Emitter:
    """Stands in for the EventEmitter (no socket); ``sent`` says whether a manager took anything."""

    def __init__(self, sent: int) -> None:
        self.sent, self.dropped = sent, 0

    def wait_connected(self, timeout_ms: int) -> bool:

        return True

    def emit(self, event: p.BackendEvent) -> bool:
        return self.sent > 0

    def close(self, goodbye: p.Goodbye | None = None, *, linger_ms: int = 200) -> None:
        pass


def _session(endpoint: str, sent: int, framework: str = "deepspeed") -> BackendSession:
    config = BackendConfig(endpoint=endpoint, rank=3, stage=1, num_stages=2, device="cpu:3", framework=framework)
    session = BackendSession(config, emitter=cast(EventEmitter, _Emitter(sent)))
    session.close()
    return session


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "[attach]" in line]


def test_one_line_says_who_attached_and_that_no_manager_is_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_MODE, "profile")
    endpoint = f"ipc://{tmp_path}/events"
    _session(endpoint, sent=0)
    (line,) = _lines(capsys)
    assert line == (
        f"freeride: [attach] deepspeed rank 3 stage 1/2 on cpu:3, profile mode: no manager at {endpoint}"
        " (events are dropped until one starts)"
    )


@pytest.mark.parametrize("framework", ["deepspeed", "megatron", "torchpipe", "sim"])
def test_a_manager_that_took_the_hello_is_reachable(framework: str, capsys: pytest.CaptureFixture[str]) -> None:
    _session("tcp://127.0.0.1:9", sent=1, framework=framework)
    (line,) = _lines(capsys)
    assert line.startswith(f"freeride: [attach] {framework} rank 3 stage 1/2 on cpu:3, emit mode: manager reachable")


def test_the_line_is_written_whatever_the_script_did_to_logging(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # as a script that quiets everything but errors
    try:
        _session("tcp://127.0.0.1:9", sent=0)
    finally:
        root.setLevel(level)
    assert len(_lines(capsys)) == 1
    attach_logger().setLevel(logging.WARNING)  # the one way to silence it
    try:
        _session("tcp://127.0.0.1:9", sent=0)
    finally:
        attach_logger().setLevel(logging.INFO)
    assert _lines(capsys) == []


def test_a_rank_without_a_pipeline_says_it_has_no_bubbles(capsys: pytest.CaptureFixture[str]) -> None:
    config = BackendConfig(
        endpoint="tcp://127.0.0.1:9", rank=0, stage=0, num_stages=1, device="cpu:0", framework="megatron"
    )
    BackendSession(config, emitter=cast(EventEmitter, _Emitter(1))).close()
    (line,) = _lines(capsys)
    assert line.startswith(
        "freeride: [attach] megatron rank 0 stage 0/1 on cpu:0, pipeline size 1: no pipeline bubbles"
    )
