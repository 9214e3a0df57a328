"""A training rank's sockets: its events to the manager and its bubble starts to armed workers.

Both are synchronous, never block and never raise into the training step; what
they cannot send they count.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import zmq

from freeride import protocol as p
from freeride.auth import CurveClientKeys, KeysMissing, Refused, check_private_dir
from freeride.transport.endpoints import nobody_listens
from freeride.transport.frames import BUBBLE_END, BUBBLE_START, HELLO_ACK, BadFrame, encoder, read_hello_ack
from freeride.transport.guard import guard_client

__all__ = ["BubblePublisher", "EventEmitter"]

logger = logging.getLogger(__name__)

_BACKOFF_AFTER = 8
"""Failed sends in a row after which the emitter only tries now and then."""
_BACKOFF_MIN_NS = 1_000_000
"""First pause between tries; it doubles with every further failure, up to 128 ms."""
_LOOK_AGAIN_NS = 100_000_000
"""How often an emitter whose runtime directory does not exist yet looks for it."""


class EventEmitter:
    """Synchronous, non-blocking sender of backend events.

    Safe to call from the training step: :meth:`emit` costs about a
    microsecond, never blocks (``NOBLOCK`` with ``IMMEDIATE``, so nothing is
    queued for a manager that is not there) and never raises. After a fork the
    child's copy goes silent instead of touching the parent's socket.
    """

    def __init__(self, endpoint: str, *, sndhwm: int = 1024, curve: CurveClientKeys | None = None) -> None:
        self.endpoint = endpoint
        self.sent = 0
        self.dropped = 0
        self._failures = 0
        """Consecutive failed sends."""
        self._retry_at_ns = 0
        self._pid = os.getpid()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context(io_threads=1)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock: zmq.Socket[bytes] | None = sock
        self._curve = curve
        self._connect_at_ns = 0
        """While the ipc endpoint's directory does not exist yet: when to look for it again (else 0)."""
        if endpoint.startswith("ipc://") and not os.path.isdir(os.path.dirname(endpoint[6:])):
            # libzmq would connect by itself once a socket appears there, unchecked: whoever made the
            # directory first would hear us; connect only once it exists and is checked
            self._connect_at_ns = time.monotonic_ns()
            return
        self._connect()

    def _connect(self) -> None:
        sock = self._sock
        assert sock is not None
        self._connect_at_ns = 0
        try:
            guard_client(sock, self.endpoint, self._curve)
        except (KeysMissing, Refused) as exc:  # never raise into the training job: go silent, say why once
            logger.error("[emit] cannot safely connect to %s, events are dropped: %s", self.endpoint, exc)
            self.close()
            return
        sock.connect(self.endpoint)

    def _connect_when_there(self) -> bool:
        """Connect once the endpoint's directory exists and passes the checks; whether connected."""
        now = time.monotonic_ns()
        if now < self._connect_at_ns:
            return False
        if not os.path.isdir(os.path.dirname(self.endpoint[6:])):
            self._connect_at_ns = now + _LOOK_AGAIN_NS
            return False
        self._connect()
        return self._sock is not None

    def wait_connected(self, timeout_ms: int) -> bool:
        """Wait at most ``timeout_ms`` for the connection to the manager; whether it is up.

        For the first message only (a rank's ``Hello`` at attach, which would be
        dropped if sent before the connection is up): an ipc endpoint whose socket
        file does not exist has no manager to wait for, and returns at once.
        """
        sock = self._sock
        if sock is None or os.getpid() != self._pid:
            return False
        if self._connect_at_ns and not self._connect_when_there():
            return False
        if nobody_listens(self.endpoint):
            return False
        try:
            return bool(sock.poll(timeout_ms, zmq.POLLOUT))
        except Exception:  # never raise into the training job
            logger.debug("[emit] waiting for the connection failed", exc_info=True)
            return False

    def emit(self, event: p.BackendEvent) -> bool:
        """Send ``event`` if the manager can take it now; count a drop otherwise."""
        sock = self._sock
        if sock is None or os.getpid() != self._pid:
            self.dropped += 1
            return False
        if self._failures >= _BACKOFF_AFTER and time.monotonic_ns() < self._retry_at_ns:
            self.dropped += 1  # nobody has listened lately: don't pay for a failed send each time
            return False
        if self._connect_at_ns and not self._connect_when_there():
            self.dropped += 1
            return False
        try:
            sock.send(encoder.encode(event), zmq.NOBLOCK)
        except zmq.Again:
            self._failed()
            return False
        except Exception:  # the training step must never see our errors
            self._failed()
            logger.debug("[emit] send failed", exc_info=True)
            return False
        self._failures = 0
        self.sent += 1
        return True

    def _failed(self) -> None:
        self.dropped += 1
        self._failures += 1
        if self._failures >= _BACKOFF_AFTER:
            doublings = min(self._failures - _BACKOFF_AFTER, 7)
            self._retry_at_ns = time.monotonic_ns() + (_BACKOFF_MIN_NS << doublings)

    def close(self, goodbye: p.Goodbye | None = None, *, linger_ms: int = 200) -> None:
        """Send ``goodbye`` (waiting at most ``linger_ms``) and release the socket."""
        sock, ctx = self._sock, self._ctx
        self._sock = self._ctx = None
        if sock is None or ctx is None:
            return
        if os.getpid() != self._pid:  # inherited across fork: not ours to close
            return
        try:
            if goodbye is not None:
                sock.setsockopt(zmq.LINGER, linger_ms)
                try:
                    sock.send(encoder.encode(goodbye), zmq.NOBLOCK)
                except zmq.Again:
                    self.dropped += 1
            sock.close()
            ctx.term()
        except Exception:
            logger.debug("[shutdown] emitter close failed", exc_info=True)


