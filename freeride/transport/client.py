"""The synchronous control client (for the CLI and scripts): one request, one reply, a deadline."""

from __future__ import annotations

from pathlib import Path

import msgspec
import zmq

from freeride import protocol as p
from freeride.auth import CurveClientKeys, KeysMissing, Refused, check_ipc_socket
from freeride.transport.endpoints import nobody_listens, refused_at
from freeride.transport.frames import encoder
from freeride.transport.guard import guard_client

__all__ = ["ControlClient", "ManagerUnreachable"]


class ManagerUnreachable(ConnectionError):
    """No manager answered on the control endpoint in time."""


class ControlClient:
    """Request/reply to a manager's control endpoint, with a deadline per call."""

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0, curve: CurveClientKeys | None = None) -> None:
        """Connect to ``endpoint``; a tcp one with ``curve``, or the keys in :func:`~freeride.auth.default_keys_dir`.

        Raises:
            KeysMissing: a tcp endpoint and no CURVE keys.
            UnsafeDirectory: an ipc socket, or its directory, that may be another user's.
        """
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # the send has the deadline too: after a refused handshake libzmq may hold no pipe to queue a
        # request on, and a send without one blocks for ever
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        try:
            guard_client(self._sock, endpoint, curve)
        except (KeysMissing, Refused):
            self.close()
            raise
        self._sock.connect(endpoint)
        self._decoder: msgspec.msgpack.Decoder[p.ControlReply] = msgspec.msgpack.Decoder(p.ControlReply)

    def request(self, req: p.ControlRequest) -> p.ControlReply:
        """Send ``req`` and wait for the reply.

        Raises:
            ManagerUnreachable: no reply within ``timeout_s``.
            UnsafeDirectory: the ipc socket, or its directory, may be another user's.
            ValueError: the reply did not decode.
        """
        if self._sock is None:
            raise RuntimeError("ControlClient is closed")
        if nobody_listens(self.endpoint):
            raise ManagerUnreachable(  # nothing to wait for
                f"no FreeRide manager runs on {self.endpoint} (no socket there); "
                "start one with `freeride serve` (same --runtime-dir) or pass --runtime-dir"
            )
        if self.endpoint.startswith("ipc://"):
            check_ipc_socket(Path(self.endpoint[6:]))  # as it is now: a request may carry secrets
            if refused_at(self.endpoint[6:]):
                raise ManagerUnreachable(  # nothing to wait for either
                    f"no FreeRide manager runs on {self.endpoint} (its socket is left from one that has gone); "
                    "start one with `freeride serve` (same --runtime-dir) or pass --runtime-dir"
                )
        try:
            self._sock.send(encoder.encode(req))
        except zmq.Again:
            raise ManagerUnreachable(
                f"no FreeRide manager took a request on {self.endpoint} within {self.timeout_s:g}s (none listens, "
                "or it refused this user); start one with `freeride serve` (same --runtime-dir) or pass --runtime-dir"
            ) from None
        if not self._sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
            raise ManagerUnreachable(
                f"no FreeRide manager answered on {self.endpoint} within {self.timeout_s:g}s; "
                "start one with `freeride serve` (same --runtime-dir) or pass --runtime-dir"
            )
        frame = self._sock.recv()
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as exc:
            raise ValueError(f"malformed reply from manager: {exc}") from None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
