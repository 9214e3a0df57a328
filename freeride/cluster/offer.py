"""What room a node has for cluster jobs, read from its manager's status (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from freeride import protocol as p
from freeride.cluster import messages as m

__all__ = ["OfferPolicy", "bubble_share", "offer", "summarize"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OfferPolicy:
    """How many cluster jobs a node takes, and where."""

    jobs_per_device: int = 1
    """Side tasks (cluster jobs or not) a device runs at once before the node takes no more for it."""
    min_share: float = 0.02
    """A device whose bubbles are under this share of its time takes no cluster jobs."""

    def __post_init__(self) -> None:
        if self.jobs_per_device < 1:
            raise ValueError(f"jobs_per_device must be >= 1, got {self.jobs_per_device}")
        if not 0 <= self.min_share < 1:
            raise ValueError(f"min_share must be in [0, 1), got {self.min_share}")


def bubble_share(device: p.DeviceStatus) -> float:
    """Share of the device's time that is bubble (0 until it has trained)."""
    total = device.bubble_ns + device.train_ns
    return device.bubble_ns / total if total else 0.0


def offer(status: p.StatusReply, policy: OfferPolicy) -> list[m.Slot]:
    """One slot per job the node can take now.

    A device offers room only while a rank trains on it and has shown bubbles
    of at least ``policy.min_share`` of its time; each live side task on it
    takes one of its ``jobs_per_device`` places, and a task still waiting for
    a device takes one anywhere. Spare memory is the device's free memory when
    known (NVML), else what its rank reported.
    """
    live = [t for t in status.tasks if t.state not in p.TERMINAL_STATES]
    slots: list[m.Slot] = []
    for device in status.devices:
        share = bubble_share(device)
        if not device.alive or not device.bubbles or share < policy.min_share:
            continue
        used = sum(t.device == device.device for t in live)
        spare = device.free_memory if device.free_memory >= 0 else device.spare_memory
        room = policy.jobs_per_device - used
        slots += [m.Slot(device=device.device, spare_memory=spare, bubble_share=share)] * max(0, room)
    waiting = sum(not t.device for t in live)
    slots.sort(key=lambda s: s.bubble_share, reverse=True)
    return slots[: max(0, len(slots) - waiting)]


def summarize(status: p.StatusReply) -> m.NodeSummary:
    """The node's manager status, summed over its devices."""
    return m.NodeSummary(
        devices=len(status.devices),
        alive_devices=sum(d.alive for d in status.devices),
        bubble_ns=sum(d.bubble_ns for d in status.devices),
        used_ns=sum(d.used_ns for d in status.devices),
        train_ns=sum(d.train_ns for d in status.devices),
        interference_ns=sum(d.interference_ns for d in status.devices),
        tasks_running=sum(t.state == "running" for t in status.tasks),
    )
