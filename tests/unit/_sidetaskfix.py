"""Shared pieces of the sample side tasks' unit tests (import them into the test module).

A plainly named module rather than a ``conftest.py``: tests/ipc imports its own
``conftest`` by name, and a second one here would shadow it.
"""

from __future__ import annotations

from pathlib import Path

from _torchfix import deterministic_one_thread

from freeride.sidetask import TaskContext

__all__ = ["cpu_context", "deterministic_one_thread"]


def cpu_context(workdir: Path) -> TaskContext:
    """The context a worker gives a task on the first CPU core, with ``workdir`` for its checkpoints."""
    return TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=workdir)
