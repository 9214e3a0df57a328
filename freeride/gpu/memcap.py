"""Which memory cap a side-task process gets, by device kind.

* ``cuda:N`` with MPS: the process is an MPS client with a pinned device-memory
  limit (allocations beyond it fail inside the process; nothing else is
  affected), plus ``FREERIDE_TORCH_MEMORY_FRACTION`` for PyTorch's allocator.
* ``cuda:N`` without MPS: only the cooperative PyTorch fraction; nothing stops a
  program that ignores it.
* ``cpu:N``: ``RLIMIT_AS`` (address space), set on the stopped launcher before the
  program starts. Address space is not memory in use: an interpreter with its
  libraries maps far more than it touches (CPython with torch: about 0.7 GiB), so
  the limit is the task's peak plus ``address_space_overhead``.

  Where the manager can make cgroups (:mod:`freeride.host.cgroup`) the processes of a
  CPU task are also capped together by the memory they use: an imperative
  program at its peak plus 1/16, a worker at its use once set up plus its peak.
  ``RLIMIT_AS`` stays on as the outer bound, so that a huge allocation fails
  cleanly (``MemoryError``) rather than by the kernel's OOM kill.

A task that declares no peak is capped by its device's spare memory less the
peaks the other tasks there declared (see ``Supervisor._peak``): never uncapped
where the spare memory is known.

``RLIMIT_AS`` is never used for a CUDA device: CUDA reserves a large virtual
address range (unified addressing) at initialisation and fails with
out-of-memory under a limit sized for real memory use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from freeride.gpu.mps import client_env, torch_memory_fraction

__all__ = ["DEFAULT_AS_OVERHEAD", "MemoryCap", "plan_memory_cap"]

DEFAULT_AS_OVERHEAD = 1 << 30
"""Address space allowed on top of a CPU task's peak memory."""

Mechanism = Literal["none", "rlimit_as", "mps", "torch_fraction"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryCap:
    """How to cap one side-task process."""

    mechanism: Mechanism
    """What enforces the cap."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables to add to the process's environment."""
    rlimit_as: int = -1
    """``memory_limit`` for :class:`freeride.serve.imperative.ImperativeProcess`; -1 for none."""


def _parse_device(device: str) -> tuple[str, int]:
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ValueError(f"device must look like 'cuda:N' or 'cpu:N', got {device!r}")
    return kind, int(index or 0)


def plan_memory_cap(
    device: str,
    limit_bytes: int,
    *,
    mps_pipe_dir: Path | None = None,
    mps_device: str | int | None = None,
    total_bytes: int = -1,
    address_space_overhead: int = DEFAULT_AS_OVERHEAD,
) -> MemoryCap:
    """Choose the cap for a side task on ``device`` that may use ``limit_bytes``.

    Args:
        device: FreeRide device name, ``cuda:N`` or ``cpu:N``.
        limit_bytes: Memory the task may use; <= 0 means unknown (no cap).
        mps_pipe_dir: Pipe directory of FreeRide's MPS daemon; None without MPS.
        mps_device: The device as MPS clients name it (a ``GPU-...`` UUID is safest);
            defaults to the ordinal in ``device``.
        total_bytes: Total device memory, for the PyTorch fraction; -1 if unknown.
        address_space_overhead: Added to ``limit_bytes`` for ``RLIMIT_AS``.

    Returns:
        The cap to apply.

    Raises:
        ValueError: On a malformed device name or negative overhead.
    """
    kind, index = _parse_device(device)
    if address_space_overhead < 0:
        raise ValueError(f"address_space_overhead must be >= 0, got {address_space_overhead}")
    if limit_bytes <= 0:
        return MemoryCap(mechanism="none")
    if kind == "cpu":
        return MemoryCap(mechanism="rlimit_as", rlimit_as=limit_bytes + address_space_overhead)
    if mps_pipe_dir is not None:
        dev = index if mps_device is None else mps_device
        env = client_env(dev, limit_bytes, 1, pipe_dir=mps_pipe_dir, total_bytes=total_bytes)
        return MemoryCap(mechanism="mps", env=env)
    if total_bytes > 0:
        fraction = torch_memory_fraction(limit_bytes, total_bytes)
        env = {"FREERIDE_MEMORY_LIMIT": str(limit_bytes), "FREERIDE_TORCH_MEMORY_FRACTION": f"{fraction:.6f}"}
        return MemoryCap(mechanism="torch_fraction", env=env)
    return MemoryCap(mechanism="none", env={"FREERIDE_MEMORY_LIMIT": str(limit_bytes)})
