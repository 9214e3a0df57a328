"""The public API for iterative side tasks.

An iterative side task is async Python that does its work in steps and lets
the runtime decide when each step may start::

    class PiEstimate(IterativeTask):
        step_time = 0.002           # seconds; a hint until steps are measured

        def __init__(self, *, batch: int = 100_000) -> None:
            self.batch, self.hits, self.total = batch, 0, 0

        def step(self) -> None:
            xy = torch.rand(self.batch, 2)
            self.hits += int((xy.square().sum(1) <= 1).sum())
            self.total += self.batch

        def metrics(self) -> dict[str, float]:
            return {"pi": 4 * self.hits / max(self.total, 1)}

        def state_dict(self) -> dict[str, object]:
            return {"hits": self.hits, "total": self.total}

        def load_state_dict(self, state: dict[str, object]) -> None:
            self.hits, self.total = int(state["hits"]), int(state["total"])

The default :meth:`IterativeTask.run` loops ``async with gate.step(): self.step()``
until :meth:`IterativeTask.done`. ``gate.step()`` is the cooperative yield: it
returns only when a bubble is granted to the task *and* the task's estimated
step time (the hint, then a high percentile of the recently measured steps of
the same kind, see :meth:`IterativeTask.step_kind`) fits in what is left of it
minus a safety margin; otherwise the task is parked. Tasks
with their own loop override :meth:`IterativeTask.run` and call ``gate.step()``
around each unit of work.

State returned by :meth:`IterativeTask.state_dict` is checkpointed (with
``torch.save``) between steps and when the task is stopped, and handed to
:meth:`IterativeTask.load_state_dict` when a cancelled, crashed or preempted
task starts again.

The lifecycle, in the order the runtime calls a task (one worker process)::

    __init__(**options)            options checked against its signature at submit
    setup(ctx)                     build models and data on ctx.torch_device
    load_state_dict(state)         only when a checkpoint exists: after setup, so
                                   the state has something to load into
    ( on_resume()                  a grant starts: the device is the task's
      steps ...                    each one inside the grant, if it fits
      on_pause() )*                the grant ends (the bubble is over)
    state_dict()                   at periodic checkpoints and at stop, whenever
                                   can_checkpoint() says the state is consistent
    teardown()                     once, however the task ends

An exception in ``__init__`` or ``setup`` fails the task for good (a restart
would raise it again); one in a step fails it and restarts it from its last
checkpoint. At a stop, a task whose :meth:`IterativeTask.can_checkpoint` says no
runs on (inside bubbles) to its next consistent point while the stop timeout
allows; past that, the last checkpoint is kept and the status says so.

A task that waits for its own input (a spool directory, a queue, a socket)
waits through the gate, ``item = await gate.wait_for(queue.get())`` or
``async for item in gate.idle_until(source):``: meanwhile it gives every
bubble back, still answers a stop (it is checkpointed, not killed) and keeps
its status fresh. ``gate.remaining()`` says how much of the current grant is
left, and ``gate.report(loss=...)`` publishes metrics between checkpoints.
"""

from __future__ import annotations

import abc
import inspect
import logging
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

__all__ = [
    "IterativeTask",
    "StepEstimates",
    "StepEstimator",
    "StepGate",
    "TaskContext",
    "TaskStopped",
    "UnboundedGate",
    "run_alone",
]


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
        yet runs only at the start of a bubble until it has been measured.
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


class StepEstimator:
    """Conservative running estimate of the next step's duration.

    The 90th percentile (nearest rank) of the last ``window`` measured steps:
    a lasting slowdown shows at once, while a single outlier (a step that was
    preempted, the first step's warm-up) does not shut the task out of every
    bubble. Until a step has been measured it uses the hint (or ``-1``).
    """

    def __init__(self, hint_ns: int = -1, *, window: int = 16) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.hint_ns = hint_ns
        self._recent: deque[int] = deque(maxlen=window)

    def observe(self, duration_ns: int) -> None:
        self._recent.append(duration_ns)

    @property
    def estimate_ns(self) -> int:
        """The estimate, or -1 if nothing is known yet."""
        if not self._recent:
            return self.hint_ns
        ordered = sorted(self._recent)
        return ordered[int(0.9 * (len(ordered) - 1))]


class StepEstimates:
    """One :class:`StepEstimator` per step kind; the hint applies to the default kind ``""``."""

    def __init__(self, hint_ns: int = -1, *, window: int = 16) -> None:
        self._window = window
        self._by_kind: dict[str, StepEstimator] = {"": StepEstimator(hint_ns, window=window)}

    def _of(self, kind: str) -> StepEstimator:
        estimator = self._by_kind.get(kind)
        if estimator is None:
            estimator = self._by_kind[kind] = StepEstimator(window=self._window)
        return estimator

    def observe(self, kind: str, duration_ns: int) -> None:
        self._of(kind).observe(duration_ns)

    def estimate_ns(self, kind: str = "") -> int:
        """The estimate for a step of ``kind``, or -1 if nothing is known yet."""
        estimator = self._by_kind.get(kind)
        return -1 if estimator is None else estimator.estimate_ns

    def kinds(self) -> list[str]:
        return list(self._by_kind)


class UnboundedGate:
    """A gate that never parks: runs a task alone and measures its steps.

    Used to profile a task (step time, peak memory) before it is placed, and to
    test tasks without a manager.
    """

    def __init__(self, *, max_steps: int | None = None) -> None:
        self.max_steps = max_steps
        self.durations_ns: list[int] = []
        self.kinds: list[str] = []
        """The kind of each measured step, in order."""

        self.reported: dict[str, float] = {}
        """The metrics last published with :meth:`report`."""

    @property
    def steps(self) -> int:
        return len(self.durations_ns)

    def remaining(self) -> float | None:
        return None  # no grant: nothing bounds a step

    def report(self, **metrics: float) -> None:
        self.reported.update(metrics)

    async def wait_for(self, awaitable: Awaitable[_T]) -> _T:
        return await awaitable

    async def idle_until(self, source: AsyncIterable[_T]) -> AsyncIterator[_T]:
        async for item in source:
            yield item

    @asynccontextmanager
    async def step(self, kind: str = "") -> AsyncIterator[None]:
        if self.max_steps is not None and self.steps >= self.max_steps:
            raise TaskStopped(f"ran {self.max_steps} steps")
        t0 = time.monotonic_ns()
        yield
        self.durations_ns.append(time.monotonic_ns() - t0)
        self.kinds.append(kind)


async def run_alone(
    task: IterativeTask, *, steps: int, ctx: TaskContext | None = None, gate: UnboundedGate | None = None
) -> list[int]:
    """Set up ``task`` and run at most ``steps`` steps back to back.

    Pass ``gate`` to read more than the durations afterwards (the kind of each step).

    Returns:
        The measured duration of each step in nanoseconds.
    """
    if ctx is None:
        ctx = TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=Path.cwd())
    if gate is None:
        gate = UnboundedGate()
    gate.max_steps = steps
    await task.setup(ctx)
    try:
        await task.run(gate)
    except TaskStopped:
        pass
    finally:
        await task.teardown()
    return gate.durations_ns
