"""How many of a GPU's SMs a side task may occupy: its MPS active thread percentage.

A running kernel is not preempted, and NCCL's kernels need SMs of their own: a
side task whose kernels fill every SM when a bubble ends holds back the
trainer's next p2p kernel until blocks retire. Under MPS,
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` bounds the SMs a client's kernels spread
over (rounded down by the driver to what the hardware supports, fixed for the
life of the process), so part of the GPU stays free for the trainer's next
kernels. It is a bound, not a reservation, and it only shares SMs with other
clients of the same MPS server: a trainer outside MPS is time-sliced with the
server instead (see docs/gpu.md).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_SM_SHARE", "ENV_SM_SHARE", "plan_sm_share", "resolve_sm_share"]

DEFAULT_SM_SHARE = 75
"""Percent of the SMs a side task gets unless it asks otherwise: a quarter stays free for
NCCL's channels (a few CTAs each) and the first blocks of the trainer's next kernel."""

ENV_SM_SHARE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def resolve_sm_share(requested: int) -> int:
    """The share a request means: 1..100 as given; 0 or -1 the default.

    Raises:
        ValueError: Outside -1..100.
    """
    if not -1 <= requested <= 100:
        raise ValueError(f"sm_share must be a percentage in 1..100 (or -1 for the default), got {requested}")
    return DEFAULT_SM_SHARE if requested <= 0 else requested


def plan_sm_share(device: str, requested: int, *, mps_pipe_dir: Path | None) -> tuple[int, dict[str, str]]:
    """The SM share a side task on ``device`` runs with, and the environment that applies it.

    Args:
        device: FreeRide device name (``cuda:N``, ``cpu:N``, ...).
        requested: The task's ``sm_share`` (-1: the default).
        mps_pipe_dir: Pipe directory of FreeRide's MPS daemon; None without MPS.

    Returns:
        ``(percent, env)``; ``(-1, {})`` where nothing can cap SMs (no MPS, not a GPU).
        The environment names the daemon's pipe directory too, so the process is an
        MPS client even when it has no memory cap.

    Raises:
        ValueError: ``requested`` is not a percentage.
    """
    share = resolve_sm_share(requested)
    if mps_pipe_dir is None or not device.startswith("cuda"):
        return -1, {}
    return share, {"CUDA_MPS_PIPE_DIRECTORY": str(mps_pipe_dir), ENV_SM_SHARE: str(share)}
