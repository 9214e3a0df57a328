"""``freeride profile-task``: measure every step kind of a side task alone, before training.

A managed task learns each step kind's time from its first step of that kind,
which runs only as a probe at a bubble's start: a task with a hundred kinds
spends a hundred bubbles measuring. Profiled here first, on the same kind of
device and with the same options, it starts its first run under ``freeride
serve`` with every kind known (the same file the manager's worker reads and
keeps, see :mod:`freeride.tasks.estimates`)::

    result = profile_task(ProfileTaskOptions(target="resnet50-train", options={"target_ms": 5.0},
                                             state_dir=Path("/run/user/1000/freeride/state")))
    print(result.table())

The process is set up as the manager sets up a worker: pinned to ``cores``
with one compute thread per core (one thread when no cores are given, as for
a stage that names none), or on ``cuda:N`` alone (``CUDA_VISIBLE_DEVICES``),
its kernels on a lowest-priority stream and each step timed to its device end.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freeride.sidetask import IterativeTask, TaskContext, TaskStopped, UnboundedGate, run_alone
from freeride.tasks.estimates import EstimatesStore, KindTimes, canonical_options, save_estimates

__all__ = ["DEFAULT_SAMPLES", "DEFAULT_STEPS", "KindSummary", "ProfileResult", "ProfileTaskOptions", "profile_task"]

DEFAULT_SAMPLES = 5
"""Steps of each kind measured before profiling stops: the first (warm-up) and enough for a percentile."""
DEFAULT_STEPS = 10_000
"""Steps run at most."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileTaskOptions:
    """What to profile, where, and for how long."""

    target: str
    """A catalog name or ``module:Class``."""
    options: dict[str, str | int | float | bool] = field(default_factory=dict)
    """Constructor options, as ``freeride submit --opt`` gives them (the same ones name the same estimates)."""
    state_dir: Path
    """The manager's state directory; the estimates go to its ``estimates`` folder."""
    device: str = "cpu:0"
    """``cpu:N`` or ``cuda:N``."""
    cores: tuple[int, ...] = ()
    """CPU cores to run on, as the stage the task will share is pinned (empty: one thread, any core)."""
    samples: int = DEFAULT_SAMPLES
    """Stop once every kind seen has run this many times."""
    steps: int = DEFAULT_STEPS
    """Stop after this many steps in any case."""
    bubble_ms: float = 0.0
    """The typical bubble of the device the task will share, as ``freeride serve`` tells the task
    (``TaskContext.bubble_ns``): a task that sizes its steps by it then measures the same steps (0: unknown)."""

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not (self.bubble_ms >= 0 and math.isfinite(self.bubble_ms)):
            raise ValueError(f"bubble_ms must be a number of milliseconds >= 0, got {self.bubble_ms}")
        kind, sep, index = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (sep and not index.isdigit()):
            raise ValueError(f"device must be cpu:N or cuda:N, got {self.device!r}")
        if self.cores and kind == "cuda":
            raise ValueError("cores: only for a cpu device")
        if any(core < 0 for core in self.cores):
            raise ValueError(f"cores must be >= 0, got {list(self.cores)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class KindSummary:
    """The measured steps of one kind."""

    kind: str
    steps: int
    median_ns: int
    p90_ns: int
    max_ns: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileResult:
    """What a profile measured and where it was kept."""

    path: Path
    """The estimates file written."""
    device_kind: str
    steps: int
    kinds: list[KindSummary]
    finished: bool
    """The task ended by itself (``done()``) before every kind was measured enough."""

    def table(self) -> str:
        """A table of the kinds: steps, median, p90, max."""
        width = max([4, *(len(k.kind) + 2 for k in self.kinds)])
        lines = [f"{'kind':{width}} {'steps':>6} {'median':>10} {'p90':>10} {'max':>10}"]
        for k in self.kinds:
            name = k.kind or '""'
            lines.append(f"{name:{width}} {k.steps:>6} {_ms(k.median_ns):>10} {_ms(k.p90_ns):>10} {_ms(k.max_ns):>10}")
        lines.append(f"{self.steps} steps on {self.device_kind}; estimates written to {self.path}")
        return "\n".join(lines)


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f} ms"


