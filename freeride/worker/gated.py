"""A worker's step queued ahead behind its slot of the device's bubble gate.

Where the manager runs with ``--device-gate`` and arms this worker with a gate
slot (:class:`~freeride.protocol.Arm`), the worker does not wait for the
bubble's start: it queues, on its side stream, a wait on its slot and then the
step itself (the task's own code, which launches its kernels and returns),
and the device runs the step when the rank's compute stream opens the slot,
whatever the host is doing then (:mod:`freeride.serve.gates`). The worker
then waits for the step's end on the device, as for any step, and accounts it
once it has heard which grant it ran in.

A step's device time comes from two events around it on the side stream
(after the wait, at the end); its start on the host's clock is taken as the
later of the bubble's start and the time it was queued: the device's own lag
between the two is what the GPU check measures (``tools/gpu/check.sh``, f).

No CUDA exists on CPU machines: the stream operations come through
:class:`~freeride.gpu.bubblegate.StreamOps` and the events through a factory,
both of which tests replace by stand-ins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freeride import protocol as p
from freeride.gpu.bubblegate import BubbleGate, GateUnavailable, GateWord, StreamOps, cuda_stream_ops, probe
from freeride.gpu.streams import DeviceEvent, timing_event

__all__ = ["GatedSteps", "Queued", "bind_gated_steps", "fits_gate", "hear_grant"]

logger = logging.getLogger(__name__)


_HEAR_TRIES = 4
_HEAR_WAIT_S = 0.002
"""After a step queued behind the gate ran, the worker waits up to this long, this many times, to hear
the rank's bubble start (which says which grant the step ran in)."""


def fits_gate(arm: p.Arm, estimate_ns: int, margin_ns: int) -> bool:
    """Whether a step expected to take ``estimate_ns`` (-1: not measured) may be queued behind ``arm``'s slot.

    The rank opens the slot only at a bubble expected at least ``gate_open_ns``
    long: the step, with the margin, must fit the shortest such bubble as the
    guard sets deadlines (``prediction_factor``).
    """
    bound = round(arm.gate_open_ns * arm.prediction_factor)
    return bool(arm.gate_slot) and estimate_ns >= 0 and estimate_ns + max(0, margin_ns) <= bound


async def hear_grant(heard: Callable[[], bool], wait: Callable[[], Awaitable[None]] | None) -> None:
    """Call ``heard`` until it says the grant is settled, waiting a moment on ``wait`` between tries."""
    for _ in range(_HEAR_TRIES):
        if heard() or wait is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_HEAR_WAIT_S):
                await wait()
    heard()


@dataclass(frozen=True, slots=True)
class Queued:
    """A step queued behind a gate slot."""

    queued_ns: int
    """When the host queued it (the worker's clock)."""
    start: DeviceEvent
    """Recorded after the wait: where the step's kernels begin on the side stream."""


class GatedSteps:
    """Queues a worker's steps behind its gate slot and times them on the device.

    Args:
        gate: The device's gate page, registered in this process.
        stream: The worker's side stream (its handle, or a ``torch.cuda.Stream``).
        event: A new timing event (``torch.cuda.Event(enable_timing=True, blocking=True)`` on a GPU).
    """

    def __init__(self, gate: BubbleGate, stream: Any, event: Callable[[], DeviceEvent]) -> None:
        self._gate = gate
        self._stream = stream
        self._event = event

    def queue(self, slot: int, now_ns: int) -> Queued:
        """Queue a wait on ``slot`` on the side stream; what the step launches next runs once it opens."""
        self._gate.wait_on(self._stream, slot)
        start = self._event()
        start.record(self._stream)
        return Queued(queued_ns=now_ns, start=start)

    def finish(self, queued: Queued) -> int:
        """Wait (the thread sleeps) for the end of the step queued after ``queued``; its device time in ns."""
        end = self._event()
        end.record(self._stream)
        end.synchronize()
        return max(1, round(queued.start.elapsed_time(end) * 1e6))

    def close(self) -> None:
        self._gate.close()


def bind_gated_steps(
    gate_path: str,
    stream: Any,
    *,
    ops: Callable[[], StreamOps] = cuda_stream_ops,
    event: Callable[[], DeviceEvent] | None = None,
) -> tuple[GatedSteps | None, str]:
    """The worker's gated steps on the page at ``gate_path``, probed first; (None, why not) where they cannot run.

    Args:
        gate_path: :attr:`~freeride.protocol.Assign.gate_path` ("": the manager runs no device gate).
        stream: The side stream (None on a CPU device).
        ops: Binds the CUDA stream operations (tests pass a stand-in's).
        event: A new timing event (None: ``torch.cuda.Event``).

    Returns:
        The gated steps and ``"ready"``; or None and why the gate cannot be used ("" where none was assigned).
    """
    if not gate_path:
        return None, ""
    if stream is None:
        return None, "not a CUDA device"
    word: GateWord | None = None
    try:
        bound = ops()
        why = probe(bound, stream, Path(gate_path).parent)
        if why:
            return None, why
        word = GateWord.attach(Path(gate_path))
        gate = BubbleGate(word, bound)
    except (GateUnavailable, OSError) as exc:
        if word is not None:
            word.close()
        return None, str(exc)
    logger.info("[worker] device gate %s: armed steps are queued ahead behind it", gate_path)
    return GatedSteps(gate, stream, timing_event if event is None else event), "ready"
