"""Messages to frames and back: one encoder, and typed decoding that returns a :class:`BadFrame` instead of raising."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import msgspec

__all__ = ["BUBBLE_END", "BUBBLE_START", "HELLO_ACK", "BadFrame", "decode", "encoder"]

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
