"""The wire contract: every message that crosses a FreeRide process boundary.

Three sockets carry three unions, each decoded by one typed decoder:

* backend -> manager (:data:`BackendEvent`): a training rank reports its
  bubbles. Fire-and-forget; the training process never waits.
* manager <-> side-task worker (:data:`ManagerToWorker`, :data:`WorkerToManager`):
  the manager grants bubble time, the worker reports what it did with it.
* control client <-> manager (:data:`ControlRequest`, :data:`ControlReply`):
  submit, cancel and inspect side tasks.

Every Struct is frozen and tagged. Events are past tense, commands imperative.
Timestamps are ``time.monotonic_ns()`` integers: CLOCK_MONOTONIC is shared by
all processes of one host, and FreeRide only crosses process boundaries inside
one node. Evolve append-only: new fields get defaults, and
:data:`PROTOCOL_VERSION` changes only when an old peer could misread a frame.

The modules, one family each: :mod:`~freeride.protocol.base` (the version,
frame limits, bounded field types and the base Struct),
:mod:`~freeride.protocol.backend` (backend events),
:mod:`~freeride.protocol.spec` (a side task's spec and states),
:mod:`~freeride.protocol.worker` (manager <-> worker) and
:mod:`~freeride.protocol.control` (control requests and replies).
"""

from freeride.protocol import backend, base, control, spec, worker
from freeride.protocol.backend import *  # noqa: F403
from freeride.protocol.base import *  # noqa: F403
from freeride.protocol.control import *  # noqa: F403
from freeride.protocol.spec import *  # noqa: F403
from freeride.protocol.worker import *  # noqa: F403

__all__: list[str] = []
__all__ += backend.__all__
__all__ += base.__all__
__all__ += control.__all__
__all__ += spec.__all__
__all__ += worker.__all__
