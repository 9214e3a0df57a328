"""Sockets and addresses: the only module of FreeRide that imports ``zmq``.

Each class here owns exactly one socket for its whole life and closes it in
:meth:`close` (idempotent). Callers in other modules see typed messages, never
frames:

* :class:`EventEmitter`: synchronous PUSH in a training rank. Never blocks and
  never raises into the training step; what it cannot send it counts.
* :class:`EventReceiver`: the manager's PULL for backend events.
* :class:`BubblePublisher` / :class:`BubbleListener`: a rank's PUB of its bubble
  starts and an armed worker's SUB to it (one hop from bubble start to step; ipc
  only, in the manager's private runtime directory).
* :class:`WorkerHub` / :class:`WorkerLink`: ROUTER (manager) and DEALER
  (side-task worker) of the grant channel.
* :class:`ControlServer` / :class:`ControlClient`: ROUTER (manager) and a
  synchronous DEALER with a deadline (CLI).

Frames that do not decode come back as :class:`BadFrame` with a reason, so the
owner can log and count them and keep going. Every receiving socket refuses
frames over its protocol limit (``ZMQ_MAXMSGSIZE``: libzmq drops the sender's
connection before the frame is buffered whole), and the manager's sockets hand
out what is queued in batches of a bounded size, so one busy socket cannot keep
the others' owners from running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar, cast

import msgspec
import zmq
import zmq.asyncio
import zmq.utils.z85

from freeride import protocol as p
from freeride.auth import (
    CurveClientKeys,
    CurveServerKeys,
    KeysMissing,
    Refused,
    check_ipc_socket,
    default_keys_dir,
    load_client_keys,
)

__all__ = [
    "MAX_IPC_PATH",
    "BadFrame",
    "BubbleListener",
    "BubblePublisher",
    "ControlClient",
    "ControlServer",
    "Endpoints",
    "EventEmitter",
    "EventReceiver",
    "ManagerUnreachable",
    "WorkerHub",
    "WorkerLink",
    "ZapHandler",
    "bubbles_endpoint",
    "curve_keypair",
    "default_runtime_dir",
    "new_async_context",
    "nobody_listens",
    "wait_readable",
    "worker_identity",
    "zap_verdict",
]

logger = logging.getLogger(__name__)

MAX_IPC_PATH = 100
"""Longest ipc:// socket path we accept (the kernel's limit is 107 bytes)."""

_M = TypeVar("_M")

_BACKOFF_AFTER = 8
"""Failed sends in a row after which the emitter only tries now and then."""
_BACKOFF_MIN_NS = 1_000_000
"""First pause between tries; it doubles with every further failure, up to 128 ms."""


class ManagerUnreachable(ConnectionError):
    """No manager answered on the control endpoint in time."""


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A frame that could not be decoded, and why."""

    reason: str
    size: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Endpoints:
    """The three addresses of one manager."""

    events: str
    """Backends push bubble events here."""
    control: str
    """CLI and API clients submit, cancel and query here."""
    workers: str
    """Side-task workers connect here (always node-local)."""

    def __post_init__(self) -> None:
        for name in ("events", "control", "workers"):
            addr = getattr(self, name)
            if not addr.startswith(("ipc://", "tcp://")):
                raise ValueError(f"endpoints.{name}: expected ipc:// or tcp://, got {addr!r}")
            if addr.startswith("ipc://") and len(addr[6:].encode()) > MAX_IPC_PATH:
                raise ValueError(
                    f"endpoints.{name}: ipc path {addr[6:]!r} is {len(addr[6:].encode())} bytes; "
                    f"sockets need <= {MAX_IPC_PATH}. Choose a shorter --runtime-dir."
                )

    @classmethod
    def ipc(cls, runtime_dir: Path) -> Endpoints:
        """Endpoints as socket files in ``runtime_dir``."""
        return cls(
            events=f"ipc://{runtime_dir}/events",
            control=f"ipc://{runtime_dir}/control",
            workers=f"ipc://{runtime_dir}/workers",
        )

    @classmethod
    def tcp(cls, host: str, port: int, runtime_dir: Path) -> Endpoints:
        """Events on ``port`` and control on ``port + 1``; workers stay on ipc."""
        return cls(
            events=f"tcp://{host}:{port}",
            control=f"tcp://{host}:{port + 1}",
            workers=f"ipc://{runtime_dir}/workers",
        )

    def tcp_endpoints(self) -> list[str]:
        """The endpoints on tcp: these need CURVE keys."""
        return [a for a in (self.events, self.control, self.workers) if a.startswith("tcp://")]

    def socket_dirs(self) -> list[Path]:
        """Directories of the ipc socket files (kept private); the workers' first, where the serve lock lives."""
        dirs: list[Path] = []
        for addr in (self.workers, self.events, self.control):
            if addr.startswith("ipc://") and (d := Path(addr[6:]).parent) not in dirs:
                dirs.append(d)
        return dirs


