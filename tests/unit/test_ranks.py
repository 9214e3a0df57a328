"""Who trains where: ranks, their devices and their liveness, kept in one place."""

from __future__ import annotations

import os
import subprocess
import sys

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.serve.ranks import DeviceInfo, Ranks

S = 1_000_000_000


class Listener:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.lost: list[str] = []
        self.ready: list[str] = []

    def device_added(self, info: DeviceInfo) -> None:
        self.added.append(info.name)

    def device_lost(self, name: str) -> None:
        self.lost.append(name)

    def rank_ready(self, info: DeviceInfo) -> None:
        self.ready.append(info.name)

    def read_queued_events(self) -> None:
        self.queued()

    def queued(self) -> None:
        """What the events read now bring (nothing, unless a test says)."""


def make() -> tuple[Ranks, Listener, ManualClock]:
    listener, clock = Listener(), ManualClock()
    return Ranks(listener=listener, backend_timeout_s=5.0, clock=clock), listener, clock


def hello(rank: int = 0, device: str = "cpu:0", pid: int = 0, version: int = p.PROTOCOL_VERSION) -> p.Hello:
    return p.Hello(
        rank=rank,
        stage=rank,
        num_stages=2,
        device=device,
        pid=pid or os.getpid(),
        framework="sim",
        protocol_version=version,
        cpu_affinity=[rank],
        device_memory=1 << 30,
    )


def bubble(rank: int = 0, device: str = "cpu:0", spare: int = -1) -> p.BubbleStarted:
    return p.BubbleStarted(
        rank=rank, stage=rank, device=device, step=0, index=0, t_ns=0, expected_ns=S, spare_memory=spare
    )


async def test_a_hello_makes_the_device_known_and_alive() -> None:
    ranks, listener, _ = make()
    assert ranks.hello(hello())
    info = ranks.devices["cpu:0"]
    assert (info.alive, info.framework, info.cpu_affinity, info.device_memory) == (True, "sim", [0], 1 << 30)
    assert listener.added == ["cpu:0"] and listener.ready == ["cpu:0"] and ranks.live() == [0]
    assert ranks.hello(hello())  # the periodic repeat changes nothing
    assert listener.ready == ["cpu:0"]
    ranks.close()


async def test_another_protocol_version_is_refused() -> None:
    ranks, listener, _ = make()
    assert not ranks.hello(hello(version=p.PROTOCOL_VERSION + 1))
    assert ranks.devices == {} and listener.added == []


async def test_goodbye_makes_the_device_dead_and_keeps_what_it_dropped() -> None:
    ranks, listener, _ = make()
    ranks.hello(hello())
    ranks.step_finished(0)
    ranks.goodbye(0, dropped=3)
    info = ranks.devices["cpu:0"]
    assert (info.alive, info.dropped, info.train_steps) == (False, 3, 1)
    assert listener.lost == ["cpu:0"] and ranks.live() == []


async def test_a_rank_seen_only_by_its_events_is_served_and_dropped_when_silent() -> None:
    ranks, listener, clock = make()
    info = ranks.bubble(bubble(rank=3, device="cpu:1", spare=2 << 30))
    assert info is not None and info.alive and info.spare_memory == 2 << 30 and info.rank == 3
    clock.advance(4 * S)
    ranks.check_silence()
    assert info.alive
    clock.advance(2 * S)
    ranks.check_silence()
    assert not info.alive and listener.lost == ["cpu:1"]


async def test_a_declared_device_is_known_but_not_alive() -> None:
    ranks, listener, _ = make()
    info = ranks.declare("cpu:1", stage=1, spare_memory=1 << 20, cpu_affinity=[1])
    assert not info.alive and listener.added == ["cpu:1"] and listener.ready == []


async def test_a_rank_whose_process_exits_is_lost_through_its_pidfd() -> None:
    import asyncio

    ranks, listener, _ = make()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ranks.hello(hello(pid=child.pid))
        assert ranks.devices["cpu:0"].alive
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
        async with asyncio.timeout(10):
            while not listener.lost:
                await asyncio.sleep(0)  # the pidfd becomes readable on the loop
        assert not ranks.devices["cpu:0"].alive
    finally:
        child.kill()
        child.wait()
        ranks.close()


async def test_a_rank_whose_goodbye_is_still_unread_when_its_process_exits_is_not_lost() -> None:
    # The manager reads the ranks' events in batches while no decision waits on them: the exit's
    # signal may come first. The events already received are read before the rank is judged lost.
    import asyncio

    ranks, listener, _ = make()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ranks.hello(hello(pid=child.pid))
        listener.queued = lambda: ranks.goodbye(0, dropped=3)  # type: ignore[method-assign]
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
        async with asyncio.timeout(10):
            while not listener.lost:
                await asyncio.sleep(0)
        assert listener.lost == ["cpu:0"]  # once,
        assert ranks.devices["cpu:0"].dropped == 3  # by its goodbye
    finally:
        child.kill()
        child.wait()
        ranks.close()


async def test_a_rank_leaving_is_not_lost_when_its_process_exits_or_falls_silent() -> None:
    # A goodbye ahead of the rank's last bubble end is taken a moment later (ManagerCore):
    # meanwhile the rank's exit is no loss, and neither is its silence.
    import asyncio

    ranks, listener, clock = make()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ranks.hello(hello(pid=child.pid))
        ranks.bubble(bubble(rank=1, device="cpu:1"))  # seen only by its events: watched by its silence
        ranks.leaving(0)
        ranks.leaving(1)
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
        for _ in range(20):
            await asyncio.sleep(0.01)  # the pidfd becomes readable on the loop
        clock.advance(6 * S)
        ranks.check_silence()
        assert listener.lost == [] and sorted(ranks.live()) == [0, 1]
        ranks.goodbye(0, dropped=0)
        ranks.goodbye(1, dropped=0)
        assert listener.lost == ["cpu:0", "cpu:1"] and ranks.live() == []
    finally:
        child.kill()
        child.wait()
        ranks.close()


async def test_a_restarted_rank_replaces_its_record_and_its_pidfd_is_closed() -> None:
    ranks, _, _ = make()
    ranks.hello(hello(pid=os.getpid()))
    before = len(os.listdir("/proc/self/fd"))
    ranks.hello(hello(pid=os.getppid()))  # the same rank number, a new process
    assert len(os.listdir("/proc/self/fd")) == before  # the old pidfd closed, the new one opened
    assert ranks.live() == [0] and ranks.devices["cpu:0"].alive
    ranks.close()
    assert len(os.listdir("/proc/self/fd")) == before - 1
