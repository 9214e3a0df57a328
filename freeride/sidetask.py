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
import math
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

__all__ = [
    "IterativeTask",
    "StepCost",
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
    bubble_ns: int = 0
    """The device's typical bubble: half its bubble time lies in bubbles at least this long (0: not known).

    What a task that sizes its own steps sizes them by (see ``freeride.partition``).
    """
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
    def measured(self) -> bool:
        """Whether a step has been measured (or restored from an earlier run)."""
        return bool(self._recent)

    def recent(self) -> list[int]:
        """The measured durations the estimate is taken over, oldest first."""
        return list(self._recent)

    @property
    def estimate_ns(self) -> int:
        """The estimate, or -1 if nothing is known yet."""
        if not self._recent:
            return self.hint_ns
        ordered = sorted(self._recent)
        return ordered[int(0.9 * (len(ordered) - 1))]


_NEAR = 16
"""Measured kinds within this factor of an unmeasured kind's cost estimate it (see :class:`StepEstimates`)."""

StepCost = Callable[[str], float | None]
"""Relative work of a step of a kind, or None (see :meth:`IterativeTask.step_cost`)."""


class StepEstimates:
    """One :class:`StepEstimator` per step kind; the hint applies to the default kind ``""``.

    A kind with no measurement (and no hint) is estimated from its ``cost``, if
    the task gives one, and the measured kinds nearest in cost (within 16x):

    * from smaller kinds, in proportion to cost. Steps pay a fixed part
      (launches, Python) besides their work, so this errs high;
    * from larger kinds only where there is no smaller one, in proportion to the
      square root of the cost ratio: half the work takes 71 % of the time, a
      quarter 50 %, which errs high unless the fixed part dominates;

    the 90th percentile of those (rounded up: the largest of up to ten), and no
    less than any smaller kind measured. A tiny kind, mostly fixed part, never
    scales a large one. Erring high keeps a kind out of a few bubbles it would
    have fit; erring low would run a step past a bubble's end, into training.
    """

    def __init__(self, hint_ns: int = -1, *, window: int = 16, cost: StepCost | None = None) -> None:
        self._window = window
        self._by_kind: dict[str, StepEstimator] = {"": StepEstimator(hint_ns, window=window)}
        self._cost = cost
        self._costs: dict[str, float | None] = {}
        self._points: dict[str, tuple[int, float]] = {}
        """Measured kinds with a cost: (estimate, cost)."""
        self._scaled: dict[str, int] = {}
        """Cost-scaled estimates of unmeasured kinds, until the next measurement."""
        self._first: dict[str, int] = {}
        """The first measured step of each kind in this run."""
        self._cold: dict[str, int] = {}
        """Seeded kinds not yet run in this run: their first step's time in the run that measured them."""

    def _of(self, kind: str) -> StepEstimator:
        estimator = self._by_kind.get(kind)
        if estimator is None:
            estimator = self._by_kind[kind] = StepEstimator(window=self._window)
        return estimator

    def _measured_now(self, kind: str, estimator: StepEstimator) -> None:
        cost = self._cost_of(kind)
        if cost is not None:
            self._points[kind] = (estimator.estimate_ns, cost)
            self._scaled.clear()

    def observe(self, kind: str, duration_ns: int) -> None:
        estimator = self._of(kind)
        estimator.observe(duration_ns)
        self._first.setdefault(kind, duration_ns)
        self._cold.pop(kind, None)
        self._measured_now(kind, estimator)

    def seed(self, kind: str, durations_ns: Iterable[int], *, first_ns: int = -1) -> None:
        """Take ``durations_ns`` (from an earlier run) as measured; new measurements displace them.

        Args:
            kind: The step kind.
            durations_ns: Its recent step times, oldest first.
            first_ns: The first step of the kind in that run, warm-up included
                (see :meth:`cold_ns`).
        """
        estimator = self._of(kind)
        for duration in durations_ns:
            if duration > 0:
                estimator.observe(duration)
        if first_ns > 0 and kind not in self._first:
            self._cold[kind] = first_ns
        if estimator.measured:
            self._measured_now(kind, estimator)

    def first_ns(self, kind: str) -> int:
        """The first step of ``kind`` measured in this run, else the one seeded, else -1."""
        return self._first.get(kind, self._cold.get(kind, -1))

    def cold_ns(self, kind: str) -> int:
        """How long the first step of a seeded ``kind`` took in the run that measured it, until one runs here.

        A fresh process pays a kind's warm-up (caches, allocations, kernel
        selection) again on its first step of the kind; -1 once that step has
        run here, or if nothing was seeded.
        """
        return self._cold.get(kind, -1)

    def recent(self) -> dict[str, list[int]]:
        """The measured durations of every measured kind (what an estimates file keeps)."""
        return {kind: e.recent() for kind, e in self._by_kind.items() if e.measured}

    def measured(self, kind: str) -> bool:
        """Whether a step of ``kind`` was measured (or restored from an earlier run)."""
        estimator = self._by_kind.get(kind)
        return estimator is not None and estimator.measured

    def _cost_of(self, kind: str) -> float | None:
        if self._cost is None:
            return None
        if kind not in self._costs:
            cost = self._cost(kind)
            self._costs[kind] = float(cost) if cost is not None and math.isfinite(cost) and cost > 0 else None
        return self._costs[kind]

    def _cost_scaled(self, cost: float) -> int:
        points = list(self._points.values())
        if not points:
            return -1
        smaller = [(t, c) for t, c in points if c <= cost]
        larger = [(t, c) for t, c in points if c > cost]
        near = [(t, c) for t, c in smaller if c * _NEAR >= cost]
        if near or not larger:
            scaled = [t * cost / c for t, c in near or smaller]
        else:
            scaled = [t * math.sqrt(cost / c) for t, c in [(t, c) for t, c in larger if c <= cost * _NEAR] or larger]
        scaled.sort()
        estimate = scaled[math.ceil(0.9 * (len(scaled) - 1))]
        return math.ceil(max([estimate, *(t for t, _ in smaller)]))

    def known_ns(self, kind: str = "") -> int:
        """The estimate for a step of ``kind`` from its measurements or the hint; -1 without (cost ignored)."""
        estimator = self._by_kind.get(kind)
        return -1 if estimator is None else estimator.estimate_ns

    def estimate_ns(self, kind: str = "") -> int:
        """The estimate for a step of ``kind``, or -1 if nothing is known yet."""
        estimator = self._by_kind.get(kind)
        if estimator is not None and (estimator.measured or estimator.hint_ns >= 0):
            return estimator.estimate_ns
        scaled = self._scaled.get(kind)
        if scaled is None:
            cost = self._cost_of(kind)
            scaled = self._scaled[kind] = -1 if cost is None else self._cost_scaled(cost)
        return scaled

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
