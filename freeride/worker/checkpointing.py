"""When a worker saves its task's checkpoint, what a save is expected to take, and what a crash would lose.

A checkpoint falls due every assigned period, and is forced where one more step
would leave more unsaved than the assigned loss bound (steps or step time).
The gate fits a due one into a grant on the last save's time, scaled by how the
state grew; a forced one that fits no bubble runs at a grant's start. A failed
save is reported and tried again later: it never ends the task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from freeride import protocol as p
from freeride.clock import Clock
from freeride.sidetask import IterativeTask

__all__ = ["CheckpointDue", "Checkpointer", "SaveCheckpoint"]

_RETRY_MAX_NS = 5_000_000_000
"""A failed checkpoint is tried again after the checkpoint period, or this, whichever is shorter."""

SaveCheckpoint = Callable[[IterativeTask, Path, int], int]
"""Saves a task's state with its step count to a path; returns the bytes of tensor data it held
(:func:`~freeride.worker.checkpoint.state_bytes`), or -1 if the task has no state (nothing saved)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointDue:
    """Whether a checkpoint is wanted before the next step, and what it is expected to take."""

    need_ns: int
    """Its expected time; -1 if none is wanted now (or its time is not known yet)."""
    bound: bool
    """The loss bound is reached: no step may run before the checkpoint."""


class Checkpointer:
    """Saves ``task``'s checkpoint and keeps what tells when the next one is due.

    Args:
        assign: What the manager assigned (checkpoint path, period and loss bounds).
        task: The task whose state is saved.
        steps: Steps already done (restored from a checkpoint): saved already.
        save: Writes the checkpoint (see :data:`SaveCheckpoint`).
        state_bytes: Reads the size of the task's state.
        clock: Where every time reading comes from.
        send: Sends a message to the manager.
        log: Where its records go (the gate's logger).
    """

    def __init__(
        self,
        assign: p.Assign,
        task: IterativeTask,
        steps: int,
        *,
        save: SaveCheckpoint,
        state_bytes: Callable[[IterativeTask], int],
        clock: Clock,
        send: Callable[[p.WorkerToManager], None],
        log: logging.Logger,
    ) -> None:
        self.assign = assign
        self.save = save
        self.state_bytes = state_bytes
        self._task = task
        self._clock = clock
        self._send = send
        self._log = log
        self._last_ns = clock.now_ns()
        self._took_ns = -1
        """How long the last checkpoint took (-1: none yet)."""
        self._bytes = 0
        """Size of the state the last checkpoint saved (0: unknown)."""
        self._sized = -1
        """The state's size, read once after the last checkpoint when the next one is due (-1: not yet)."""
        self.saved_steps = steps
        self._unsaved_ns = 0
        """Step time since the last checkpoint: what a crash now would lose."""
        self._failed_ns = -1
        """When the last checkpoint failed (-1: it did not)."""

    def write(self, steps: int) -> bool:
        """Save the task's state at ``steps`` now; False if the write failed (reported, and retried later).

        A failure (a full disk: ``torch.save`` raises ``RuntimeError:
        basic_ios::clear``) must not end the task: it keeps its previous
        checkpoint and tries again.
        """
        t0 = self._clock.now_ns()
        path = Path(self.assign.checkpoint_path)
        try:
            saved = self.save(self._task, path, steps)
        except Exception as exc:
            now = self._clock.now_ns()
            self._failed_ns = now
            self._took_ns = max(self._took_ns, now - t0)
            error = f"{type(exc).__name__}: {exc}"
            self._log.warning("[worker] checkpoint at step %d to %s failed: %s", steps, path, error)
            self._send(p.CheckpointFailed(task_id=self.assign.task_id, steps=steps, error=error))
            return False
        if saved >= 0:
            self._send(p.Checkpointed(task_id=self.assign.task_id, steps=steps, path=str(path)))
        self._last_ns = self._clock.now_ns()
        self._took_ns = self._last_ns - t0
        self._bytes, self._sized = max(0, saved), -1
        self.saved_steps, self._unsaved_ns, self._failed_ns = steps, 0, -1
        return True

    def at_stop(self, steps: int) -> bool:
        """The checkpoint of a stopped task, if its state is consistent; else the last one is kept, and said so."""
        if self._task.can_checkpoint():
            return self.write(steps)
        note = (
            f"stopped between consistent points (can_checkpoint() is False): kept the checkpoint of step "
            f"{self.saved_steps}; {steps - self.saved_steps} later steps will run again"
        )
        self._log.warning("[worker] %s", note)
        self._send(p.CheckpointFailed(task_id=self.assign.task_id, steps=steps, error=note))
        return False

    def stepped(self, took_ns: int) -> None:
        """Count a step's time as unsaved."""
        self._unsaved_ns += took_ns

    def _size_now(self) -> int:
        """The task's state size, read once between two checkpoints (0 if it cannot be read).

        Once: ``state_dict()`` may cost (a copy to the host), and a state grows
        at a task's first steps (an optimizer's buffers), not step by step.
        """
        if self._sized < 0:
            try:
                self._sized = self.state_bytes(self._task)
            except Exception as exc:  # a task's state_dict failing here shows up at the save itself
                self._log.debug("[worker] state size unreadable: %s", exc)
                self._sized = 0
        return self._sized

    def estimate_ns(self) -> int:
        """What the next checkpoint is expected to take: the last one's time, scaled by how the state grew.

        -1 before the first checkpoint. A state that grew since (say from a
        model alone to a model with its optimizer's buffers) would otherwise be
        fitted into a bubble on the smaller state's time and overrun its end.
        """
        if self._took_ns < 0:
            return -1
        if self._bytes <= 0:
            return self._took_ns
        return max(self._took_ns, self._took_ns * self._size_now() // self._bytes)

    def _retry_allowed(self, now: int) -> bool:
        if self._failed_ns < 0:
            return True
        return now - self._failed_ns >= min(self.assign.checkpoint_every_ns, _RETRY_MAX_NS)

    def _loss_bound_reached(self, steps: int, step_ns: Callable[[], int]) -> bool:
        """Whether one more step would leave more unsaved than the assigned bound."""
        a = self.assign
        if a.max_loss_steps and steps - self.saved_steps + 1 > a.max_loss_steps:
            return True
        # nothing unsaved: a step longer than the whole bound still runs (after a checkpoint)
        unsaved = steps > self.saved_steps
        return bool(a.max_loss_ns) and unsaved and self._unsaved_ns + max(0, step_ns()) > a.max_loss_ns

    def due(self, now: int, steps: int, step_ns: Callable[[], int]) -> CheckpointDue:
        """Whether a checkpoint is wanted before the next step (a task between consistent points has none).

        Args:
            now: The time now.
            steps: Steps done so far.
            step_ns: The pending step's estimate, read only where the time bound needs it.
        """
        retry = self._task.can_checkpoint() and self._retry_allowed(now)
        periodic = retry and now - self._last_ns >= self.assign.checkpoint_every_ns
        bound = retry and self._loss_bound_reached(steps, step_ns)
        return CheckpointDue(need_ns=self.estimate_ns() if periodic or bound else -1, bound=bound)