def bubbles_endpoint(events: str, rank: int) -> str:
    """Where rank ``rank`` publishes its bubble starts, next to an ipc events socket ("" for tcp).

    The manager derives the same address and honours only a rank that announces
    exactly it: an armed worker connects only inside the manager's private directory.
    """
    if not events.startswith("ipc://"):
        return ""  # a remote rank: its workers keep the two-hop path
    path = f"{Path(events[6:]).parent}/bubbles-{rank}"
    return f"ipc://{path}" if len(path.encode()) <= MAX_IPC_PATH else ""


RUNTIME_DIR_ENV = "FREERIDE_RUNTIME_DIR"


def nobody_listens(endpoint: str) -> bool:
    """Whether nothing can be listening on ``endpoint``: an ipc one whose socket file does not exist.

    A tcp endpoint may always have a listener; only a reply can tell.
    """
    return endpoint.startswith("ipc://") and not os.path.exists(endpoint[6:])


def default_runtime_dir() -> Path:
    """Where a manager's sockets live unless ``--runtime-dir`` says.

    ``$FREERIDE_RUNTIME_DIR`` if set, else ``$XDG_RUNTIME_DIR/freeride`` if that
    exists, else ``<tmp>/freeride-<uid>``.
    """
    given = os.environ.get(RUNTIME_DIR_ENV)
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "freeride"
    return Path(tempfile.gettempdir()) / f"freeride-{os.getuid()}"


def new_async_context() -> zmq.asyncio.Context:
    """A fresh context for one process's async sockets (never the global instance)."""
    return zmq.asyncio.Context()


# --------------------------------------------------------------------------
# who may connect (see docs/security.md)
# --------------------------------------------------------------------------

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"freeride"


def curve_keypair() -> tuple[bytes, bytes]:
    """A new CURVE key pair, ``(public, secret)`` as Z85 text (for :func:`freeride.auth.create_keys`)."""
    if not zmq.has("curve"):
        raise KeysMissing("this libzmq has no CURVE support; install pyzmq's wheel (built with libsodium)")
    public, secret = zmq.curve_keypair()
    return public, secret


def _guard_server(sock: zmq.asyncio.Socket, endpoint: str, curve: CurveServerKeys | None) -> None:
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


def _guard_client(sock: zmq.Socket[bytes], endpoint: str, curve: CurveClientKeys | None) -> None:
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


_encoder = msgspec.msgpack.Encoder()


def _decode(decoder: msgspec.msgpack.Decoder[_M], frame: bytes) -> _M | BadFrame:
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        return BadFrame(reason=str(exc), size=len(frame))


# --------------------------------------------------------------------------
# backend side
# --------------------------------------------------------------------------


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
        try:
            _guard_client(sock, endpoint, curve)
        except (KeysMissing, Refused) as exc:  # never raise into the training job: go silent, say why once
            logger.error("[emit] cannot safely connect to %s, events are dropped: %s", endpoint, exc)
            self.close()
            return
        sock.connect(endpoint)

    def wait_connected(self, timeout_ms: int) -> bool:
        """Wait at most ``timeout_ms`` for the connection to the manager; whether it is up.

        For the first message only (a rank's ``Hello`` at attach, which would be
        dropped if sent before the connection is up): an ipc endpoint whose socket
        file does not exist has no manager to wait for, and returns at once.
        """
        sock = self._sock
        if sock is None or os.getpid() != self._pid:
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
        try:
            sock.send(_encoder.encode(event), zmq.NOBLOCK)
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
                    sock.send(_encoder.encode(goodbye), zmq.NOBLOCK)
                except zmq.Again:
                    self.dropped += 1
            sock.close()
            ctx.term()
        except Exception:
            logger.debug("[shutdown] emitter close failed", exc_info=True)


