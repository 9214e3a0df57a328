"""Messages to frames and back: one encoder, and typed decoding that returns a :class:`BadFrame` instead of raising."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import msgspec

from freeride.protocol.worker import Holdback

__all__ = [
    "BUBBLE_END",
    "BUBBLE_START",
    "HELLO_ACK",
    "BadFrame",
    "decode",
    "encoder",
    "hello_ack_topic",
    "read_hello_ack",
]

_M = TypeVar("_M")


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A frame that could not be decoded, and why."""

    reason: str
    size: int


encoder = msgspec.msgpack.Encoder()
"""The one encoder of every socket (msgpack, the default map layout)."""


def decode(decoder: msgspec.msgpack.Decoder[_M], frame: bytes) -> _M | BadFrame:
    """``frame`` decoded by ``decoder``, or a :class:`BadFrame` that says why it did not decode."""
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        return BadFrame(reason=str(exc), size=len(frame))


BUBBLE_START = b"S"
"""The first byte of a bubble start on a rank's bubble publisher (armed workers subscribe to these only)."""
BUBBLE_END = b"E"
"""The first byte of a bubble end there (only the manager follows those)."""
HELLO_ACK = b"H"
"""A topic nothing is published on: the manager subscribes to it on every rank it has heard say hello, and
the rank's publisher takes that subscription as the acknowledgement of its ``Hello``."""


_holdback_decoder = msgspec.msgpack.Decoder(Holdback)


def hello_ack_topic(holdback: Holdback | None) -> bytes:
    """The manager's acknowledgement topic: :data:`HELLO_ACK`, then the rule of its held-back steps, if any.

    A rank does not publish the bubbles of the steps held back (the manager
    grants them to no one): nobody wakes for them, so that held-back steps
    cost what a rank with no side work costs. The job's name in the rule is
    left empty: each rank fills in its own.
    """
    if holdback is None or not holdback.enabled:
        return HELLO_ACK
    return HELLO_ACK + encoder.encode(msgspec.structs.replace(holdback, job=""))


def read_hello_ack(topic: bytes) -> Holdback | BadFrame | None:
    """What an acknowledgement ``topic`` (without the subscribe byte) says of held-back steps.

    ``None``: nothing (a manager that holds none back, or a topic that is not an acknowledgement).
    """
    if not topic.startswith(HELLO_ACK) or len(topic) == len(HELLO_ACK):
        return None
    return decode(_holdback_decoder, topic[len(HELLO_ACK) :])