class BubblePublisher:
    """A rank's PUB of its bubble events: the starts for armed workers, starts and ends for the manager.

    Bound by the rank (one per rank, in the manager's runtime directory). Each
    message is one frame, a topic byte (:data:`BUBBLE_START`, :data:`BUBBLE_END`)
    and the event: armed workers subscribe to the starts, the manager to both
    while side work may run on the rank's device (decision D50). Like
    :class:`EventEmitter` it never blocks and never raises: a PUB drops what a
    slow subscriber cannot take, and one without subscribers drops at once, in
    the caller's thread, waking nobody.

    It is an XPUB: the subscriptions it receives are how the manager answers the
    rank's ``Hello`` (:meth:`acknowledged`).
    """

    def __init__(self, endpoint: str, *, sndhwm: int = 16) -> None:
        """Bind ``endpoint``; :attr:`bound` says whether that worked (its directory may not exist yet)."""
        self.endpoint = endpoint
        self.dropped = 0
        self._pid = os.getpid()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context(io_threads=1)
        self._acked = False
        self.holdback: p.Holdback | None = None
        """The held-back steps the manager's acknowledgement named (``None``: none; see :func:`hello_ack_topic`)."""
        sock = self._ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.LINGER, 0)
        self._sock: zmq.Socket[bytes] | None = sock
        try:
            if endpoint.startswith("ipc://"):  # a directory another user can enter would let them listen
                check_private_dir(Path(endpoint[6:]).parent)
            sock.bind(endpoint)
        except (zmq.ZMQError, OSError, Refused) as exc:
            logger.debug("[emit] cannot publish bubbles on %s: %s", endpoint, exc)
            self.close()

    @property
    def bound(self) -> bool:
        return self._sock is not None

    def acknowledged(self, *, look: bool = False) -> bool:
        """Whether a manager subscribes to :data:`HELLO_ACK` here: it knows this rank.

        The subscription's topic also carries the manager's rule of held-back
        steps (:attr:`holdback`, see :func:`~freeride.transport.frames.hello_ack_topic`).

        Until it does, and with ``look``, this reads the subscriptions queued
        since (a few bytes each, only topics new or left: a handful in a rank's
        life); a manager that went away has left the topic. Never blocks or
        raises.
        """
        sock = self._sock
        if sock is None or os.getpid() != self._pid:
            return False
        if self._acked and not look:
            return True
        try:
            while True:
                frame = sock.recv(zmq.NOBLOCK)
                if frame[1:].startswith(HELLO_ACK):
                    self._acked = frame[:1] == b"\x01"
                    rule = read_hello_ack(frame[1:]) if self._acked else None
                    self.holdback = None if isinstance(rule, BadFrame) else rule
        except zmq.Again:
            pass
        except Exception:  # the training step must never see our errors
            logger.debug("[emit] reading subscriptions failed", exc_info=True)
        return self._acked

    def publish(self, event: p.BubbleStarted | p.BubbleEnded) -> None:
        """Offer ``event`` to whoever subscribes to its kind; never blocks or raises."""
        sock = self._sock
        if sock is None or os.getpid() != self._pid:
            self.dropped += 1
            return
        topic = BUBBLE_START if isinstance(event, p.BubbleStarted) else BUBBLE_END
        try:
            sock.send(topic + encoder.encode(event), zmq.NOBLOCK)
        except Exception:  # the training step must never see our errors
            self.dropped += 1
            logger.debug("[emit] publish failed", exc_info=True)

    def close(self, *, linger_ms: int = 200) -> None:
        """Release the socket (idempotent), waiting at most ``linger_ms`` for what is queued to go.

        The rank's last bubble end is published just before it closes: without
        the wait, a subscriber the I/O thread had not reached yet would lose it.
        A publisher without subscribers holds nothing and returns at once.
        libzmq removes the socket file.
        """
        sock, ctx = self._sock, self._ctx
        self._sock = self._ctx = None
        if sock is None or ctx is None or os.getpid() != self._pid:
            return
        try:
            sock.setsockopt(zmq.LINGER, linger_ms)
            sock.close()
            ctx.term()
        except Exception:
            logger.debug("[shutdown] publisher close failed", exc_info=True)
