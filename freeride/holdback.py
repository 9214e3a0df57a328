"""Which training steps get no side work, so that the job's own step times measure what side work costs.

Also which bubbles a job's slowdown budget leaves out (:func:`granted`): the
manager and the armed workers apply both rules, so that a worker that starts on
the rank's own bubble events skips what the manager grants to no one.

The steps of a job are cut into blocks of :attr:`~freeride.protocol.Holdback.block_steps`
steps, and the blocks into cycles. In each cycle one pair of adjacent blocks is
chosen at random, and one of the two, by a fair coin, is *held back*: no side
task gets a bubble of its steps. The other block of the pair is harvested as
usual, and the pair's two step times are compared (:mod:`freeride.serve.meter`).

The choice is a pure function of the job's key and the cycle's number, so every
stage and every node's manager holds back the same steps without talking. The
coin makes each pair's difference a fair coin's sign under "no effect", however
step times drift or depend on each other; the random place in the cycle keeps
the held blocks from lining up with anything periodic in the job (evaluation,
checkpoints, data shards).

The first step of every block is not measured: a step that side work ran in
just before it may still be draining into it.

The cycles lengthen as the job goes on (``every`` blocks at first, doubling
every ``doubling_cycles`` cycles up to ``max_every``): the interval narrows with the pairs already
measured, so later pairs are spent more sparingly. That rule depends on the step
number only, which keeps it the same on every node.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from freeride import protocol as p

__all__ = ["HoldbackSchedule", "Slot", "granted"]


Role = Literal["held", "harvested"]


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a step falls: its cycle, and its role if it is in the cycle's measured pair."""

    cycle: int
    role: Role | None
    """``held`` or ``harvested`` in the cycle's pair; ``None`` outside it."""
    measured: bool
    """In the pair and not the first step of its block."""
    pair_end: int
    """The first step after the cycle's pair."""


class HoldbackSchedule:
    """The held-back steps of one job (see the module's docstring)."""

    def __init__(self, config: p.Holdback) -> None:
        self.config = config

    @property
    def job(self) -> str:
        return self.config.job

    def _cycle_of_block(self, block: int) -> tuple[int, int, int]:
        """``(cycle, first block of the cycle, blocks in the cycle)`` of block ``block`` (>= 0)."""
        c = self.config
        every, cycle, first = c.every, 0, 0
        while every < c.max_every:
            span = every * c.doubling_cycles
            if block < first + span:
                break
            first += span
            cycle += c.doubling_cycles
            every *= 2
        k = (block - first) // every
        return cycle + k, first + k * every, every

    def _pair(self, cycle: int, blocks: int) -> tuple[int, int]:
        """The cycle's held block and its harvested partner, as offsets into the cycle."""
        digest = hashlib.blake2b(f"{self.config.job}|{cycle}".encode(), digest_size=8).digest()
        draw = int.from_bytes(digest, "little")
        pair = (draw >> 1) % (blocks // 2)
        coin = draw & 1
        return 2 * pair + coin, 2 * pair + 1 - coin

    def slot(self, step: int) -> Slot | None:
        """Where ``step`` falls; ``None`` before the schedule's ``start_step`` or when holding back is off."""
        c = self.config
        if not c.enabled or step < c.start_step:
            return None
        block, offset = divmod(step - c.start_step, c.block_steps)
        cycle, first, blocks = self._cycle_of_block(block)
        held, harvested = self._pair(cycle, blocks)
        pair_end = c.start_step + (first + max(held, harvested) + 1) * c.block_steps
        role: Role | None = "held" if block - first == held else "harvested" if block - first == harvested else None
        return Slot(cycle=cycle, role=role, measured=role is not None and offset > 0, pair_end=pair_end)

    def held(self, step: int) -> bool:
        """Whether ``step``'s bubbles go to no side task."""
        slot = self.slot(step)
        return slot is not None and slot.role == "held"

    def held_share(self, step: int) -> float:
        """The share of steps held back in the cycle ``step`` falls in."""
        c = self.config
        if not c.enabled:
            return 0.0
        block = max(0, step - c.start_step) // c.block_steps
        return 1.0 / self._cycle_of_block(block)[2]


def granted(share: float, step: int, index: int) -> bool:
    """Whether bubble ``index`` of ``step`` is granted while only ``share`` of a job's bubbles are.

    A fixed rule of the step and the index, so that every device of a job, and
    every armed worker, leaves out the same bubbles; a bubble granted at one
    share is granted at every larger one. See :mod:`freeride.serve.budget`.
    """
    if share >= 1.0:
        return True
    if share <= 0.0:
        return False
    mixed = ((step * 0x9E3779B1) ^ (index * 0x85EBCA77)) & 0xFFFFFFFF
    mixed = ((mixed ^ (mixed >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return (mixed ^ (mixed >> 16)) / 2**32 < share