class BubblePublisher:
    """A rank's PUB of its :class:`~freeride.protocol.BubbleStarted` events, for armed workers.

    Bound by the rank (one per rank, in the manager's runtime directory); workers
    connect and disconnect as they are armed. Like :class:`EventEmitter` it never
    blocks and never raises: a PUB drops what a slow subscriber cannot take, and
    one without subscribers drops at once.
    """

    def __init__(self, endpoint: str, *, sndhwm: int = 16) -> None:
        """Bind ``endpoint``; :attr:`bound` says whether that worked (its directory may not exist yet)."""
        self.endpoint = endpoint
        self.dropped = 0
        self._pid = os.getpid()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context(io_threads=1)
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.LINGER, 0)
        self._sock: zmq.Socket[bytes] | None = sock
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            logger.debug("[emit] cannot publish bubbles on %s: %s", endpoint, exc)
            self.close()

    @property
    def bound(self) -> bool:
        return self._sock is not None

    def publish(self, event: p.BubbleStarted) -> None:
        """Offer ``event`` to the armed workers; never blocks or raises."""
        sock = self._sock
        if sock is None or os.getpid() != self._pid:
            self.dropped += 1
            return
        try:
            sock.send(_encoder.encode(event), zmq.NOBLOCK)
        except Exception:  # the training step must never see our errors
            self.dropped += 1
            logger.debug("[emit] publish failed", exc_info=True)

    def close(self) -> None:
        """Release the socket (idempotent); libzmq removes the socket file."""
        sock, ctx = self._sock, self._ctx
        self._sock = self._ctx = None
        if sock is None or ctx is None or os.getpid() != self._pid:
            return
        try:
            sock.close()
            ctx.term()
        except Exception:
            logger.debug("[shutdown] publisher close failed", exc_info=True)


# --------------------------------------------------------------------------
# manager side
# --------------------------------------------------------------------------


