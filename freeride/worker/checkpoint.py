"""Loading side-task checkpoints without running code from them.

A checkpoint is a pickle; loaded with ``torch.load(weights_only=False)`` it
could run anything its writer wanted, as the manager's user. Checkpoints are
therefore loaded with ``weights_only=True``: torch rebuilds only tensors,
containers and plain values, plus the types declared here (numpy arrays,
dtypes and scalars, and with them numpy's RNG states). A file with any other
type is refused with :class:`UnsafeCheckpoint`, and so is a file another user
owns (planted in a shared checkpoint directory); the task fails alone.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

from freeride.host.files import replace_atomically

__all__ = ["UnsafeCheckpoint", "load_checkpoint", "safe_types", "state_bytes", "write_checkpoint"]


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint holds types outside :func:`safe_types` (or is no torch checkpoint at all)."""


def safe_types() -> list[Any]:
    """What a task's state may hold beyond torch's own allowlist (tensors, RNG states, plain values).

    numpy arrays and scalars pickle as ``_reconstruct``/``scalar`` calls with a
    dtype; ``np.random.get_state()`` is a tuple around an array. Python's
    ``random.getstate()`` and numpy ``Generator`` states are plain values and
    need nothing.
    """
    import numpy as np
    import numpy.dtypes

    # the functions arrays and scalars pickle through, wherever this numpy keeps them (numpy 2 moved them)
    reconstruct, scalar = np.zeros(1).__reduce__()[0], np.float64(0).__reduce__()[0]
    dtype_classes = [getattr(numpy.dtypes, name) for name in numpy.dtypes.__all__]
    return [reconstruct, scalar, np.ndarray, np.dtype, *dtype_classes]


def _check_owner(path: Path, owner: int) -> None:
    """Refuse a checkpoint (or a link to one) that another user put where ours would be."""
    uid = os.getuid()
    link_owner = os.lstat(path).st_uid
    for who in (link_owner, owner):
        if who not in (uid, 0):
            raise UnsafeCheckpoint(
                f"checkpoint {path} is owned by uid {who}, not you (uid {uid}); it was not loaded: "
                "someone else may have planted it in a shared directory; remove it"
            )


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The saved ``{"steps": int, "state": dict}`` in ``path``, rebuilt from safe types only.

    Raises:
        UnsafeCheckpoint: the file (or a link to it) is another user's, asks
            for another type (a planted or foreign pickle) or is not a
            checkpoint of a worker.
    """
    import torch

    with open(path, "rb") as f:
        _check_owner(path, os.fstat(f.fileno()).st_uid)
        try:
            with torch.serialization.safe_globals(safe_types()):
                saved = torch.load(f, weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's message is a page of advice; the first line of its cause names the type
            detail = next((line.strip() for line in str(exc).splitlines() if "got <" in line or "GLOBAL" in line), "")
            raise UnsafeCheckpoint(
                f"checkpoint {path} holds types a checkpoint may not ({detail or 'see the log'}); it was not loaded: "
                "remove it if FreeRide did not write it, or declare the type in freeride.worker.checkpoint.safe_types"
            ) from None
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict) and isinstance(saved.get("steps"), int)):
        raise UnsafeCheckpoint(f"checkpoint {path} is not a FreeRide worker checkpoint; remove it")
    return saved


def write_checkpoint(state: object, path: Path, steps: int) -> None:
    """Write ``{"steps": steps, "state": state}`` to ``path`` through a new file renamed into place.

    A crash mid-write leaves the previous checkpoint; a link planted at
    ``path`` is replaced, never written through.
    """
    import torch

    replace_atomically(path, lambda f: torch.save({"steps": steps, "state": state}, f))


def state_bytes(state: object) -> int:
    """Bytes of tensor and array data in a task's state (nested dicts, lists and tuples): what a save writes.

    Cheap: it reads sizes, never data. A checkpoint's cost grows with it, so the
    duration of the last save is scaled by it before the next one is fitted into
    a bubble: a task's state often grows after its first save (an optimizer's
    momentum buffers appear at its first update).
    """
    total = 0
    stack: list[object] = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        else:
            nbytes = getattr(item, "nbytes", None)  # torch tensors and numpy arrays
            if isinstance(nbytes, int):
                total += nbytes
    return total
