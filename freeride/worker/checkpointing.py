"""When a worker saves its task's checkpoint, what a save is expected to take, and what a crash would lose.

A checkpoint falls due every assigned period, and is forced where one more step
would leave more unsaved than the assigned loss bound (steps or step time).
A state of :data:`STAGED_FROM_BYTES` or more is staged: copied to host memory a
slice per grant (no step runs until the copy is whole) and written by a
thread while the steps go on (:mod:`~freeride.worker.snapshot`); its size never
holds a bubble past its end. A periodic staged checkpoint also waits until the
steps since the last one took :data:`STEPS_PER_COPY` times the grant time its
copy took, so copies take at most a tenth of the task's bubble time (D71). A
smaller state is saved at once: the gate fits it into a grant on the last
save's time, scaled by how the state grew; a forced one that fits no bubble
runs at a grant's start. So does a periodic one
kept out of every grant for :data:`OVERDUE_PERIODS` periods: one slow save (the
first of a process, a disk busy just then) would otherwise keep every later one
out until the loss bound, and this one measures the time again. A failed save
is reported and tried again later: it never ends the task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from freeride import protocol as p
from freeride.clock import Clock
from freeride.sidetask import IterativeTask
from freeride.worker.checkpoint import write_checkpoint
from freeride.worker.snapshot import StateCopy, StateWriter, WriteState

__all__ = ["OVERDUE_PERIODS", "STAGED_FROM_BYTES", "STEPS_PER_COPY", "CheckpointDue", "Checkpointer", "SaveCheckpoint"]

_RETRY_MAX_NS = 5_000_000_000
"""A failed checkpoint is tried again after the checkpoint period, or this, whichever is shorter."""

OVERDUE_PERIODS = 3
"""Periods a periodic checkpoint may wait for a grant it fits before it is taken at a grant's start."""

STAGED_FROM_BYTES = 32 << 20
"""A state this large (tensor and array bytes) is staged: written at once, it would take tens of ms."""

STEPS_PER_COPY = 9
"""A periodic staged checkpoint waits for this many times its last copy's grant time in steps (the loss bound
does not)."""