class _AsyncOwner(Generic[_M]):
    def __init__(self, sock: zmq.asyncio.Socket, decoder: msgspec.msgpack.Decoder[_M]) -> None:
        self._sock: zmq.asyncio.Socket | None = sock
        self._decoder = decoder
        self._plain: zmq.Socket[bytes] | None = zmq.Socket.shadow(sock.underlying)
        """The same socket without asyncio, for non-blocking reads (it owns nothing: closing ``_sock`` closes it)."""

    def _live(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            raise RuntimeError("socket already closed")
        return self._sock

    def close(self) -> None:
        self._plain = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _frame_nowait(self) -> bytes | None:
        """The next single-frame message if one is already queued, without waiting.

        What pyzmq's asyncio socket itself does for a non-blocking receive (a
        plain receive on a shadow of the same socket), without the Future it
        wraps the answer in: a third of the cost, and the workers read their
        sockets this way between every two side-task steps. Reading
        ``ZMQ_EVENTS`` instead would swallow the edge-triggered wake-up of a
        later ``await recv()``; a receive does not, since every asyncio wait
        checks the socket's events before it parks.
        """
        plain = self._plain
        if plain is None:
            raise RuntimeError("socket already closed")
        try:
            return plain.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def _queued_nowait(self) -> list[bytes] | None:
        """The next message if one is already queued, without waiting (see :meth:`_frame_nowait`)."""
        plain = self._plain
        if plain is None:
            raise RuntimeError("socket already closed")
        try:
            return plain.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def _drain(self, limit: int) -> list[list[bytes]]:
        """Up to ``limit`` messages already queued, without waiting.

        Receives until one would block: a receive that finds the socket empty
        re-arms its descriptor, so the next message signals it (cheaper under a
        flood than asking ``ZMQ_EVENTS`` before each receive).
        """
        out: list[list[bytes]] = []
        while len(out) < limit:
            frames = self._queued_nowait()
            if frames is None:
                break
            out.append(frames)
        return out

    async def _recv_frames_batch(self, limit: int) -> list[list[bytes]]:
        # Awaiting a socket with messages queued returns at once without giving the
        # event loop a turn: a flooded socket read one message per await starves every
        # other task. The caller handles a batch, then yields.
        first = await self._live().recv_multipart()
        return [first, *self._drain(limit - 1)]


class EventReceiver(_AsyncOwner[p.BackendEvent]):
    """The manager's PULL socket for backend events.

    It waits on the socket's descriptor itself (a reader on the event loop) and
    reads with non-blocking receives, never through pyzmq's asyncio receive:
    events mostly come one at a time, each a wake-up of the manager, and
    pyzmq's Future per receive makes each wake-up cost more CPU, which on a
    machine without spare cores is taken from training (docs/benchmarks.md,
    "Where the simulated pipeline's slowdown goes"). Only this object reads
    the socket, so the descriptor's edge-triggered signal is never taken by
    another reader.
    """

    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, *, rcvhwm: int = 100_000, curve: CurveServerKeys | None = None
    ) -> None:
        sock = ctx.socket(zmq.PULL)
        _guard_server(sock, endpoint, curve)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_EVENT_FRAME)
        sock.bind(endpoint)
        super().__init__(sock, msgspec.msgpack.Decoder(p.BackendEvent))
        self._reading: tuple[asyncio.AbstractEventLoop, int] | None = None
        """The loop and descriptor the reader is registered on (``None``: not yet)."""
        self._ready = asyncio.Event()

    def close(self) -> None:
        if self._reading is not None:
            loop, fd = self._reading
            self._reading = None
            if not loop.is_closed():
                loop.remove_reader(fd)
        super().close()

    async def _frames(self, limit: int) -> list[list[bytes]]:
        batch = self._drain(limit)
        while not batch:
            if self._reading is None:
                plain = self._plain
                if plain is None:
                    raise RuntimeError("socket already closed")
                loop, fd = asyncio.get_running_loop(), cast(int, plain.getsockopt(zmq.FD))
                loop.add_reader(fd, self._ready.set)
                self._reading = (loop, fd)
            self._ready.clear()
            # the descriptor signals a change, not a level: look again after clearing, then wait
            batch = self._drain(limit)
            if not batch:
                await self._ready.wait()
                batch = self._drain(limit)
        return batch

    async def recv(self) -> p.BackendEvent | BadFrame:
        return self._event((await self._frames(1))[0])

    async def recv_batch(self, limit: int) -> list[p.BackendEvent | BadFrame]:
        """The next event, and up to ``limit - 1`` more that are already queued."""
        return [self._event(frames) for frames in await self._frames(limit)]

    def _event(self, frames: list[bytes]) -> p.BackendEvent | BadFrame:
        if len(frames) != 1:
            return BadFrame(reason=f"expected 1 frame, got {len(frames)}", size=sum(map(len, frames)))
        return _decode(self._decoder, frames[0])


class _RouterOwner(_AsyncOwner[_M]):
    async def recv(self) -> tuple[bytes, _M | BadFrame]:
        return self._message(await self._live().recv_multipart())

    async def recv_batch(self, limit: int) -> list[tuple[bytes, _M | BadFrame]]:
        """The next message, and up to ``limit - 1`` more that are already queued."""
        return [self._message(frames) for frames in await self._recv_frames_batch(limit)]

    def _message(self, frames: list[bytes]) -> tuple[bytes, _M | BadFrame]:
        if len(frames) != 2:
            ident = frames[0] if frames else b""
            return ident, BadFrame(reason=f"expected 2 frames, got {len(frames)}", size=sum(map(len, frames)))
        return frames[0], _decode(self._decoder, frames[1])

    def _send_nowait(self, ident: bytes, msg: msgspec.Struct) -> bool:
        # pyzmq's asyncio socket reports a failed NOBLOCK send through the returned
        # future, not by raising: peer gone (ROUTER_MANDATORY) or its queue full
        fut = self._live().send_multipart([ident, _encoder.encode(msg)], zmq.NOBLOCK)
        exc = fut.exception() if isinstance(fut, asyncio.Future) and fut.done() else None
        if exc is not None:
            logger.warning("[send] to %r failed: %s", ident, exc)
            return False
        return True


