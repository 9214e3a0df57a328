"""Which cores a side task runs on, and with how many threads.

A side task is pinned to the cores of the stage whose bubbles it uses: on a
CPU device those cores are the device. A rank started without pinning (plain
``torchrun``, ``python train.py``) reports every core of the machine as its
own, and a side task that inherited that would spread its threads over every
core, each one a core some stage computes on. So when a CPU rank may run on
more than one core, its side tasks get one core of those: the one its stage
takes by its position among the stages of this node (stage 0 the first core,
stage 1 the second, ...), and one thread. Ranks pinned to one core each
(``deepspeed --bind_cores_to_rank``, ``taskset``, ``numactl``, Slurm
``--cpu-bind``) keep that core. A GPU device is left alone: its side task
computes on the GPU and keeps the rank's cores for its host work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from freeride.serve.ranks import DeviceInfo

__all__ = ["side_task_cores", "stage_position", "thread_env"]


def stage_position(info: DeviceInfo, devices: Iterable[DeviceInfo]) -> int:
    """``info``'s place among this node's stages (training, or named by a profile), by stage then rank (0-based)."""
    peers = sorted(
        (d for d in devices if d is info or (d.stage >= 0 and (d.alive or d.declared))),
        key=lambda d: (d.stage, d.rank, d.name),
    )
    return next((i for i, d in enumerate(peers) if d is info), 0)


def side_task_cores(device: str, cpu_affinity: Sequence[int], *, position: int) -> list[int]:
    """The cores a side task of ``device`` is pinned to (empty: leave it where it is).

    Args:
        device: The device's name (``cpu:1``, ``cuda:0``).
        cpu_affinity: The cores its rank may run on.
        position: The stage's position among this node's stages (see :func:`stage_position`).
    """
    if device.partition(":")[0] == "cuda" or len(cpu_affinity) <= 1:
        return list(cpu_affinity)
    cores = sorted(set(cpu_affinity))
    return [cores[position % len(cores)]]


def thread_env(cores: Sequence[int]) -> dict[str, str]:
    """Thread counts for a program's math libraries: one thread per core it is pinned to."""
    if not cores:
        return {}
    n = str(len(cores))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
