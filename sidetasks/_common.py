"""Plumbing shared by the sample side tasks: deferred state, RNG capture, device sync, joined steps."""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection
from typing import Any

import torch

from freeride.sidetask import IterativeTask, TaskContext

__all__ = [
    "DeviceTask",
    "ShuffledCursor",
    "check_fingerprint",
    "joinable",
    "sample_seed",
    "synchronize",
]

_MASK63 = (1 << 63) - 1


def joinable(
    room_ns: int,
    target_ns: int,
    one_ns: int,
    estimate_ns: Callable[[str], int],
    kind_of: Callable[[int], str],
    *,
    ran: Collection[int],
    most: int,
) -> int:
    """How many units of work (a power of two, at most ``most``) the next step may join.

    Each count's estimate (``estimate_ns(kind_of(count))``) must fit in
    ``room_ns``, as the runtime then checks, and the count must take at most
    the room or ``target_ns`` (the task's ``target_ms``), the lower. A count not
    in ``ran`` (not run yet in this process) is judged on twice the count
    below it, starting from ``one_ns`` for one unit: the runtime's estimate of
    a kind not measured yet is scaled from every kind measured, a rarely run
    kind's cold first step too, which can be several times a warm one.
    """
    cap_ns = min(room_ns, target_ns)
    count, need = 1, one_ns
    while count * 2 <= most:
        estimate = estimate_ns(kind_of(count * 2))
        if estimate < 0 or estimate > room_ns:
            break
        guess = estimate if count * 2 in ran else 2 * need
        if guess > cap_ns:
            break
        count, need = count * 2, guess
    return count


def sample_seed(seed: int, stream: int, index: int) -> int:
    """A generator seed for item ``index`` of ``stream`` under ``seed`` (distinct, reproducible)."""
    return (seed * 0x9E3779B97F4A7C15 + stream * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & _MASK63


class DeviceTask(IterativeTask):
    """An iterative task whose working state is built on its device in ``setup``.

    A checkpoint may be handed over before or after ``setup``: before, it is
    kept and applied once the state exists; after, it is applied at once.
    ``setup`` builds only once, so running the same object again continues
    where it stopped, and ``teardown`` keeps the state so that it can still be
    checkpointed afterwards.
    """

    def __init__(self) -> None:
        self._ready = False
        self._pending: dict[str, Any] | None = None
        self.device = torch.device("cpu")

    async def setup(self, ctx: TaskContext) -> None:
        if not self._ready:
            self.device = torch.device(ctx.torch_device)
            self._build(ctx)
            self._ready = True
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._restore(state)

    def state_dict(self) -> dict[str, Any]:
        if not self._ready:
            return dict(self._pending or {})
        return self._capture()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self._ready:
            self._restore(state)
        else:
            self._pending = dict(state)

    @abc.abstractmethod
    def _build(self, ctx: TaskContext) -> None:
        """Allocate the task's working state on ``self.device``."""

    @abc.abstractmethod
    def _capture(self) -> dict[str, Any]:
        """The checkpoint of the built state."""

    @abc.abstractmethod
    def _restore(self, state: dict[str, Any]) -> None:
        """Overwrite the built state with a checkpoint."""


def check_fingerprint(state: dict[str, Any], expected: dict[str, Any]) -> None:
    """Refuse a checkpoint taken with options that change the meaning of its state.

    Raises:
        ValueError: naming the first option that differs.
    """
    found = state.get("fingerprint", {})
    for key, value in expected.items():
        if found.get(key) != value:
            raise ValueError(f"checkpoint was taken with {key}={found.get(key)!r}, this task has {key}={value!r}")


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device``, so a step ends when its work does."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ShuffledCursor:
    """Walks a data set in a fresh seeded permutation each epoch.

    The whole state is :attr:`position`, the number of samples handed out, so
    restoring it resumes the exact same sequence.
    """

    def __init__(self, size: int, *, seed: int, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self._epoch = -1
        self._order: list[int] = []

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(sample_seed(self.seed, -2, epoch))
                self._order = torch.randperm(self.size, generator=g).tolist()
            else:
                self._order = list(range(self.size))
            self._epoch = epoch
        return self._order

    @property
    def epoch(self) -> int:
        """Completed passes over the data."""
        return self.position // self.size

    def take(self, count: int) -> list[int]:
        """The next ``count`` indices, wrapping into the next epoch as needed."""
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(self.position, self.size)
            chunk = self._order_of(epoch)[offset : offset + count - len(out)]
            out += chunk
            self.position += len(chunk)
        return out
