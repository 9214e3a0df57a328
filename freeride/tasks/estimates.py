"""Step-time estimates kept across runs of a side task.

A task's first steps of each kind used to cost a bubble each: an unmeasured
kind runs only as a one-step probe at a bubble's start. The worker of a
managed task (and ``freeride profile-task``, which measures a task alone)
therefore keeps the recent measured step times of every kind in a small JSON
file, one per :class:`EstimatesKey` (task class, options, device kind), under
the manager's state directory (``STATE_DIR/estimates/<digest>.json``). The
next run of the same task on the same kind of device starts with them::

    store = EstimatesStore.for_task(directory, target, cls, options, torch_device="cpu")
    store.seed(estimates)                # stored times count as measured
    ...
    store.save_if_due(estimates)         # between bubbles, at most every few seconds
    store.save(estimates)                # when the task stops

A file that cannot be read, or that was written for another key, is ignored
with one warning: estimates are an optimisation, never a reason to fail a task.
Deleting the directory (or one file) forgets them.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

import msgspec

from freeride.clock import MONOTONIC, Clock
from freeride.host.files import replace_atomically
from freeride.sidetask import StepEstimates

__all__ = [
    "FORMAT_VERSION",
    "SAVE_EVERY_NS",
    "EstimatesKey",
    "EstimatesStore",
    "KindTimes",
    "canonical_options",
    "cpu_model",
    "cpu_threads",
    "device_kind",
    "estimates_path",
    "load_estimates",
    "measured_times",
    "read_estimates_file",
    "save_estimates",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version of the files written here; files of another version are ignored."""
SAVE_EVERY_NS = 5_000_000_000
"""A running task writes its estimates at most this often (a crash loses at most this much)."""
_KEEP = 64
"""Durations kept per kind, at most (the estimator's window is smaller)."""

Scalar = str | int | float | bool | None


