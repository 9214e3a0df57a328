"""Who trains where: the training ranks reporting to this manager, and the devices they train on.

:class:`Ranks` is the only writer of what the manager knows of a device's
identity and memory (:class:`DeviceInfo`), and of the ranks' liveness. A
device is alive while a live rank trains on it: that fact is kept once, in the
rank's record. A rank is watched through a pidfd where the kernel allows it,
and by its silence otherwise. The manager tells :class:`Ranks` what arrived;
:class:`Ranks` tells its :class:`RankListener` what that means (a new device,
a device without its rank, a rank ready to be served).

Every frame may come from a hostile or broken sender, so what it can make the
manager hold is capped: at most ``max_ranks`` ranks (each with its pidfd) and
``max_devices`` devices. A full device table makes room by forgetting the
least recently seen device that no live rank trains on and no side task uses;
a full rank table makes room for a rank that says hello (and so can be watched
through its pidfd) by forgetting the least recently seen rank known only by its
events. What finds no room is refused, and the caller counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from freeride import protocol as p
from freeride.clock import MONOTONIC, Clock

__all__ = ["MAX_DEVICES", "MAX_RANKS", "DeviceInfo", "RankListener", "Ranks"]

logger = logging.getLogger(__name__)

MAX_RANKS = 256
"""Ranks one manager follows at once (one node: a handful of GPUs, at most a core each on CPU)."""
MAX_DEVICES = 512
"""Devices one manager keeps: room for every rank's device, declared ones and a few dead ones."""


def _sampled(count: int) -> bool:
    """Whether the ``count``-th of a repeated complaint is logged: the first ten, then one in a thousand."""
    return count <= 10 or count % 1000 == 0


@dataclass(slots=True, eq=False)
class _Rank:
    rank: int
    device: str
    pid: int
    """0 for a rank seen only through its events (it started before this manager)."""
    last_seen_ns: int
    pidfd: int = -1
    alive: bool = True
    steps: int = 0
    """Training steps this rank finished."""
    leaving: bool = False
    """It said goodbye; the manager waits a moment for its last bubble end (its exit is no loss)."""
    last_end: tuple[int, int] | None = None
    """(step, index) of the last bubble end received from it."""


@dataclass(slots=True, eq=False)
class DeviceInfo:
    """One device's identity and memory, as the ranks and NVML report them."""

    name: str
    first_seen_ns: int
    stage: int = -1
    rank: int = -1
    framework: str = ""
    cpu_affinity: list[int] = field(default_factory=list)
    spare_memory: int = -1
    """Memory the stage leaves free (profile, Hello or the last BubbleStarted; -1 unknown)."""
    device_memory: int = -1
    """Total memory of the device (from the rank's Hello)."""
    free_memory: int = -1
    """Free memory NVML last reported (-1 without NVML)."""
    dropped: int = 0
    """Events the ranks here could not send (from their Goodbye)."""
    train_steps: int = 0
    trainer: _Rank | None = None
    """The rank training here now."""
    num_stages: int = 0
    """Pipeline stages of the job training here (from its Hello or the profile; 0 unknown)."""
    profiled_share: float = -1.0
    """Bubble time per second of training, from the profile (-1: not profiled)."""
    profiled_bubble_ns: int = 0
    """The typical bubble, from the profile (see :func:`freeride.profile.typical_bubble_ns`; 0: unknown)."""
    step_ns: int = 0
    """Training time of the steps finished here, the first (warm-up) step of each rank left out."""
    step_bubble_ns: int = 0
    """Bubble time of those same steps."""
    declared: bool = False
    """Named before its rank reported (by a profile or a launcher)."""

    @property
    def alive(self) -> bool:
        return self.trainer is not None and self.trainer.alive

    @property
    def departed(self) -> bool:
        """A rank trained here and left (its job ended, or it was lost): no new task comes here until one trains."""
        return self.trainer is not None and not self.trainer.alive


