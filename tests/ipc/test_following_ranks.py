"""A real manager follows a real rank's bubbles over its publisher only while side work may run there (D50).

The rank (a :class:`~freeride.backends.session.BackendSession` in this process, over the real
sockets) publishes every bubble; the manager counts them while it learns the device's bubbles and
while a task is placed there, and not in between, when nothing would use them: a rank nobody
follows wakes nobody. Its step reports reach the manager throughout.
"""

from __future__ import annotations

import asyncio

from conftest import wait_until

from freeride import protocol as p
from freeride.backends.session import BackendConfig, BackendSession
from freeride.serve.ledger import MIN_BUBBLES_SEEN
from freeride.serve.manager import Manager

MS = 1_000_000
DEVICE = "cpu:0"


class Rank:
    """One rank of a simulated job, driven step by step from the test's event loop."""

    def __init__(self, manager: Manager) -> None:
        config = BackendConfig(
            endpoint=manager.config.endpoints.events, rank=0, stage=0, num_stages=2, device=DEVICE, framework="test"
        )
        self.session = BackendSession(config)
        self.step = 0

    async def steps(self, count: int) -> None:
        for _ in range(count):
            self.session.bubble_started(self.step, 2 * MS)
            await asyncio.sleep(0.003)
            self.session.bubble_ended()
            self.session.step_finished(self.step, 5 * MS)
            self.step += 1
            await asyncio.sleep(0.002)

    async def until(self, predicate: object, timeout_s: float, what: str) -> None:
        """Train until ``predicate()`` holds."""

        async def train() -> None:
            while not predicate():  # type: ignore[operator]
                await self.steps(1)

        try:
            await asyncio.wait_for(train(), timeout_s)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}") from None


def _device(manager: Manager) -> p.DeviceStatus:
    [device] = [d for d in manager.status().devices if d.device == DEVICE]
    return device


async def test_bubbles_reach_the_manager_while_it_learns_them_and_while_a_task_is_there_not_in_between(
    manager: Manager,
) -> None:
    rank = Rank(manager)
    follower = manager._follower
    assert follower is not None
    try:
        await rank.until(lambda: bool(follower.followed), 10, "the manager to follow the rank")
        ledger = manager.schedulers[DEVICE].ledger
        await rank.until(lambda: ledger.learned, 20, f"the first {MIN_BUBBLES_SEEN} bubbles to end")
        assert not follower.followed, "learned, and no side work here: not followed any more"
        assert _device(manager).typical_bubble_ns > 0
        seen, steps = _device(manager).bubbles, _device(manager).steps
        await rank.steps(100)
        await asyncio.sleep(0.1)
        assert _device(manager).bubbles <= seen + 1, "bubbles published to nobody (one may have been in flight)"
        await rank.until(lambda: _device(manager).steps > steps, 10, "step reports, about once a second")

        reply = manager.submit(p.IterativeSpec(target="_tasks:SpinSteps", device=DEVICE))
        assert isinstance(reply, p.Submitted), reply
        assert follower.followed, "followed again as the task is placed"
        seen = _device(manager).bubbles
        await rank.until(lambda: _device(manager).bubbles >= seen + 10, 20, "bubbles counted again")
        await manager.cancel(reply.task_id)
        await rank.until(lambda: not follower.followed, 10, "the manager to stop following once the task is gone")
    finally:
        rank.session.close()
    await wait_until(lambda: not manager.live_backends(), 10, "the rank's goodbye")
    assert manager.rejected_frames == 0
