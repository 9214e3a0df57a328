"""Where a rank's events go: bubble events to its publisher once it publishes, step reports together now and then.

The emitter and the publisher here are recorders standing in for the sockets (tests/ipc/test_following_ranks.py
runs the real ones against a real manager).
"""

from __future__ import annotations

from typing import cast

import pytest
from _sessionfix import Recorder

from freeride import protocol as p
from freeride.backends import session as session_module
from freeride.backends.session import BackendConfig, BackendSession
from freeride.transport import BubblePublisher, EventEmitter

MS = 1_000_000


def _session(emitter: Recorder, publisher: Recorder | None) -> BackendSession:
    config = BackendConfig(endpoint="ipc:///nonexistent/events", rank=0, stage=0, num_stages=2, device="cpu:0",
                           framework="test", min_bubble_ns=0)  # fmt: skip
    return BackendSession(
        config, emitter=cast(EventEmitter, emitter), publisher=cast(BubblePublisher | None, publisher)
    )


def _steps(rank: BackendSession, first: int, count: int) -> None:
    for step in range(first, first + count):
        rank.bubble_started(step, 5 * MS)
        rank.bubble_ended()
        rank.step_finished(step, 50 * MS)


def test_a_publishing_rank_sends_its_bubbles_to_the_publisher_and_its_step_reports_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emitter, publisher = Recorder(), Recorder()
    monkeypatch.setattr(session_module, "REPORTS_EVERY_NS", 3600 * 10**9)
    rank = _session(emitter, publisher)
    _steps(rank, 0, 5)
    assert emitter.kinds() == ["Hello"], "no message a step to the manager: nothing of these steps went yet"
    assert publisher.kinds() == ["BubbleStarted", "BubbleEnded"] * 5
    monkeypatch.setattr(session_module, "REPORTS_EVERY_NS", 0)
    rank.bubble_started(5, 5 * MS)  # due: the kept reports go as the stage starts to wait
    assert emitter.kinds() == ["Hello"] + ["StepFinished"] * 5
    assert [e.step for e in emitter.events[1:] if isinstance(e, p.StepFinished)] == [0, 1, 2, 3, 4]
    rank.bubble_ended()
    rank.step_finished(5, 50 * MS)
    rank.close()
    assert emitter.kinds()[-2:] == ["StepFinished", "Goodbye"], "the goodbye sends what is kept"
    goodbye = emitter.events[-1]
    assert isinstance(goodbye, p.Goodbye) and goodbye.last_bubble == (5, 0), "it names the last bubble published"


def test_a_rank_that_does_not_publish_sends_everything_to_the_manager_each_report_with_the_next_bubble() -> None:
    emitter = Recorder()
    rank = _session(emitter, None)
    _steps(rank, 0, 2)
    rank.bubble_started(2, 5 * MS)
    assert emitter.kinds() == [
        "Hello",
        "BubbleStarted", "BubbleEnded",
        "BubbleStarted", "StepFinished", "BubbleEnded",
        "BubbleStarted", "StepFinished",
    ]  # fmt: skip
    rank.close()
    goodbye = emitter.events[-1]
    assert isinstance(goodbye, p.Goodbye) and goodbye.last_bubble is None, "its bubbles came on the same socket"


def test_steps_without_bubbles_send_their_reports_now_and_then(monkeypatch: pytest.MonkeyPatch) -> None:
    emitter, publisher = Recorder(), Recorder()
    monkeypatch.setattr(session_module, "REPORTS_EVERY_NS", 3600 * 10**9)
    rank = _session(emitter, publisher)
    for step in range(3):
        rank.step_finished(step, 50 * MS)
    assert emitter.kinds() == ["Hello"]
    monkeypatch.setattr(session_module, "REPORTS_EVERY_NS", 0)
    rank.step_finished(3, 50 * MS)
    assert emitter.kinds() == ["Hello"] + ["StepFinished"] * 3
    rank.heartbeat()
    assert emitter.kinds()[-2:] == ["StepFinished", "Heartbeat"]