class WorkerHub(_RouterOwner[p.WorkerToManager]):
    """The manager's ROUTER for side-task workers; identities are task ids."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        sock = ctx.socket(zmq.ROUTER)
        _guard_server(sock, endpoint, None)  # always ipc: the peer-uid check
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_WORKER_FRAME)
        sock.bind(endpoint)
        super().__init__(sock, msgspec.msgpack.Decoder(p.WorkerToManager))

    def send_nowait(self, ident: bytes, msg: p.ManagerToWorker) -> bool:
        return self._send_nowait(ident, msg)


class ControlServer(_RouterOwner[p.ControlRequest]):
    """The manager's ROUTER for control clients."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *, curve: CurveServerKeys | None = None) -> None:
        sock = ctx.socket(zmq.ROUTER)
        _guard_server(sock, endpoint, curve)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_CONTROL_FRAME)
        sock.bind(endpoint)
        super().__init__(sock, msgspec.msgpack.Decoder(p.ControlRequest))

    def reply_nowait(self, ident: bytes, msg: p.ControlReply) -> bool:
        return self._send_nowait(ident, msg)


# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------


def worker_identity(task_id: int) -> bytes:
    return f"task-{task_id}".encode()


class WorkerLink(_AsyncOwner[p.ManagerToWorker]):
    """A side-task worker's DEALER to the manager."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, task_id: int) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, worker_identity(task_id))
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(endpoint)
        super().__init__(sock, msgspec.msgpack.Decoder(p.ManagerToWorker))

    async def recv(self) -> p.ManagerToWorker | BadFrame:
        frame = await self._live().recv()
        return _decode(self._decoder, frame)

    def recv_nowait(self) -> p.ManagerToWorker | BadFrame | None:
        """A message that has already arrived, or ``None`` (see ``_frame_nowait``)."""
        frame = self._frame_nowait()
        if frame is None:
            return None
        msg: p.ManagerToWorker | BadFrame = _decode(self._decoder, frame)
        return msg

    def send_nowait(self, msg: p.WorkerToManager) -> None:
        """Queue ``msg`` for the manager (a DEALER queues while the manager is away)."""
        fut = self._live().send(_encoder.encode(msg), zmq.NOBLOCK)
        exc = fut.exception() if isinstance(fut, asyncio.Future) and fut.done() else None
        if exc is not None:
            logger.warning("[send] to the manager failed: %s", exc)


class BubbleListener(_AsyncOwner[p.BubbleStarted]):
    """An armed worker's SUB to its rank's :class:`BubblePublisher`.

    Conflated: only the latest bubble start is kept, so a worker that has not
    read for a while finds the current bubble, not a queue of past ones.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        if not endpoint.startswith("ipc://"):
            raise ValueError(f"bubble starts are followed over ipc only, got {endpoint!r}")
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.CONFLATE, 1)  # before connect
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_EVENT_FRAME)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        self.endpoint = endpoint
        super().__init__(sock, msgspec.msgpack.Decoder(p.BubbleStarted))

    def recv_nowait(self) -> p.BubbleStarted | BadFrame | None:
        """The latest bubble start not yet read, or ``None`` (see :meth:`WorkerLink.recv_nowait`)."""
        frame = self._frame_nowait()
        if frame is None:
            return None
        event: p.BubbleStarted | BadFrame = _decode(self._decoder, frame)
        return event


async def wait_readable(*owners: WorkerLink | BubbleListener) -> None:
    """Return once one of ``owners`` has a message queued (read it with its ``recv_nowait``).

    Polls through pyzmq's asyncio poller, which keeps each socket's edge-triggered
    wake-ups consistent with its owner's own awaits.
    """
    poller = zmq.asyncio.Poller()
    for owner in owners:
        poller.register(owner._live(), zmq.POLLIN)
    await poller.poll()


# --------------------------------------------------------------------------
# control client (synchronous, for the CLI and scripts)
# --------------------------------------------------------------------------


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
        try:
            _guard_client(self._sock, endpoint, curve)
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
        self._sock.send(_encoder.encode(req))
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
