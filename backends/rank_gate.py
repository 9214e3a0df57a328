"""A rank's side of the bubble gate: where its compute stream reaches a bubble, it opens the slot the manager names.

With ``freeride serve --device-gate`` the manager keeps a gate page per CUDA
device (:mod:`freeride.gpu.bubblegate`) and names in it the slot of the side
task armed for the next bubble, with the shortest bubble that task's step fits.
A rank timed on the device (:class:`~freeride.backends.cuda_timing.DeviceTimeline`)
then queues, right before each announced wait, a stream write that opens that
slot, and right after the wait one that closes it: the side task's step, queued
ahead behind a wait on its slot, starts when the device gets there, not when
the host has heard of the bubble.

What the rank does costs it two stream writes per bubble and a host read of
the control word; it never waits on anything of the gate. It opens nothing at
a step held back to measure the job's cost, nor at a bubble expected shorter
than the manager's bound. The page is attached on the timeline's helper thread
(where CUDA is current), looked for again every few seconds until the manager
has made it; any failure of the CUDA calls is logged once and ends the rank's
use of the gate, never its training.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from freeride.gpu.bubblegate import BubbleGate, GateUnavailable, GateWord, StreamOps, cuda_stream_ops, page_path

__all__ = ["RankGate", "rank_gate_for"]

logger = logging.getLogger(__name__)

_LOOK_EVERY_NS = 5_000_000_000
"""How often a rank looks for its device's gate page again, until it has one."""


class RankGate:
    """The gate page of a rank's device, once attached, and the slot the rank's stream holds open.

    Args:
        path: The device's gate page (it may not exist yet).
        ops: Binds the CUDA stream operations (called on the helper thread; tests pass a stand-in's).
        clock: Monotonic ns clock.
    """

    def __init__(
        self,
        path: Path,
        *,
        ops: Callable[[], StreamOps] = cuda_stream_ops,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.path = path
        self._ops = ops
        self._clock = clock
        self._gate: BubbleGate | None = None
        """Set once on the helper thread, read on the training thread (one reference: no lock needed)."""
        self._looked_ns: int | None = None
        self._inode = -1
        self._retired: list[BubbleGate] = []
        """Pages replaced by a new manager's: kept registered, as stream writes to them may still be queued."""
        self._broken = False
        self.opened = 0
        """Bubbles this rank opened a slot at."""

    @property
    def attached(self) -> bool:
        return self._gate is not None

    # ---------------------------------------------------------- helper thread
    def attach_due(self) -> None:
        """Attach the page if it is there and it is time to look (the helper thread, where CUDA is current).

        A page attached before is checked at the same pace: one a manager started
        since has replaced (another file at the path) is attached in its place.
        """
        if self._broken:
            return
        now = self._clock()
        if self._looked_ns is not None and now - self._looked_ns < _LOOK_EVERY_NS:
            return
        self._looked_ns = now
        try:
            inode = self.path.stat().st_ino
        except OSError:
            return  # no manager with --device-gate (yet); the page attached, if any, stays
        if self._gate is not None:
            if inode == self._inode:
                return
            # never unregistered: writes queued on the compute stream may still be on their way to it
            self._retired.append(self._gate)
            self._gate = None
            logger.info("[bubble] device gate replaced by a new manager's: attaching it")
        word: GateWord | None = None
        try:
            word = GateWord.attach(self.path)
            self._gate = BubbleGate(word, self._ops())
            self._inode = inode
        except (GateUnavailable, OSError) as exc:
            if word is not None:
                word.close()
            self._broken = True
            logger.warning("[bubble] device gate not used: %s", exc)
            return
        logger.info("[bubble] device gate attached: %s", self.path)

    # -------------------------------------------------------- training thread
    def open_at(self, stream: Any, step: int, expected_ns: int, held: Callable[[int], bool]) -> int:
        """Queue on ``stream`` the opening of the slot the manager names, if this bubble is for it; the slot (0: none).

        Args:
            stream: The compute stream, right before the wait.
            step: The training step the bubble is in.
            expected_ns: The bubble's expected length (as announced).
            held: Whether a step is held back to measure the job's cost (nothing runs in its bubbles).
        """
        gate = self._gate
        if gate is None:
            return 0
        slot, min_open_ns = gate.word.control()
        if slot == 0 or expected_ns < min_open_ns or held(step):
            return 0
        try:
            gate.open_on(stream, slot)
        except Exception:
            self._drop("opening")
            return 0
        self.opened += 1
        return slot

    def close_at(self, stream: Any, slot: int) -> None:
        """Queue on ``stream`` the closing of ``slot``, opened at this bubble's start (right after the wait)."""
        gate = self._gate
        if gate is None or slot == 0:
            return
        try:
            gate.close_on(stream, slot)
        except Exception:
            self._drop("closing")

    def _drop(self, what: str) -> None:
        logger.exception("[bubble] device gate failed %s a slot: the rank uses it no more", what)
        self._gate, self._broken = None, True

    def close(self) -> None:
        """Unregister the pages (idempotent). Only once the compute stream has done what was queued on it."""
        gates, self._gate, self._retired = [self._gate, *self._retired], None, []
        for gate in gates:
            if gate is not None:
                try:
                    gate.close()
                except Exception:
                    logger.debug("[bubble] device gate: unregistering failed", exc_info=True)


def rank_gate_for(events_endpoint: str, device: str) -> RankGate | None:
    """The gate of ``device`` in the runtime directory of ``events_endpoint`` (None for a tcp endpoint)."""
    if not events_endpoint.startswith("ipc://"):
        return None
    return RankGate(page_path(Path(events_endpoint[6:]).parent, device))
