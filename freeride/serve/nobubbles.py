"""Jobs without pipeline bubbles: which devices will never have any, and how to say so.

A job that trains with pipeline size 1 (a Megatron script run with
``--pipeline-model-parallel-size 1``, a one-stage DeepSpeed ``PipelineModule``)
never waits for a neighbour, so its devices have no bubbles and a side task
placed there would wait forever. :func:`no_bubbles` tells such a device from
its rank's ``Hello`` (``num_stages == 1``), or from its training steps: a device
whose rank finished :data:`NO_BUBBLE_STEPS` steps past the warm-up without a
single bubble is taken for one too (a schedule that hides every wait). The
manager shows the reason per device in ``status`` and keeps unpinned side tasks
pending with it, instead of placing them where nothing will run.
"""

from __future__ import annotations

from collections.abc import Iterable

from freeride.serve.ranks import DeviceInfo

__all__ = ["NO_BUBBLE_STEPS", "job_without_bubbles", "no_bubbles", "waiting_on_device"]

NO_BUBBLE_STEPS = 5
"""Training steps without a bubble (the warm-up step left out) after which a device is said to have none."""


def no_bubbles(info: DeviceInfo) -> str:
    """Why ``info``'s device has no pipeline bubbles ("" when it has some, or may yet).

    Only a device a live rank trains on is judged: a gone job says nothing of the next one.
    """
    if not info.alive:
        return ""
    if info.num_stages == 1:
        return "no pipeline bubbles: pipeline size 1"
    if info.train_steps > NO_BUBBLE_STEPS and info.step_ns > 0 and info.step_bubble_ns == 0:
        return f"no pipeline bubbles: {info.train_steps} training steps without a bubble"
    return ""


def job_without_bubbles(devices: Iterable[DeviceInfo]) -> str:
    """Why no live device has bubbles ("" when one has, or may yet, or none is live)."""
    reasons = [no_bubbles(info) for info in devices if info.alive]
    if not reasons or not all(reasons):
        return ""
    shown = sorted(set(reasons))[0]
    return f"the training job has {shown}; side tasks wait for a job with bubbles"


def waiting_on_device(device: str, info: DeviceInfo | None) -> str:
    """Why a task placed on ``device`` runs no step there ("" when it may)."""
    if info is not None and info.departed:
        return f"the training rank of {device} has left; a step runs when a rank trains there again"
    reason = no_bubbles(info) if info is not None else ""
    return f"{device} has {reason}; no step runs until it has bubbles" if reason else ""
