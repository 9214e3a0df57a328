"""How much bubble time each device offers, when tasks may be placed, and which should move.

Placed on the first stage that reports, a task may land where the bubbles are
a sliver of the step while another stage idles most of it. So an unpinned
task waits, for a short settle time at most, until every stage of the job
has reported and each one's bubble time is known: from the profile, or
learned from its first training steps. Devices a profile or a launcher
declared are known from the start. A task placed before the shares were
known moves later to a device where it gets clearly more bubble time
(:func:`plan_moves`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from freeride import protocol as p
from freeride.clock import MONOTONIC, Clock
from freeride.serve.nobubbles import job_without_bubbles
from freeride.serve.placement import NEGLIGIBLE_SHARE, DeviceView, better_device
from freeride.serve.ranks import DeviceInfo
from freeride.serve.scheduler import DeviceScheduler
from freeride.serve.tasks import TaskRecord

__all__ = ["LEARN_WITHOUT_STEPS_NS", "Settling", "bubble_share", "plan_moves"]

LEARN_WITHOUT_STEPS_NS = 5_000_000_000
"""Training time after which a device whose backend reports no steps has its share learned from its bubbles."""


def bubble_share(info: DeviceInfo, scheduler: DeviceScheduler | None) -> float:
    """Bubble time per second of training on ``info``'s device; -1 while unknown.

    Learned from the steps finished there (the first one of each rank left
    out), else from the bubbles seen over enough training time, else taken
    from the profile. What was measured wins over what was profiled.
    """
    if info.step_ns > 0:
        return info.step_bubble_ns / info.step_ns
    if scheduler is not None and info.train_steps == 0:
        trained = scheduler.train_ns(alive=info.alive)
        if trained >= LEARN_WITHOUT_STEPS_NS:
            return min(1.0, scheduler.bubble_ns / trained)
    return info.profiled_share


class Settling:
    """Decides whether unpinned tasks may be placed yet, and says why not.

    The settle time runs from the first live rank this manager sees; past it,
    tasks are placed on what is known then (and move later if need be).
    """

    def __init__(self, settle_s: float, *, clock: Clock = MONOTONIC) -> None:
        self._settle_ns = int(settle_s * 1e9)
        self._clock = clock
        self._since_ns = 0

    def waiting(self, devices: Mapping[str, DeviceInfo], share: Callable[[DeviceInfo], float]) -> str:
        """Why a task cannot be placed yet ("" when it can).

        Args:
            devices: Every known device.
            share: The device's bubble share (see :func:`bubble_share`).
        """
        if not devices:
            return "waiting for a training rank to report"
        without = job_without_bubbles(devices.values())
        if without:
            return without
        if any(info.declared for info in devices.values()):
            return ""  # a profile or the launcher named the job's devices
        live = [info for info in devices.values() if info.alive]
        if not live:
            return ""  # the job has gone: placed where it trained, a task moves when training comes back
        now = self._clock.now_ns()
        if not self._since_ns:
            self._since_ns = now
        left_ns = self._settle_ns - (now - self._since_ns)
        if left_ns <= 0:
            return ""
        left = f"at most {left_ns / 1e9:.0f}s more"
        stages = max(info.num_stages for info in live)
        missing = sorted(set(range(stages)) - {info.stage for info in live})
        if missing:
            return (
                f"waiting for stage(s) {', '.join(map(str, missing))} of {stages} to report ({left}):"
                " a task goes where the bubbles are"
            )
        unknown = [info.name for info in live if share(info) < 0]
        if unknown:
            return f"waiting for the first training steps on {', '.join(unknown)} to learn its bubbles ({left})"
        return ""


def plan_moves(
    tasks: Iterable[TaskRecord],
    views: Sequence[DeviceView],
    *,
    now_ns: int,
    gain: float,
    every_s: float,
) -> list[tuple[TaskRecord, str, str]]:
    """The tasks to move now: ``(task, device, why)`` each, at most one per device to leave or join.

    Only iterative tasks move (they resume from a checkpoint; a program
    would start over), only once set up, never one pinned by the user, never
    one stopping or moving already, and at most once every ``every_s``.
    One move per device and round: each changes the shares the next decision
    rests on, and the next round sees them.
    """
    every_ns = int(every_s * 1e9)
    busy: set[str] = set()
    planned: list[tuple[TaskRecord, str, str]] = []
    for task in tasks:
        if (
            not isinstance(task.spec, p.IterativeSpec)
            or task.spec.device
            or task.state != "running"
            or task.stopping
            or task.moving_to
            or task.device in busy
            or (task.moved_ns and now_ns - task.moved_ns < every_ns)
        ):
            continue
        found = better_device(task.device, task.spec.peak_memory, views, gain=gain, min_gain_share=NEGLIGIBLE_SHARE)
        if found is None or found[0] in busy:
            continue
        device, here, there = found
        busy.update((task.device, device))
        planned.append(
            (task, device, f"{there:.1%} of the training time in bubbles for it there against {here:.1%} here")
        )
    return planned
