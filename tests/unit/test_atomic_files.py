"""Files written whole, through a fresh temporary file: nothing planted in a shared directory is written through."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from freeride.host.files import replace_atomically
from freeride.worker.main import _read_checkpoint, _restore, _save_checkpoint


class _Counter:
    """The smallest task with state: what a worker checkpoints."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_a_link_planted_at_the_old_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    """A checkpoint dir on shared storage: another user links NAME.pt.tmp (and NAME.pt) to a file of ours."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    shared = tmp_path / "shared"
    shared.mkdir()
    path = shared / "task.pt"
    (shared / "task.pt.tmp").symlink_to(victim)
    path.symlink_to(victim)
    assert _save_checkpoint(_Counter(41), path, steps=7) == 0  # type: ignore[arg-type]  # (no tensor bytes)
    assert victim.read_bytes() == b"precious"
    assert not path.is_symlink()  # the link itself was replaced, not what it points to
    restored = _Counter(0)
    assert _restore(restored, _read_checkpoint(path)) == 7  # type: ignore[arg-type]
    assert restored.n == 41
    assert sorted(p.name for p in shared.iterdir()) == ["task.pt", "task.pt.tmp"]  # no temporary file left


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_bytes(b"old")

    def fails(f: object) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_atomically(path, fails)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.json"]
    replace_atomically(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.json"]
