"""Backend -> manager: the events a training rank reports about its bubbles (fire-and-forget)."""

from __future__ import annotations

from freeride.protocol.base import Bytes, Cores, Count, Message, Name, Nanos, Position, Small, Text

__all__ = ["BackendEvent", "BubbleEnded", "BubbleStarted", "Goodbye", "Heartbeat", "Hello", "StepFinished"]


class Hello(Message, frozen=True, tag="hello"):
    """First message of a training rank; announces who it is."""

    protocol_version: Small
    rank: Small
    stage: Small
    num_stages: Small
    device: Name
    """Device the stage computes on, e.g. ``cuda:0`` or ``cpu:1``."""
    framework: Name
    """``deepspeed``, ``megatron`` or ``sim``."""
    pid: Small
    cpu_affinity: Cores = []
    """Cores the rank may run on; side tasks of this device are pinned to them."""
    device_memory: Bytes = -1
    """Total memory of the device in bytes, -1 if unknown."""
    t_ns: Nanos = 0
    bubbles_endpoint: Text = ""
    """Where the rank also publishes its :class:`BubbleStarted` events for armed workers ("" none)."""
    job: Name = ""
    """The training job's name, the same on every rank and node (from the launcher's environment; "" unknown):
    the steps held back to measure the job's cost are chosen from it."""


class _BubbleEvent(Message, frozen=True):
    """Which bubble of which stage, and when."""

    rank: Small
    stage: Small
    device: Name
    step: Position
    """Training step (optimizer step) the bubble belongs to."""
    index: Position
    """Position of the bubble within the step, 0-based, in time order."""
    t_ns: Nanos


class BubbleStarted(_BubbleEvent, frozen=True, tag="bubble_started"):
    """A stage has entered a bubble: its device is idle from ``t_ns``."""

    expected_ns: Nanos
    """Predicted duration, from the profile or a running estimate."""
    spare_memory: Bytes = -1
    """Bytes of device memory the stage leaves free, -1 if unknown."""
    thread: Position = 0
    """Native id of the rank's thread that announced it and now blocks, 0 if unknown: a side worker on
    its core lets it block before the first step (see :mod:`freeride.worker.courtesy`)."""


class BubbleEnded(_BubbleEvent, frozen=True, tag="bubble_ended"):
    """The stage has left the bubble (at ``t_ns``) and computes again."""

    duration_ns: Nanos
    """Measured duration of the bubble."""
    waited_runnable_ns: Nanos = 0
    """Of it, how long the stage waited for its core at the end (runnable, not running): on a shared core,
    time a side task's step kept from training (0: none, or not measured)."""


class StepFinished(Message, frozen=True, tag="step_finished"):
    """A training step of this rank has finished."""

    rank: Small
    stage: Small
    step: Position
    t_ns: Nanos
    duration_ns: Nanos
    bubble_ns: Nanos = 0
    """Sum of the measured bubbles of this step."""
    unpublished: Small = 0
    """Bubbles of this step announced to no one: the step is held back (see
    :func:`~freeride.transport.frames.hello_ack_topic`), so the manager counts them from here."""
    unpublished_ns: Nanos = 0
    """Their measured time (part of :attr:`bubble_ns`)."""


class Heartbeat(Message, frozen=True, tag="heartbeat"):
    """Sent by a rank that has been quiet for a while, so it is not taken for dead."""

    rank: Small
    t_ns: Nanos


class Goodbye(Message, frozen=True, tag="goodbye"):
    """Last message of a rank that exits cleanly."""

    rank: Small
    t_ns: Nanos
    dropped: Count = 0
    """Events the emitter could not send (manager away or slow)."""
    last_bubble: tuple[Position, Position] | None = None
    """(step, index) of the last bubble end the rank published on its own socket (None: none).

    That socket is not this message's: a manager following the rank's bubbles
    waits a moment for that end before it takes the goodbye, so that the job's
    last bubble is counted and traced."""


BackendEvent = Hello | BubbleStarted | BubbleEnded | StepFinished | Heartbeat | Goodbye
