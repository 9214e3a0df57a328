"""The side-task contract: the base class a task subclasses, the gate it awaits, what setup tells it, how it stops."""

from __future__ import annotations

import abc
import inspect
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

__all__ = ["IterativeTask", "StepGate", "TaskContext", "TaskStopped"]

_T = TypeVar("_T")


class TaskStopped(BaseException):
    """Raised out of ``gate.step()`` when the runtime stops the task.

    A ``BaseException`` (like ``CancelledError``) so that a task's own
    ``except Exception`` does not swallow it; the runtime checkpoints the task
    after it propagates.
    """


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskContext:
    """What the runtime tells a task in :meth:`IterativeTask.setup`."""

    task_id: int
    """Manager-assigned id (0 when the task runs alone)."""
    device: str
    """FreeRide device name the task shares, e.g. ``cuda:1`` or ``cpu:0``."""
    torch_device: str
    """Device string for torch: ``cuda:N`` on a GPU, ``cpu`` otherwise."""
    workdir: Path
    """Directory for the task's own outputs (created by the runtime)."""
    bubble_ns: int = 0
    """The device's typical bubble: half its bubble time lies in bubbles at least this long (0: not known).

    What a task that sizes its own steps sizes them by (see ``freeride.partition``).
    """
    memory_limit: int = -1
    """Bytes the task may use at its peak: its declared peak, or the manager's share of the spare memory
    (-1: no cap). What a task that sizes its own batches sizes them by."""
    restoring: bool = False
    """A checkpoint's state comes to :meth:`IterativeTask.load_state_dict` right after setup: what it
    brings (a measured plan, say) need not be made in setup."""
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("freeride.task"))


@runtime_checkable
class StepGate(Protocol):
    """What a task awaits between steps."""

    def step(self, kind: str = "") -> Any:
        """An async context manager around one step of ``kind``; entering may park the task."""
        ...

    @property
    def steps(self) -> int:
        """Steps completed so far (including those restored from a checkpoint)."""
        ...

    def remaining(self) -> float | None:
        """Seconds left in the current grant minus the safety margin; ``None`` outside a grant (or unbounded)."""
        ...

    def report(self, **metrics: float) -> None:
        """Publish metrics now (they show in ``freeride status``), between checkpoints."""
        ...

    async def wait_for(self, awaitable: Awaitable[_T]) -> _T:
        """Await the task's own I/O between steps, holding no bubble meanwhile.

        Raises:
            TaskStopped: The runtime stopped the task while it waited.
        """
        ...

    def idle_until(self, source: AsyncIterable[_T]) -> AsyncIterator[_T]:
        """Iterate ``source``, each wait for its next item as in :meth:`wait_for`."""
        ...


class IterativeTask(abc.ABC):
    """Base class of iterative side tasks.

    Subclasses take their options as keyword arguments of ``__init__`` (plain
    scalars: they arrive from the command line or the wire) and do cheap,
    host-side construction there; device memory is allocated in :meth:`setup`.
    """

    peak_memory: ClassVar[int] = -1
    """Declared peak device memory in bytes; -1 means measure it."""
    step_time: ClassVar[float] = -1.0
    """Expected step time in seconds, used until steps have been measured."""
    warm_up: ClassVar[bool] = True
    """Whether the runtime may rehearse the first steps of each kind before training starts and then undo
    them by restoring :meth:`state_dict` (see :mod:`freeride.worker.warmup`). Set it to False when a step
    changes anything the state does not hold (files written, a result sent elsewhere)."""
    device_kind: ClassVar[Literal["any", "gpu"]] = "any"
    """The device the task needs: a ``"gpu"`` task is never placed on a CPU device."""

    async def setup(self, ctx: TaskContext) -> None:  # noqa: B027 - optional hook
        """Allocate models and data on ``ctx.torch_device``."""

    @abc.abstractmethod
    def step(self) -> Any:
        """Do one unit of work. May be a coroutine function."""

    def done(self) -> bool:
        """Whether the task has finished its work (default: never)."""
        return False

    def step_kind(self) -> str:
        """What kind of work the next :meth:`step` does (default: ``""``, one kind).

        Steps of one kind share a running time estimate. A task whose steps
        differ widely by kind (a micro-batch's forward and backward vs. the
        optimizer update, training vs. a periodic evaluation) names them, so
        each must fit in a bubble on its own estimate rather than all on the
        slowest one. Keep the number of kinds small (tens): a kind not seen
        yet runs only at the start of a bubble until it has been measured,
        unless :meth:`step_cost` lets its time be estimated from the kinds
        measured already (and estimates measured in an earlier run are kept,
        see ``freeride profile-task``).
        """
        return ""

    def fit_piece(self, room_ns: int, estimate_ns: Callable[[str], int]) -> str | None:
        """Packing: choose the piece of pending work the next step runs (default: no choice).

        A task whose pending work can be split (fewer items in the next step)
        or reordered (another independent piece first) overrides this. Before
        each step inside a grant, the runtime passes the time left before the
        bubble's expected end minus the safety margin (``room_ns``, > 0) and
        the running estimate of each step kind (``estimate_ns(kind)``, -1 if
        not measured yet). The task returns the kind of the largest piece
        that fits (it may be the pending one), and from then on its
        :meth:`step_kind` returns that kind and its next :meth:`step` runs that
        piece, whether it runs in this bubble or, if the runtime finds that
        it does not fit after all, in a later one. ``None`` leaves the pending
        step as it is. Called often: keep it cheap (no device work).
        """
        return None

    def step_cost(self, kind: str) -> float | None:
        """Relative work of a step of ``kind`` (FLOPs, multiply-adds, elements...), or None if unknown.

        Only ratios between kinds of one task matter. A kind not measured yet is
        estimated as its cost times a high percentile of the time per cost of
        the kinds measured so far, so that it can start inside a bubble rather
        than only as a one-step probe at a bubble's start. Default: unknown.
        """
        return None

    def metrics(self) -> dict[str, float]:
        """Numbers to report as progress (loss, accuracy, residual, ...)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint; anything ``torch.save`` accepts."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore what :meth:`state_dict` returned; called after :meth:`setup`."""

    def can_checkpoint(self) -> bool:
        """Whether :meth:`state_dict` now describes a consistent point (default: always).

        Consulted before every checkpoint. A task in the middle of a unit it
        cannot save (half an epoch of a stream it cannot replay, a batch taken
        but not yet committed) says no, and the checkpoint waits.
        """
        return True

    def on_resume(self) -> None:  # noqa: B027 - optional hook
        """A grant has started and a step is about to run in it. Keep it cheap: it is bubble time."""

    def on_pause(self) -> None:  # noqa: B027 - optional hook
        """The grant has ended (its bubble is over or nothing more fits): training has the device again."""

    async def teardown(self) -> None:  # noqa: B027 - optional hook
        """Release resources; called once when the task stops for any reason."""

    async def run(self, gate: StepGate) -> None:
        """Run steps until :meth:`done`, each inside a granted bubble."""
        while not self.done():
            async with gate.step(self.step_kind()):
                result = self.step()
                if inspect.isawaitable(result):
                    await result