class _ProfileGate(UnboundedGate):
    """Runs steps back to back until every kind seen has run ``samples`` times; times them to their device end."""

    def __init__(self, *, samples: int, device_sync: Callable[[], None] | None) -> None:
        super().__init__()
        self._samples = samples
        self._sync = device_sync
        self._seen: Counter[str] = Counter()
        self.enough = False

    @asynccontextmanager
    async def step(self, kind: str = "") -> AsyncIterator[None]:
        if kind in self._seen and min(self._seen.values()) >= self._samples:
            self.enough = True
            raise TaskStopped(f"every kind ran {self._samples} times")
        async with super().step(kind):
            yield
            if self._sync is not None:
                self._sync()
        self._seen[kind] += 1


def _prepare_process(opts: ProfileTaskOptions) -> str:
    """Set this process up as the manager sets up a worker; returns the torch device."""
    kind, _, index = opts.device.partition(":")
    if kind == "cuda":
        if "torch" in sys.modules:
            raise ValueError("profile a GPU task in a fresh process (torch was imported before the device was chosen)")
        os.environ["CUDA_VISIBLE_DEVICES"] = index
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {opts.device}: torch sees no CUDA device here (profile on cpu:N instead)")
        return "cuda:0"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if opts.cores:
        os.sched_setaffinity(0, opts.cores)
    threads = str(max(1, len(opts.cores)))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    return "cpu"


def _summary(kind: str, durations: list[int]) -> KindSummary:
    ordered = sorted(durations)
    return KindSummary(
        kind=kind,
        steps=len(ordered),
        median_ns=int(statistics.median(ordered)),
        p90_ns=ordered[int(0.9 * (len(ordered) - 1))],
        max_ns=ordered[-1],
    )


def build_task(target: str, options: dict[str, Any]) -> tuple[str, type[IterativeTask], IterativeTask]:
    """Resolve ``target`` and build the task: every bad name or option fails here, before anything runs.

    Raises:
        ValueError: An unknown target, an option the task does not take, or a bad value.
    """
    from freeride.tasks.targets import resolve
    from freeride.worker.main import load_target

    resolved = resolve(target)
    try:
        cls = load_target(resolved)
    except (ImportError, AttributeError, TypeError) as exc:
        raise ValueError(f"cannot load side task {target!r}: {exc}") from None
    canonical_options(cls, options)  # names the options the task takes
    return resolved, cls, cls(**options)


def profile_task(opts: ProfileTaskOptions) -> ProfileResult:
    """Run the task alone, measure every step kind, and write its estimates file.

    Raises:
        ValueError: A bad target or option (before anything runs).
    """
    torch_device = _prepare_process(opts)
    target, cls, task = build_task(opts.target, dict(opts.options))
    from freeride.gpu.streams import step_end_sync, use_side_stream

    stream = use_side_stream(torch_device)
    gate = _ProfileGate(samples=opts.samples, device_sync=step_end_sync(stream))
    with tempfile.TemporaryDirectory(prefix="freeride-profile-task-") as workdir:
        ctx = TaskContext(
            task_id=0,
            device=opts.device,
            torch_device=torch_device,
            workdir=Path(workdir),
            bubble_ns=round(opts.bubble_ms * 1e6),
        )
        asyncio.run(run_alone(task, steps=opts.steps, ctx=ctx, gate=gate))
    store = EstimatesStore.for_task(
        opts.state_dir / "estimates", target, cls, dict(opts.options), torch_device=torch_device
    )
    by_kind: dict[str, list[int]] = {}
    for kind, duration in zip(gate.kinds, gate.durations_ns, strict=True):
        by_kind.setdefault(kind, []).append(max(1, duration))
    save_estimates(store.path, store.key, {k: KindTimes(recent=d, first_ns=d[0]) for k, d in by_kind.items()})
    return ProfileResult(
        path=store.path,
        device_kind=store.key.device_kind,
        steps=gate.steps,
        kinds=[_summary(kind, durations) for kind, durations in by_kind.items()],
        finished=not gate.enough and gate.steps < opts.steps,
    )
