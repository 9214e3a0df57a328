"""The manager's side of the bubble gate: one page per CUDA device, a slot per side task, host releases.

With ``freeride serve --device-gate`` the manager makes, in its private runtime
directory, a gate page (:mod:`freeride.gpu.bubblegate`) for every CUDA device a
rank trains on. It never touches CUDA: it only writes the page from the host.

* Each side task of the device whose worker found the gate working gets a
  **slot**: a gate word of its own, which its worker queues its next step
  behind when armed, so that an opening releases that task and no other.
* When the scheduler arms such a task (:mod:`freeride.serve.arming`), the
  manager closes its slot and names it in the page's control word with the
  shortest bubble its step fits; the rank's stream opens the named slot where
  the device reaches such a bubble (:mod:`freeride.backends.rank_gate`).
* The host opens a slot where no stream will: at a Grant the task gets on
  the host's path (its queued step then runs in that bubble), when the task is
  told to stop, and for every slot when the rank is gone, so that a worker
  never waits on a gate nobody opens.

Nothing here decides which task gets a bubble: that stays the scheduler's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path

from freeride.gpu.bubblegate import SLOTS, GateWord, page_path

__all__ = ["DeviceGate", "GatePages"]

logger = logging.getLogger(__name__)


class DeviceGate:
    """One device's gate page as the manager writes it."""

    def __init__(self, word: GateWord) -> None:
        self.word = word
        self._slots: dict[int, int] = {}
        """Task id -> slot."""
        self.ready: dict[int, str] = {}
        """Task id -> what its worker said of the gate (``ready`` or why not)."""

    @property
    def path(self) -> Path:
        return self.word.path

    def slot(self, task_id: int) -> int:
        """``task_id``'s slot, given on first use (0: every slot is taken)."""
        slot = self._slots.get(task_id)
        if slot is None:
            taken = set(self._slots.values())
            slot = next((k for k in range(1, SLOTS + 1) if k not in taken), 0)
            if slot:
                self._slots[task_id] = slot
                self.word.shut(slot)
        return slot

    def usable(self, task_id: int) -> bool:
        """Whether ``task_id``'s worker can queue steps behind the gate."""
        return self.ready.get(task_id) == "ready"

    def name(
        self, task_id: int, *, estimate_ns: int, margin_ns: int, factor: float, min_bubble_ns: int
    ) -> tuple[int, int]:
        """Close ``task_id``'s slot and name it for the next bubbles its step fits; (slot, bound) or (0, 0).

        A bubble is worth opening for where its expected length, as the guard
        sets deadlines (``factor``), holds the step and the margin and is no
        shorter than the guard's shortest: the bound the rank compares the
        announced length with is that, divided by ``factor``.
        """
        slot = self.slot(task_id)
        if not slot:
            self.word.set_control(0)
            return 0, 0
        need = max(min_bubble_ns, estimate_ns + max(0, margin_ns))
        min_open_ns = math.ceil(need / factor) if factor > 0 else need
        self.word.shut(slot)  # a step queued now waits for the rank's opening (or a host release)
        self.word.set_control(slot, min_open_ns)
        return slot, min_open_ns

    def name_none(self) -> None:
        """The rank opens no slot at the next bubbles (no gated task is armed)."""
        self.word.set_control(0)

    def release(self, task_id: int) -> None:
        """Open ``task_id``'s slot from the host, if it has one: what its worker queued runs now."""
        slot = self._slots.get(task_id)
        if slot:
            self.word.release(slot)

    def release_all_of(self, task_ids: Iterable[int]) -> None:
        """Open the slots of ``task_ids`` from the host: their grants are not back at their bubble's end.

        A step still running is not affected, nor a task with nothing queued (its
        next arm closes the slot first); a step the rank's stream never released
        (a rank that still maps the page of a manager before this one) runs now,
        late, rather than never.
        """
        for task_id in task_ids:
            self.release(task_id)

    def release_all(self) -> None:
        """Open every slot from the host and name none: the rank that would open them is gone."""
        self.word.set_control(0)
        for slot in self._slots.values():
            self.word.release(slot)

    def forget(self, task_id: int) -> None:
        """``task_id`` left the device: its slot is opened (nothing may wait there) and freed."""
        slot = self._slots.pop(task_id, 0)
        self.ready.pop(task_id, None)
        if slot:
            if self.word.control()[0] == slot:
                self.word.set_control(0)
            self.word.release(slot)

    def describe(self) -> str:
        """The gate's state for ``freeride status`` (one line)."""
        ready = sorted(t for t, why in self.ready.items() if why == "ready")
        refused = {t: why for t, why in sorted(self.ready.items()) if why != "ready"}
        parts = [f"device gate, used by task{'s' if len(ready) != 1 else ''} {', '.join(map(str, ready))}"]
        if not ready:
            parts = ["device gate, used by no task yet"]
        parts += [f"task {t} on the host path: {why}" for t, why in refused.items()]
        return "; ".join(parts)

    def close(self) -> None:
        """Release what waits, remove the page and unmap it (the manager is leaving)."""
        try:
            self.release_all()
        finally:
            self.word.path.unlink(missing_ok=True)
            self.word.close()


class GatePages:
    """The gate pages of a manager's devices (``serve --device-gate``), in its runtime ``directory``.

    Args:
        directory: The manager's private runtime directory; None: no device gate (it is off, or the
            ranks are remote: a tcp events endpoint).
    """

    def __init__(self, directory: Path | None) -> None:
        self._directory = directory
        self._pages: dict[str, DeviceGate] = {}

    def open(self, device: str) -> DeviceGate | None:
        """``device``'s page, made on first use; None off, for a device other than CUDA, or where it cannot be made."""
        if self._directory is None or not device.startswith("cuda"):
            return None
        gate = self._pages.get(device)
        if gate is not None:
            return gate
        path = page_path(self._directory, device)
        path.unlink(missing_ok=True)  # a page a manager before this one left in its (private) directory
        try:
            gate = DeviceGate(GateWord.create(path))
        except OSError as exc:
            logger.warning("[gate] no device gate for %s: cannot make %s: %s", device, path, exc.strerror)
            return None
        self._pages[device] = gate
        logger.info("[gate] device gate for %s at %s", device, path)
        return gate

    def get(self, device: str) -> DeviceGate | None:
        return self._pages.get(device)

    def close(self, device: str) -> None:
        gate = self._pages.pop(device, None)
        if gate is not None:
            gate.close()

    def close_all(self) -> None:
        for device in list(self._pages):
            self.close(device)
