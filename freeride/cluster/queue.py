"""The cluster queue as a named, detached Ray actor, and the one client that talks to it.

The actor holds a :class:`~freeride.cluster.ledger.Ledger` and answers one
msgpack-encoded :data:`~freeride.cluster.messages.QueueRequest` per call, one
call at a time (``max_concurrency=1``: the ledger needs no locks). It lives on
the Ray head node, so losing any other node leaves the queue whole; it lives
as long as the Ray cluster, or until ``freeride cluster stop``.

Ray is an optional extra (``pip install 'freeride-runtime[ray]'``); it is imported
only when a queue is reached.
"""

from __future__ import annotations

import logging
import socket
from types import ModuleType
from typing import Any

import msgspec

from freeride.cluster import messages as m
from freeride.cluster.ledger import Ledger

__all__ = ["NAMESPACE", "QUEUE_NAME", "ClusterQueue", "QueueActor", "QueueUnreachable", "RayMissing", "import_ray"]

logger = logging.getLogger(__name__)

QUEUE_NAME = "freeride-queue"
NAMESPACE = "freeride"


class RayMissing(RuntimeError):
    """Ray is not installed here."""


class QueueUnreachable(RuntimeError):
    """No queue on the Ray cluster, or it did not answer in time."""


def import_ray() -> ModuleType:
    """The ``ray`` module, or an error that says how to install it.

    Raises:
        RayMissing: Ray is not installed.
    """
    try:
        import ray
    except ImportError:
        raise RayMissing(
            "the cluster queue needs Ray: pip install 'freeride-runtime[ray]' (or `pip install ray`) on every node"
        ) from None
    return ray


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast when nothing listens at a ``HOST:PORT`` address (Ray itself retries for minutes).

    Raises:
        QueueUnreachable: the connection was refused or timed out.
    """
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise QueueUnreachable(
            f"no Ray cluster answers at {address} ({exc.strerror or exc}); give the head's GCS address"
            " (`ray status` there shows it) or start one with `ray start --head`"
        ) from None


class QueueActor:
    """The actor's body (Ray wraps it in :meth:`ClusterQueue.__init__`)."""

    def __init__(self) -> None:
        self._ledger = Ledger()

    def call(self, frame: bytes) -> bytes:
        try:
            request = m.decode_request(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return m.encode(m.Refused(reason=f"malformed request: {exc}"))
        return m.encode(self._ledger.handle(request))


class ClusterQueue:
    """A connection to the cluster queue; ``with ClusterQueue(address) as queue: queue.request(...)``."""

    def __init__(self, address: str, *, create: bool = False, timeout_s: float = 30.0) -> None:
        """Join the Ray cluster at ``address`` and find the queue (or create it, with ``create``).

        Raises:
            RayMissing: Ray is not installed.
            QueueUnreachable: no Ray cluster at ``address``, or no queue on it (and ``create`` not given).
        """
        ray = import_ray()
        _check_reachable(address)
        self._ray = ray
        self.timeout_s = timeout_s
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            try:
                ray.init(
                    address=address,
                    namespace=NAMESPACE,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                    include_dashboard=False,
                )
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise QueueUnreachable(
                    f"cannot join the Ray cluster at {address!r}: {exc} (start one with `ray start --head`)"
                ) from None
        self._actor: Any
        try:
            if create:
                self._actor = (
                    ray.remote(QueueActor)
                    .options(
                        name=QUEUE_NAME,
                        namespace=NAMESPACE,
                        lifetime="detached",
                        get_if_exists=True,
                        num_cpus=0,
                        max_concurrency=1,
                        # on the head: losing a worker node must not lose the queue
                        resources={"node:__internal_head__": 0.001},
                    )
                    .remote()
                )
            else:
                self._actor = ray.get_actor(QUEUE_NAME, namespace=NAMESPACE)
        except ValueError:
            self.close()
            raise QueueUnreachable(
                f"no FreeRide queue on the Ray cluster at {address!r}; `freeride cluster submit` creates it"
            ) from None

    def request(self, request: m.QueueRequest) -> m.QueueReply:
        """Send one request and wait for its reply.

        Raises:
            QueueUnreachable: no reply within ``timeout_s``, or the actor is gone.
        """
        ray = self._ray
        try:
            frame = ray.get(self._actor.call.remote(m.encode(request)), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise QueueUnreachable(f"the cluster queue did not answer within {self.timeout_s:g}s") from None
        except ray.exceptions.RayActorError as exc:
            raise QueueUnreachable(f"the cluster queue is gone: {exc}") from None
        if not isinstance(frame, bytes):
            raise QueueUnreachable(f"the cluster queue answered {type(frame).__name__}, not a frame")
        return m.decode_reply(frame)

    def destroy(self) -> None:
        """End the queue actor and forget every job in it."""
        self._ray.kill(self._actor, no_restart=True)

    def close(self) -> None:
        """Leave the Ray cluster if this object joined it (idempotent)."""
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns_ray = False

    def __enter__(self) -> ClusterQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
