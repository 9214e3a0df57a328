"""Sockets and addresses: the only package of FreeRide that imports ``zmq``.

Each class here owns exactly one socket for its whole life and closes it in
:meth:`close` (idempotent). Callers in other modules see typed messages, never
frames:

* :class:`EventEmitter`: synchronous PUSH in a training rank. Never blocks and
  never raises into the training step; what it cannot send it counts.
* :class:`EventReceiver`: the manager's PULL for backend events.
* :class:`BubblePublisher` / :class:`BubbleListener` / :class:`BubbleFollower` (and
  :class:`HelloAcks`): a
  rank's PUB of its bubble events, an armed worker's SUB to its starts (one hop
  from bubble start to step) and the manager's SUB to its starts and ends while
  side work may run on its device; ipc only, in the manager's private runtime
  directory.
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

The modules, one job each: :mod:`~freeride.transport.endpoints` (addresses and
the runtime directory), :mod:`~freeride.transport.guard` (who may connect),
:mod:`~freeride.transport.frames` (encoding and decoding),
:mod:`~freeride.transport.emitter` (a rank's sockets),
:mod:`~freeride.transport.owner` (what the asyncio owners share),
:mod:`~freeride.transport.server` (the manager's sockets),
:mod:`~freeride.transport.worker` (a worker's sockets) and
:mod:`~freeride.transport.client` (the control client).
"""

from freeride.transport.client import ControlClient, ManagerUnreachable
from freeride.transport.emitter import BubblePublisher, EventEmitter
from freeride.transport.endpoints import MAX_IPC_PATH, Endpoints, bubbles_endpoint, default_runtime_dir, nobody_listens
from freeride.transport.frames import BadFrame, hello_ack_topic
from freeride.transport.guard import ZapHandler, curve_keypair, zap_verdict
from freeride.transport.owner import new_async_context
from freeride.transport.server import (
    BubbleEvent,
    BubbleFollower,
    ControlServer,
    EventReceiver,
    HelloAcks,
    WorkerHub,
)
from freeride.transport.worker import BubbleListener, WorkerLink, wait_readable, worker_identity

__all__ = [
    "MAX_IPC_PATH",
    "BadFrame",
    "BubbleEvent",
    "BubbleFollower",
    "BubbleListener",
    "BubblePublisher",
    "ControlClient",
    "ControlServer",
    "Endpoints",
    "EventEmitter",
    "EventReceiver",
    "HelloAcks",
    "ManagerUnreachable",
    "WorkerHub",
    "WorkerLink",
    "ZapHandler",
    "bubbles_endpoint",
    "curve_keypair",
    "default_runtime_dir",
    "hello_ack_topic",
    "new_async_context",
    "nobody_listens",
    "wait_readable",
    "worker_identity",
    "zap_verdict",
]
