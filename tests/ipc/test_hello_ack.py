"""A rank's ``Hello`` is repeated at once until a manager acknowledges it, then now and then.

The acknowledgement is the manager's subscription to :data:`~freeride.transport.frames.HELLO_ACK` on
the rank's bubble publisher (:class:`~freeride.transport.HelloAcks`). A rank is a
:class:`~freeride.backends.session.BackendSession` in this process, over real sockets.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import zmq
from conftest import wait_until

from freeride import protocol as p
from freeride.backends.session import HELLO_EVERY_NS, BackendConfig, BackendSession
from freeride.serve.manager import Manager
from freeride.transport import bubbles_endpoint
from freeride.transport.frames import HELLO_ACK

MS = 1_000_000


def _session(endpoint: str) -> BackendSession:
    config = BackendConfig(endpoint=endpoint, rank=0, stage=0, num_stages=2, device="cpu:0", framework="test")
    return BackendSession(config)


async def _train(session: BackendSession, seconds: float) -> None:
    """Steps of a few milliseconds for ``seconds``: what gives the session its chances to say hello."""
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        session.bubble_started(step, 2 * MS)
        await asyncio.sleep(0.003)
        session.bubble_ended()
        session.step_finished(step, 5 * MS)
        step += 1


def _hellos(sock: zmq.Socket[bytes]) -> list[p.Hello]:
    decoder = msgspec.msgpack.Decoder(p.BackendEvent)
    out = []
    while sock.poll(0):
        event = decoder.decode(sock.recv())
        if isinstance(event, p.Hello):
            out.append(event)
    return out


async def test_a_hello_nobody_took_is_repeated_at_once_until_acknowledged(runtime_dir: Path) -> None:
    """The manager's socket is there but drops what it gets (as a manager over its Hello cap would)."""
    events = f"ipc://{runtime_dir}/events"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    deaf = ctx.socket(zmq.PULL)
    deaf.bind(events)
    session = _session(events)
    try:
        await _train(session, 1.5)  # well under HELLO_EVERY_NS: without an answer, asked again and again
        unanswered = _hellos(deaf)
        assert HELLO_EVERY_NS > 1.5e9 and len(unanswered) >= 3, unanswered
        assert unanswered[-1].bubbles_endpoint == bubbles_endpoint(events, 0)
        assert not session.hello_acknowledged

        answer = ctx.socket(zmq.SUB)
        answer.setsockopt(zmq.SUBSCRIBE, HELLO_ACK)
        answer.connect(unanswered[-1].bubbles_endpoint)
        try:

            async def acknowledged() -> bool:
                await _train(session, 0.01)
                return session.hello_acknowledged

            deadline = time.monotonic() + 10
            while not await acknowledged():
                assert time.monotonic() < deadline, "the subscription never reached the rank"
            _hellos(deaf)  # one may have gone out before the answer came
            await _train(session, 1.0)
            assert _hellos(deaf) == [], "answered: repeated only every HELLO_EVERY_NS"
        finally:
            answer.close(0)
    finally:
        session.close()
        deaf.close(0)
        ctx.term()


async def test_a_manager_answers_every_rank_it_knows_followed_or_not(manager: Manager) -> None:
    session = _session(manager.config.endpoints.events)
    acks = manager._acks
    assert acks is not None
    endpoint = bubbles_endpoint(manager.config.endpoints.events, 0)
    try:
        deadline = time.monotonic() + 10
        while not session.hello_acknowledged:
            assert time.monotonic() < deadline, "no answer from the manager"
            await _train(session, 0.05)
        assert acks.connected == {endpoint}
        # learned (16 bubbles) with no side work here: no longer followed, still answered
        ledger = manager.schedulers["cpu:0"].ledger
        deadline = time.monotonic() + 20
        while not ledger.learned:
            assert time.monotonic() < deadline, "the device's bubbles were never learned"
            await _train(session, 0.05)
        await wait_until(lambda: manager._follower is not None and not manager._follower.followed, 5, "unfollowed")
        assert acks.connected == {endpoint} and session.hello_acknowledged
    finally:
        session.close()
    await wait_until(lambda: acks.connected == set(), 10, "the rank's answer to go with it")


async def test_the_answer_names_the_managers_held_back_steps_and_the_rank_holds_back_the_same(
    manager: Manager,
) -> None:
    """The acknowledgement's topic carries the rule of held-back steps (decision D61); the rank fills in
    its job's name and so holds back exactly the steps the manager grants to no one."""
    session = _session(manager.config.endpoints.events)
    try:
        deadline = time.monotonic() + 10
        while not session.hello_acknowledged:
            assert time.monotonic() < deadline, "no answer from the manager"
            await _train(session, 0.05)
        assert manager.config.holdback.enabled
        held = {step for step in range(3000) if session.held(step)}
        withheld = {step for step in range(3000) if manager.costs.withheld(0, step, 0) == "held_back"}
        assert held == withheld and len(held) > 50
    finally:
        session.close()
