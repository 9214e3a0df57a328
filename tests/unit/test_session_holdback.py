"""A rank publishes no bubble of a step its manager holds back: nobody wakes for a bubble nobody may take.

The rule of held-back steps comes with the manager's acknowledgement (its
subscription topic); the rank fills in its job's name, so it holds back the
very steps the manager's schedule does. It counts the bubbles it kept to
itself in the step's report, which the manager adds to the bubble time held
back. The emitter and the publisher are recorders standing in for the sockets
(tests/ipc/test_hello_ack.py and tests/ipc/test_training_cost_served.py run
the real ones against a real manager).
"""

from __future__ import annotations

from typing import cast

import msgspec
import pytest
from _sessionfix import Recorder

from freeride import protocol as p
from freeride.backends.session import BackendConfig, BackendSession
from freeride.holdback import HoldbackSchedule
from freeride.transport import BubblePublisher, EventEmitter
from freeride.transport.frames import HELLO_ACK, BadFrame, hello_ack_topic, read_hello_ack

MS = 1_000_000
RULE = p.Holdback(block_steps=2, every=4, max_every=4, start_step=1)


def _session(emitter: Recorder, publisher: Recorder | None) -> BackendSession:
    config = BackendConfig(endpoint="ipc:///nonexistent/events", rank=0, stage=0, num_stages=2, device="cpu:0",
                           framework="test", min_bubble_ns=0, job="job-7")  # fmt: skip
    return BackendSession(
        config, emitter=cast(EventEmitter, emitter), publisher=cast(BubblePublisher | None, publisher)
    )


def _run(rank: BackendSession, steps: int) -> None:
    for step in range(steps):
        for _ in range(2):  # two bubbles a step
            rank.bubble_started(step, 5 * MS)
            rank.bubble_ended(t_ns=rank.open_since_ns + 3 * MS)
        rank.step_finished(step, 50 * MS)
    rank.close()


def test_the_acknowledgement_topic_carries_the_rule_without_the_job() -> None:
    topic = hello_ack_topic(msgspec.structs.replace(RULE, job="whatever"))
    assert topic.startswith(HELLO_ACK) and read_hello_ack(topic) == RULE  # job ""
    assert hello_ack_topic(None) == HELLO_ACK and read_hello_ack(HELLO_ACK) is None
    assert hello_ack_topic(p.Holdback(every=0)) == HELLO_ACK  # holding nothing back: nothing to say
    assert isinstance(read_hello_ack(HELLO_ACK + b"\xc1junk"), BadFrame)


def test_held_back_steps_are_not_published_and_their_bubbles_are_reported_with_the_step() -> None:
    emitter, publisher = Recorder(), Recorder(holdback=RULE)
    rank = _session(emitter, publisher)
    _run(rank, 40)
    held = {s for s in range(40) if HoldbackSchedule(msgspec.structs.replace(RULE, job="job-7")).held(s)}
    assert len(held) == 10  # one block of two in each cycle of four blocks, from step 1
    published = {e.step for e in publisher.events if isinstance(e, p.BubbleStarted | p.BubbleEnded)}
    assert published == set(range(40)) - held
    reports = {e.step: e for e in emitter.events if isinstance(e, p.StepFinished)}
    assert len(reports) == 40
    for step, report in reports.items():
        if step in held:
            assert (report.unpublished, report.unpublished_ns) == (2, 6 * MS), report
        else:
            assert (report.unpublished, report.unpublished_ns) == (0, 0), report
        assert report.bubble_ns == 6 * MS  # the step's bubbles, published or not
    goodbye = emitter.events[-1]
    assert isinstance(goodbye, p.Goodbye) and goodbye.last_bubble is not None
    assert goodbye.last_bubble[0] not in held, "the goodbye names the last bubble that went out"


@pytest.mark.parametrize("publisher", [Recorder(), None], ids=["no rule", "no publisher"])
def test_without_a_rule_every_bubble_goes_out(publisher: Recorder | None) -> None:
    emitter = Recorder()
    rank = _session(emitter, publisher)
    _run(rank, 12)
    sink = publisher if publisher is not None else emitter
    assert {e.step for e in sink.events if isinstance(e, p.BubbleStarted)} == set(range(12))
    assert all(e.unpublished == 0 for e in emitter.events if isinstance(e, p.StepFinished))


def test_a_rule_that_comes_later_applies_from_the_first_step_asked_about_after_it() -> None:
    emitter, publisher = Recorder(), Recorder()
    rank = _session(emitter, publisher)
    schedule = HoldbackSchedule(msgspec.structs.replace(RULE, job="job-7"))
    first = next(s for s in range(100) if schedule.held(s))
    for step in range(first + 1):
        if step == first:
            publisher.holdback = RULE  # the manager answered while step ``first`` began
        rank.bubble_started(step, 5 * MS)
        rank.bubble_ended()
        rank.step_finished(step, 50 * MS)
    assert rank.held(first) and not rank.held(first - 1)
    assert first not in {e.step for e in publisher.events if isinstance(e, p.BubbleStarted)}