_PROBE_BYTES = 1 << 20
"""The first slice of a staged copy, before the copy's speed is known."""
_MIN_SLICE_BYTES = 64 << 10
"""A grant with room for less than this gives the copy nothing: the per-slice cost would dominate."""

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
    copying: bool = False
    """A staged checkpoint's copy is due or under way: grants copy its slices, and no step runs."""
    writing: bool = False
    """A staged checkpoint is being written: none other starts, and none is forced meanwhile."""
    overdue: bool = False
    """A periodic checkpoint has fitted no grant for :data:`OVERDUE_PERIODS` periods: take it at a grant's start."""


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
        write: Writes a staged state's copy (see :data:`~freeride.worker.snapshot.WriteState`).
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
        write: WriteState = write_checkpoint,
    ) -> None:
        self.assign = assign
        self.save = save
        self.write_state = write
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
        self._copy: StateCopy | None = None
        """A staged checkpoint's copy under way (its step count and start beside it)."""
        self._copy_steps = self._copy_began_ns = 0
        self._copy_spent_ns = 0
        """Grant time the copy under way (or the last one) has taken so far."""
        self._copy_cost_ns = 0
        """Grant time the last whole copy took (0: none yet)."""
        self._writer: StateWriter | None = None
        """A staged checkpoint being written."""
        self._unsaved_at_copy_ns = 0
        """Unsaved step time when the written copy was taken: what its write saves."""
        self._ns_per_byte = -1.0
        """What copying a byte took (-1: unknown); slices are sized on it."""
        self._staging_failed = False
        """A staged copy failed (its host memory could not be had): states are saved at once from then on."""

    def write(self, steps: int) -> bool:
        """Save the task's state at ``steps`` now; False if the write failed (reported, and retried later).

        A failure (a full disk: ``torch.save`` raises ``RuntimeError:
        basic_ios::clear``) must not end the task: it keeps its previous
        checkpoint and tries again.
        """
        self.settle()
        t0 = self._clock.now_ns()
        path = Path(self.assign.checkpoint_path)
        try:
            saved = self.save(self._task, path, steps)
        except Exception as exc:
            self._failed(steps, path, f"{type(exc).__name__}: {exc}")
            self._took_ns = max(self._took_ns, self._failed_ns - t0)
            return False
        if saved >= 0:
            self._send(p.Checkpointed(task_id=self.assign.task_id, steps=steps, path=str(path)))
        self._last_ns = self._clock.now_ns()
        self._took_ns = self._last_ns - t0
        self._bytes, self._sized = max(0, saved), -1
        self.saved_steps, self._unsaved_ns, self._failed_ns = steps, 0, -1
        return True

    def first(self, steps: int) -> None:
        """The checkpoint before any bubble: written now (it measures what one costs) unless the state is staged.

        A staged state needs no measure (its slices are sized as they go), and
        writing it now would take seconds beside the training.
        """
        if self._stages():
            self._log.info(
                "[worker] state of %.0f MB: checkpoints are staged (copied a slice per bubble, written in the "
                "background)",
                self._size_now() / 1e6,
            )
            return
        self.write(steps)

    def _stages(self) -> bool:
        return not self._staging_failed and max(self._bytes, self._size_now()) >= STAGED_FROM_BYTES

    def slice_bytes(self, room_ns: int) -> int:
        """How much of a staged copy fits in ``room_ns``: 0 if too little."""
        if self._ns_per_byte < 0:
            return _PROBE_BYTES if room_ns > 0 else 0
        n = int(room_ns / self._ns_per_byte)
        return n if n >= _MIN_SLICE_BYTES else 0

    def copy_slice(self, steps: int, max_bytes: int) -> None:
        """Copy the next slice of a staged checkpoint (beginning it); its last slice starts its write."""
        t0 = self._clock.now_ns()
        try:
            if self._copy is None:
                self._copy = StateCopy(self._task.state_dict())
                self._copy_steps, self._copy_began_ns, self._copy_spent_ns = steps, t0, 0
            copied = self._copy.copy(max_bytes)
        except Exception as exc:  # no host memory for the copy (a cap): save at once from now on
            self._copy, self._staging_failed = None, True  # a save at once may follow now: no retry delay
            error = f"staged copy failed, saving at once from now on: {type(exc).__name__}: {exc}"
            self._log.warning("[worker] checkpoint at step %d: %s", steps, error)
            self._send(p.CheckpointFailed(task_id=self.assign.task_id, steps=steps, error=error))
            return
        took = self._clock.now_ns() - t0
        self._copy_spent_ns += took
        if copied >= _MIN_SLICE_BYTES and took > 0:
            measured = took / copied  # learned upward at once, downward slowly: a slice must not overrun
            old = self._ns_per_byte
            self._ns_per_byte = measured if old < 0 else max(measured, 0.7 * old + 0.3 * measured)
        if self._copy.done:
            copied_state, self._copy = self._copy, None
            self._copy_cost_ns = self._copy_spent_ns
            if copied_state.total == 0 and not copied_state.state:
                self._last_ns, self._sized = self._copy_began_ns, -1  # no state: nothing to save
                return
            self._bytes, self._sized = copied_state.total, -1
            self._unsaved_at_copy_ns = self._unsaved_ns
            self._writer = StateWriter(
                self.write_state,
                copied_state.result(),
                Path(self.assign.checkpoint_path),
                steps=self._copy_steps,
                began_ns=self._copy_began_ns,
            )

    def poll(self) -> None:
        """Take in a staged checkpoint's write once its thread is done: reported either way."""
        writer = self._writer
        if writer is None or not writer.done:
            return
        self._writer = None
        if writer.error:
            self._failed(writer.steps, writer.path, writer.error)
            return
        self._send(p.Checkpointed(task_id=self.assign.task_id, steps=writer.steps, path=str(writer.path)))
        self._last_ns = writer.began_ns  # the checkpoint holds the state as its copy began
        self.saved_steps, self._failed_ns = writer.steps, -1
        self._unsaved_ns = max(0, self._unsaved_ns - self._unsaved_at_copy_ns)

    def settle(self) -> None:
        """Drop a staged copy under way and wait for a staged write: a checkpoint written now comes after it."""
        self._copy = None
        if self._writer is not None:
            self._writer.wait()
            self.poll()

    def _failed(self, steps: int, path: Path, error: str) -> None:
        """A checkpoint write failed: said, and tried again after the retry delay."""
        self._failed_ns = self._clock.now_ns()
        self._log.warning("[worker] checkpoint at step %d to %s failed: %s", steps, path, error)
        self._send(p.CheckpointFailed(task_id=self.assign.task_id, steps=steps, error=error))

    def at_stop(self, steps: int) -> bool:
        """The checkpoint of a stopped task, if its state is consistent; else the last one is kept, and said so."""
        if self._task.can_checkpoint():
            return self.write(steps)
        self.settle()  # a staged write under way is the newest consistent state: it must land
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
        self.poll()
        if self._copy is not None:
            return CheckpointDue(need_ns=-1, bound=False, copying=True)
        if self._writer is not None:  # steps go on while it writes, up to the loss bound
            return CheckpointDue(need_ns=-1, bound=self._loss_bound_reached(steps, step_ns), writing=True)
        retry = self._task.can_checkpoint() and self._retry_allowed(now)
        periodic = retry and now - self._last_ns >= self.assign.checkpoint_every_ns
        bound = retry and self._loss_bound_reached(steps, step_ns)
        if (periodic or bound) and self._stages():
            if bound or self._unsaved_ns >= STEPS_PER_COPY * self._copy_cost_ns:
                return CheckpointDue(need_ns=-1, bound=bound, copying=True)
            return CheckpointDue(need_ns=-1, bound=False)  # the steps since the last are not yet worth a copy
        overdue = periodic and now - self._last_ns >= OVERDUE_PERIODS * self.assign.checkpoint_every_ns
        return CheckpointDue(need_ns=self.estimate_ns() if periodic or bound else -1, bound=bound, overdue=overdue)