class EstimatesKey(msgspec.Struct, frozen=True, kw_only=True):
    """What step times depend on: the task, its options and the device it runs on."""

    target: str
    """``module:Class`` of the task (as :func:`freeride.tasks.resolve` spells it)."""
    options: dict[str, Scalar]
    """Every constructor argument, defaults included (see :func:`canonical_options`)."""
    device_kind: str
    """The kind of device, not which one (see :func:`device_kind`)."""

    def digest(self) -> str:
        """A short stable name for the key (the file name)."""
        text = json.dumps(msgspec.to_builtins(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:20]


class KindTimes(msgspec.Struct, frozen=True, kw_only=True):
    """What is kept of one step kind."""

    recent: list[int]
    """Its recent measured durations in ns, oldest first."""
    first_ns: int = -1
    """Its first step in the run that measured it, warm-up included (-1: unknown)."""


class _EstimatesFile(msgspec.Struct, kw_only=True):
    version: int
    key: EstimatesKey
    kinds: dict[str, KindTimes]


def _scalar(value: object) -> Scalar:
    return value if value is None or isinstance(value, str | int | float | bool) else repr(value)


def canonical_options(cls: type, options: dict[str, Any]) -> dict[str, Scalar]:
    """``options`` bound to ``cls``'s constructor with its defaults filled in, sorted by name.

    ``--opt batch_size=8`` and no option at all then name the same task when
    8 is the default.

    Raises:
        ValueError: An option the constructor does not take (the message lists those it does).
    """
    sig = inspect.signature(cls)
    try:
        bound = sig.bind(**options)
    except TypeError as exc:
        names = [n for n, prm in sig.parameters.items() if prm.kind is not inspect.Parameter.VAR_KEYWORD]
        raise ValueError(f"{cls.__name__}: {exc}; its options are: {', '.join(names) or 'none'}") from None
    bound.apply_defaults()
    merged: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            merged.update(value)
        elif sig.parameters[name].kind is not inspect.Parameter.VAR_POSITIONAL:
            merged[name] = value
    return {name: _scalar(merged[name]) for name in sorted(merged)}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what the platform module knows."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            name, sep, value = line.partition(":")
            if sep and name.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def cpu_threads() -> int:
    """Threads a CPU task computes with: the cores it may run on, at most ``OMP_NUM_THREADS``.

    The manager pins a worker to its stage's cores and sets ``OMP_NUM_THREADS``
    to their number (1 when the stage named none).
    """
    cores = len(os.sched_getaffinity(0))
    omp = os.environ.get("OMP_NUM_THREADS", "")
    return min(cores, int(omp)) if omp.isdigit() and int(omp) > 0 else cores


def device_kind(torch_device: str) -> str:
    """What a step's time depends on in the device: the GPU's name, or the CPU's model and thread count."""
    if torch_device.startswith("cuda"):
        import torch

        return f"cuda {torch.cuda.get_device_name(torch.device(torch_device))}"
    return f"cpu {cpu_model()} x{cpu_threads()}"


def estimates_path(directory: Path, key: EstimatesKey) -> Path:
    return directory / f"{key.digest()}.json"


def load_estimates(path: Path, key: EstimatesKey) -> dict[str, KindTimes]:
    """The step times stored in ``path`` for ``key``; empty (with a warning) if it is unreadable or foreign."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        logger.warning("[estimates] cannot read %s, starting without stored estimates: %s", path, exc)
        return {}
    try:
        stored = msgspec.json.decode(raw, type=_EstimatesFile)
    except msgspec.DecodeError as exc:
        logger.warning("[estimates] ignoring %s, not an estimates file: %s", path, exc)
        return {}
    if stored.version != FORMAT_VERSION:
        logger.warning("[estimates] ignoring %s: format %d, expected %d", path, stored.version, FORMAT_VERSION)
        return {}
    if stored.key != key:
        logger.warning("[estimates] ignoring %s: written for %s, not %s", path, stored.key, key)
        return {}
    return {
        kind: KindTimes(recent=[d for d in times.recent if d > 0][-_KEEP:], first_ns=times.first_ns)
        for kind, times in stored.kinds.items()
    }


def read_estimates_file(path: Path) -> tuple[EstimatesKey, dict[str, KindTimes]]:
    """The key and step times of an estimates file, whatever task it was written for.

    Raises:
        OSError: The file cannot be read.
        ValueError: It is not an estimates file of this format version (the message names it).
    """
    try:
        stored = msgspec.json.decode(path.read_bytes(), type=_EstimatesFile)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: not a FreeRide estimates file: {exc}") from exc
    if stored.version != FORMAT_VERSION:
        raise ValueError(f"{path}: estimates format {stored.version}, expected {FORMAT_VERSION}")
    return stored.key, stored.kinds


def save_estimates(path: Path, key: EstimatesKey, kinds: dict[str, KindTimes]) -> None:
    """Write ``kinds`` for ``key`` to ``path`` atomically (a reader sees the old file or the new one).

    Raises:
        OSError: The directory or the file could not be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {k: KindTimes(recent=t.recent[-_KEEP:], first_ns=t.first_ns) for k, t in sorted(kinds.items())}
    body = _EstimatesFile(version=FORMAT_VERSION, key=key, kinds=kept)
    replace_atomically(path, lambda f: f.write(msgspec.json.format(msgspec.json.encode(body))))


def measured_times(estimates: StepEstimates) -> dict[str, KindTimes]:
    """What ``estimates`` has measured (or was seeded with), as an estimates file keeps it."""
    return {
        kind: KindTimes(recent=recent, first_ns=estimates.first_ns(kind)) for kind, recent in estimates.recent().items()
    }


class EstimatesStore:
    """The estimates file of one task: seeds a :class:`StepEstimates` and writes it back, never raising."""

    def __init__(
        self, path: Path, key: EstimatesKey, *, every_ns: int = SAVE_EVERY_NS, clock: Clock = MONOTONIC
    ) -> None:
        self.path = path
        self.key = key
        self._every_ns = every_ns
        self._clock = clock
        self._last_ns = clock.now_ns()
        self._saved: dict[str, KindTimes] = {}
        self._failed = False

    @classmethod
    def for_task(
        cls, directory: Path, target: str, task_cls: type, options: dict[str, Any], *, torch_device: str
    ) -> EstimatesStore:
        """The store of ``task_cls`` built with ``options`` on ``torch_device``, in ``directory``."""
        key = EstimatesKey(
            target=target, options=canonical_options(task_cls, options), device_kind=device_kind(torch_device)
        )
        return cls(estimates_path(directory, key), key)

    def seed(self, estimates: StepEstimates) -> int:
        """Feed the stored durations to ``estimates``; returns how many kinds were stored."""
        stored = load_estimates(self.path, self.key)
        for kind, times in stored.items():
            estimates.seed(kind, times.recent, first_ns=times.first_ns)
        self._saved = measured_times(estimates)
        if stored:
            logger.info("[estimates] %d step kind(s) measured before, from %s", len(stored), self.path)
        return len(stored)

    def save_if_due(self, estimates: StepEstimates) -> None:
        """:meth:`save` if the last write is ``every_ns`` old."""
        if self._clock.now_ns() - self._last_ns >= self._every_ns:
            self.save(estimates)

    def save(self, estimates: StepEstimates) -> bool:
        """Write what ``estimates`` measured (if it changed); False if the write failed (warned once)."""
        self._last_ns = self._clock.now_ns()
        recent = measured_times(estimates)
        if recent == self._saved:
            return True
        try:
            save_estimates(self.path, self.key, recent)
        except OSError as exc:
            if not self._failed:
                logger.warning("[estimates] cannot write %s (estimates not kept): %s", self.path, exc)
            self._failed = True
            return False
        self._saved = recent
        return True