class RankListener(Protocol):
    def device_added(self, info: DeviceInfo) -> None:
        """A device became known (from a rank, a profile or a declaration)."""
        ...

    def device_lost(self, name: str) -> None:
        """The rank training on ``name`` is gone: its bubbles stop."""
        ...

    def rank_ready(self, info: DeviceInfo) -> None:
        """A rank said hello: tasks waiting for a device may be placed."""
        ...

    def device_in_use(self, name: str) -> bool:
        """Whether side tasks are placed on ``name`` (asked before forgetting it to make room)."""
        ...

    def device_removed(self, name: str) -> None:
        """``name`` was forgotten to make room for another device."""
        ...

    def event_refused(self, reason: str) -> None:
        """A bubble event found no room for its rank or device and was dropped."""
        ...

    def read_queued_events(self) -> None:
        """Handle the ranks' events already received and not yet read (a goodbye may be among them)."""
        ...


class Ranks:
    """The ranks reporting to one manager, and their devices."""

    def __init__(
        self,
        *,
        listener: RankListener,
        backend_timeout_s: float,
        clock: Clock = MONOTONIC,
        max_ranks: int = MAX_RANKS,
        max_devices: int = MAX_DEVICES,
    ) -> None:
        if max_ranks < 1 or max_devices < 1:
            raise ValueError(f"max_ranks and max_devices must be >= 1, got {max_ranks} and {max_devices}")
        self.devices: dict[str, DeviceInfo] = {}
        self._ranks: dict[int, _Rank] = {}
        self._listener = listener
        self._timeout_ns = int(backend_timeout_s * 1e9)
        self._timeout_s = backend_timeout_s
        self._clock = clock
        self.max_ranks = max_ranks
        self.max_devices = max_devices
        self._recent: OrderedDict[str, None] = OrderedDict()
        """Device names, least recently seen first (kept beside :attr:`devices`, whose order status shows)."""
        self._declared: set[str] = set()
        """Devices from a profile or a launcher: never forgotten to make room."""
        self._wrong_version = 0

    # -- what arrives -------------------------------------------------------------

    def hello(self, hello: p.Hello) -> bool:
        """A rank introduced itself (again, every few seconds); False if it must be refused."""
        if hello.protocol_version != p.PROTOCOL_VERSION:
            self._wrong_version += 1
            if _sampled(self._wrong_version):  # a rank repeats its Hello: say it once, not every time
                logger.error(
                    "[events] rank %d (pid %d) speaks protocol %d but this manager speaks %d; "
                    "install the same FreeRide version in the training environment (%d such frames)",
                    hello.rank,
                    hello.pid,
                    hello.protocol_version,
                    p.PROTOCOL_VERSION,
                    self._wrong_version,
                )
            return False
        now = self._clock.now_ns()
        known = self._ranks.get(hello.rank)
        if known is not None and known.pid == hello.pid and known.alive:
            known.last_seen_ns = now  # the periodic repeat
            self._touch(known.device)
            return True
        if known is None and len(self._ranks) >= self.max_ranks and not self._evict_rank():
            return False
        info = self._device(hello.device)
        if info is None:
            return False
        if known is not None:
            self._forget(known)  # the rank restarted: a new process under the same number
        info.stage, info.rank, info.framework = hello.stage, hello.rank, hello.framework
        info.num_stages = hello.num_stages
        info.cpu_affinity = list(hello.cpu_affinity)
        info.device_memory = hello.device_memory
        trainer = _Rank(rank=hello.rank, device=hello.device, pid=hello.pid, last_seen_ns=now)
        self._ranks[hello.rank] = trainer
        info.trainer = trainer
        self._watch(trainer)
        logger.info(
            "[events] %r rank %d (pid %d) stage %d/%d on %r",
            hello.framework,
            hello.rank,
            hello.pid,
            hello.stage,
            hello.num_stages,
            hello.device,
        )
        self._listener.rank_ready(info)
        return True

    def bubble(self, ev: p.BubbleStarted | p.BubbleEnded) -> DeviceInfo | None:
        """A bubble event: the device it is for, or None if its rank was given up for lost."""
        trainer = self._seen(ev.rank)
        if trainer is None:
            return None
        info = self._device(ev.device)
        if info is None:
            self._listener.event_refused(f"device {ev.device!r}: already keeping {self.max_devices} devices")
            return None
        if trainer.device != ev.device:
            # A rank seen only through its events names its device here; a rank that
            # names another device has left the old one, which no longer has a trainer.
            old = self.devices.get(trainer.device)
            trainer.device = ev.device
            if old is not None and old.trainer is trainer:
                old.trainer = None
                self._listener.device_lost(old.name)
        info.stage, info.rank, info.trainer = ev.stage, ev.rank, trainer
        if isinstance(ev, p.BubbleEnded):
            trainer.last_end = (ev.step, ev.index)
        elif ev.spare_memory >= 0:
            info.spare_memory = ev.spare_memory
        return info

    def last_end(self, rank: int) -> tuple[int, int] | None:
        """(step, index) of the last bubble end received from ``rank`` (None: none, or the rank is not known)."""
        trainer = self._ranks.get(rank)
        return trainer.last_end if trainer is not None else None

    def step_finished(self, rank: int, *, duration_ns: int = 0, bubble_ns: int = 0) -> DeviceInfo | None:
        """A training step ended: what it lasted and how much of it was bubbles teach placement.

        Returns:
            The rank's device (None: the rank or its device is not known).
        """
        trainer = self._seen(rank)
        if trainer is None or trainer.device not in self.devices:
            return None
        info = self.devices[trainer.device]
        info.train_steps += 1
        trainer.steps += 1
        if trainer.steps > 1 and duration_ns > 0:  # the first step warms up: its bubbles mislead
            info.step_ns = min(p.I64_MAX, info.step_ns + duration_ns)
            info.step_bubble_ns = min(p.I64_MAX, info.step_bubble_ns + min(max(0, bubble_ns), duration_ns))
        return info

    def heartbeat(self, rank: int) -> None:
        self._seen(rank)

    def leaving(self, rank: int) -> None:
        """``rank`` said goodbye, taken a moment later: until then its exit or silence is no loss."""
        trainer = self._ranks.get(rank)
        if trainer is not None:
            trainer.leaving = True

    def goodbye(self, rank: int, dropped: int) -> None:
        trainer = self._ranks.get(rank)
        if trainer is None:
            return
        logger.info("[events] rank %d said goodbye (%d events dropped)", rank, dropped)
        if trainer.device in self.devices:
            info = self.devices[trainer.device]
            info.dropped = min(p.I64_MAX, info.dropped + dropped)
        self._forget(trainer)
        self._listener.device_lost(trainer.device)

    def declare(self, name: str, *, stage: int, spare_memory: int, cpu_affinity: list[int]) -> DeviceInfo:
        """Make a device known before its rank reports (from a profile, or by a launcher).

        Side tasks can then be placed on it and set up before training starts.
        """
        self._declared.add(name)
        info = self._device(name, force=True)
        assert info is not None  # forced
        info.stage, info.spare_memory, info.cpu_affinity = stage, spare_memory, list(cpu_affinity)
        info.declared = True
        return info

    def load_profile(self, path: Path) -> None:
        """Know every profiled device and its spare memory before any rank reports."""
        from freeride.profile import load_profile

        profile = load_profile(path)
        for stage in profile.stages:
            kind, _, index = stage.device.partition(":")
            cores = [int(index)] if kind == "cpu" and index.isdigit() else []
            info = self.declare(stage.device, stage=stage.stage, spare_memory=stage.spare_memory, cpu_affinity=cores)
            info.num_stages, info.profiled_share = stage.num_stages, stage.bubble_fraction
            info.profiled_bubble_ns = stage.typical_bubble_ns
        logger.info("[startup] profile %s: %d stage(s) on %s", path, len(profile.stages), ", ".join(profile.devices))

    def note_free_memory(self, free_by_index: dict[int, int]) -> None:
        """Free memory per CUDA device index, as NVML reads it."""
        for name, info in self.devices.items():
            kind, _, index = name.partition(":")
            if kind == "cuda" and index.isdigit() and int(index) in free_by_index:
                info.free_memory = free_by_index[int(index)]

    # -- watching -----------------------------------------------------------------

    def check_silence(self) -> None:
        """Give up ranks that can only be watched by their events and have been silent too long."""
        now = self._clock.now_ns()
        for trainer in list(self._ranks.values()):
            if trainer.pidfd < 0 and not trainer.leaving and now - trainer.last_seen_ns > self._timeout_ns:
                self._lose(trainer, f"silent for {self._timeout_s:g}s")

    def live(self) -> list[int]:
        """Ranks currently reporting to this manager."""
        return [rank for rank, r in self._ranks.items() if r.alive]

    def close(self) -> None:
        """Stop watching every rank (idempotent)."""
        for trainer in list(self._ranks.values()):
            self._unwatch(trainer)
        self._ranks.clear()

    def watched(self) -> int:
        """Pidfds held open (one per rank watched through its process)."""
        return sum(1 for r in self._ranks.values() if r.pidfd >= 0)

    # -- internals ------------------------------------------------------------------

    def _touch(self, name: str) -> None:
        if name in self._recent:
            self._recent.move_to_end(name)

    def _device(self, name: str, *, force: bool = False) -> DeviceInfo | None:
        """The device called ``name``, made known if need be; None if there is no room for it."""
        info = self.devices.get(name)
        if info is not None:
            self._touch(name)
            return info
        if len(self.devices) >= self.max_devices and not self._evict_device() and not force:
            return None
        info = DeviceInfo(name=name, first_seen_ns=self._clock.now_ns())
        self.devices[name] = info
        self._recent[name] = None
        self._listener.device_added(info)
        return info

    def _evict_device(self) -> bool:
        """Forget the least recently seen device nobody trains on or uses; False if there is none."""
        for name in self._recent:  # oldest first; at most max_devices looked at, only when full
            info = self.devices[name]
            if info.alive or name in self._declared or self._listener.device_in_use(name):
                continue
            del self.devices[name], self._recent[name]
            self._listener.device_removed(name)
            return True
        return False

    def _evict_rank(self) -> bool:
        """Forget the least recently seen rank known only by its events; False if there is none.

        Such a rank cannot be watched, so it is the one to give way to a rank that
        says hello (and can be). It comes back with its next event if there is room.
        """
        victim: _Rank | None = None
        for trainer in self._ranks.values():
            if trainer.pidfd < 0 and (victim is None or trainer.last_seen_ns < victim.last_seen_ns):
                victim = trainer
        if victim is None:
            return False
        self._lose(victim, "a rank that said hello needed its place")
        return True

    def _seen(self, rank: int) -> _Rank | None:
        trainer = self._ranks.get(rank)
        now = self._clock.now_ns()
        if trainer is None:
            if len(self._ranks) >= self.max_ranks:
                self._listener.event_refused(f"rank {rank}: already following {self.max_ranks} ranks")
                return None
            # A rank that started before this manager: serve it all the same, and
            # watch it by its silence (its pid is unknown until it says hello).
            trainer = _Rank(rank=rank, device="", pid=0, last_seen_ns=now)
            self._ranks[rank] = trainer
            return trainer
        if not trainer.alive:
            return None
        trainer.last_seen_ns = now
        return trainer

    def _watch(self, trainer: _Rank) -> None:
        try:
            fd = os.pidfd_open(trainer.pid)
        except OSError:
            return  # another pid namespace, or no pidfd here: its silence will tell
        trainer.pidfd = fd

        def exited() -> None:
            # Its goodbye and last bubbles may be queued still, unread: they come first.
            self._listener.read_queued_events()
            if trainer.alive and not trainer.leaving and self._ranks.get(trainer.rank) is trainer:
                self._lose(trainer, "its process exited without saying goodbye")
            else:
                self._unwatch(trainer)

        asyncio.get_running_loop().add_reader(fd, exited)

    def _unwatch(self, trainer: _Rank) -> None:
        if trainer.pidfd >= 0:
            with contextlib.suppress(RuntimeError, ValueError):  # the loop may already be closed
                asyncio.get_running_loop().remove_reader(trainer.pidfd)
            os.close(trainer.pidfd)
            trainer.pidfd = -1

    def _forget(self, trainer: _Rank) -> None:
        trainer.alive = False
        self._unwatch(trainer)
        if self._ranks.get(trainer.rank) is trainer:
            del self._ranks[trainer.rank]

    def _lose(self, trainer: _Rank, why: str) -> None:
        logger.warning("[events] rank %d (pid %d) on %s lost: %s", trainer.rank, trainer.pid, trainer.device, why)
        self._forget(trainer)
        self._listener.device_lost(trainer.device)
