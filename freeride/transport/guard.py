"""Who may connect (see docs/security.md): CURVE keys over tcp, the peer's uid over ipc, checked by one ZAP handler."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.utils.z85

from freeride.auth import (
    CurveClientKeys,
    CurveServerKeys,
    KeysMissing,
    check_ipc_socket,
    default_keys_dir,
    load_client_keys,
)

__all__ = ["ZapHandler", "curve_keypair", "guard_client", "guard_server", "zap_verdict"]

logger = logging.getLogger(__name__)

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"freeride"


def curve_keypair() -> tuple[bytes, bytes]:
    """A new CURVE key pair, ``(public, secret)`` as Z85 text (for :func:`freeride.auth.create_keys`)."""
    if not zmq.has("curve"):
        raise KeysMissing("this libzmq has no CURVE support; install pyzmq's wheel (built with libsodium)")
    public, secret = zmq.curve_keypair()
    return public, secret


def guard_server(sock: zmq.asyncio.Socket, endpoint: str, curve: CurveServerKeys | None) -> None:
    # With a ZAP domain set, every connection, NULL (ipc) or CURVE (tcp), waits for the
    # ZapHandler's verdict; the manager binds that handler before any of its sockets.
    sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
    if endpoint.startswith("tcp://"):
        if curve is None:
            raise KeysMissing(
                f"{endpoint}: tcp endpoints need CURVE keys; run `freeride keys` and serve with --keys-dir"
            )
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)


def guard_client(sock: zmq.Socket[bytes], endpoint: str, curve: CurveClientKeys | None) -> None:
    """Make ``sock`` safe to connect to ``endpoint``: CURVE keys over tcp; over ipc, a socket of this user's.

    Raises:
        KeysMissing: a tcp endpoint and no CURVE keys.
        UnsafeDirectory: an ipc socket, or its directory, that may be another user's.
    """
    if endpoint.startswith("ipc://"):
        check_ipc_socket(Path(endpoint[6:]))
    if endpoint.startswith("tcp://"):
        keys = curve if curve is not None else load_client_keys(default_keys_dir())
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def zap_verdict(
    mechanism: bytes, address: bytes, credentials: list[bytes], *, uid: int, curve_clients: frozenset[bytes]
) -> str | None:
    """Why a connection is refused, or ``None`` to let it in.

    CURVE (tcp): the client's public key must be one of ``curve_clients``.
    NULL (ipc): the peer's uid, which libzmq reads with ``SO_PEERCRED`` and
    appends to the address as ``:uid:gid:pid``, must be ``uid``; no
    credentials (another platform, or NULL over tcp) means no entry.
    """
    if mechanism == b"CURVE":
        known = len(credentials) == 1 and len(credentials[0]) == 32
        return None if known and zmq.utils.z85.encode(credentials[0]) in curve_clients else "unknown CURVE client key"
    if mechanism == b"NULL":
        parts = address.rsplit(b":", 3)
        if len(parts) == 4 and parts[1].isdigit():
            peer = int(parts[1])
            return None if peer == uid else f"peer uid {peer} is not the manager's (uid {uid})"
        return f"no peer credentials on {address!r}"
    return f"mechanism {mechanism!r} not accepted"


class ZapHandler:
    """Answers libzmq's authentication requests (ZAP, RFC 27) for one context's sockets.

    Must be bound before the sockets it guards: libzmq lets a connection in
    unchecked when a socket has a ZAP domain but no handler is bound.
    """

    def __init__(
        self, ctx: zmq.asyncio.Context, *, curve_clients: frozenset[bytes] = frozenset(), uid: int | None = None
    ) -> None:
        """Bind the context's handler; ipc peers must have ``uid`` (default: ours)."""
        self._uid = os.getuid() if uid is None else uid
        self._clients = curve_clients
        self.refused = 0
        """Connections refused so far."""
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(_ZAP_ENDPOINT)
        self._sock: zmq.asyncio.Socket | None = sock

    async def serve(self) -> None:
        """Answer requests until cancelled."""
        while self._sock is not None:
            frames = await self._sock.recv_multipart()
            # [peer, "", version, request id, domain, address, identity, mechanism, credentials...]
            if len(frames) < 8 or frames[1] != b"" or frames[2] != b"1.0":
                continue  # not from libzmq: nothing sensible to answer
            ident, request_id, address, mechanism = frames[0], frames[3], frames[5], frames[7]
            reason = zap_verdict(mechanism, address, frames[8:], uid=self._uid, curve_clients=self._clients)
            if reason is not None:
                self.refused += 1
                if self.refused <= 10 or self.refused % 1000 == 0:
                    logger.warning("[auth] refused a %s connection from %r: %s", mechanism.decode(), address, reason)
            code, text = (b"200", b"OK") if reason is None else (b"400", reason.encode())
            await self._sock.send_multipart([ident, b"", b"1.0", request_id, code, text, b"", b""])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
