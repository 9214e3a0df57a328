"""A task's checkpoint directory on shared storage: accepted only when no one else can swap its files.

The directory must be ours or root's and, if others may write it, sticky (as
``/tmp``); a checkpoint file another user owns is never loaded. Tests that
need a second uid make it with ``os.chown`` as root (CI runs as root) and are
skipped elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from freeride import protocol as p
from freeride.auth import shared_dir_problem
from freeride.cli.main import main
from freeride.serve.intake import check_spec
from freeride.worker.checkpoint import UnsafeCheckpoint, load_checkpoint

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")


def _dir(tmp_path: Path, mode: int, name: str = "shared") -> Path:
    d = tmp_path / name
    d.mkdir()
    os.chmod(d, mode)
    return d


def _spec(checkpoint_dir: Path) -> p.TaskSpec:
    return p.IterativeSpec(target="freeride.sidetasks.pagerank:PageRank", checkpoint_dir=str(checkpoint_dir))


@pytest.mark.parametrize("mode", [0o700, 0o755, 0o1777, 0o1770])
def test_a_dir_of_ours_private_or_sticky_is_accepted(tmp_path: Path, mode: int) -> None:
    d = _dir(tmp_path, mode)
    assert shared_dir_problem(d) == ""
    assert check_spec(_spec(d)) == ""


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_dir_others_may_write_without_the_sticky_bit_is_refused_at_submit(tmp_path: Path, mode: int) -> None:
    d = _dir(tmp_path, mode)
    problem = check_spec(_spec(d))
    assert f"writable by others without the sticky bit (mode {mode:04o})" in problem
    assert f"chmod +t {d}" in problem and "\n" not in problem


def test_cluster_submit_refuses_such_a_dir_before_any_queue_is_reached(tmp_path: Path) -> None:
    d = _dir(tmp_path, 0o777)
    with pytest.raises(SystemExit, match=r"--checkpoint-dir .* writable by others without the sticky bit"):
        main(
            ["cluster", "submit", "--address", "127.0.0.1:1", "sweep-shard", "--name", "s", "--checkpoint-dir", str(d)]
        )


@as_root
def test_a_dir_another_user_owns_is_refused_even_if_private(tmp_path: Path) -> None:
    d = _dir(tmp_path, 0o700)
    os.chown(d, NOBODY, NOBODY)
    assert f"owned by uid {NOBODY}, not you" in check_spec(_spec(d))


@as_root
def test_a_link_another_user_planted_in_place_of_the_dir_is_refused(tmp_path: Path) -> None:
    target = _dir(tmp_path, 0o700, "mine")
    link = tmp_path / "shared"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    assert f"is a symlink owned by uid {NOBODY}" in shared_dir_problem(link)


def _checkpoint(path: Path, steps: int = 3) -> None:
    torch.save({"steps": steps, "state": {"w": torch.ones(2)}}, path)


@as_root
def test_a_checkpoint_another_user_planted_in_a_sticky_dir_is_not_loaded(tmp_path: Path) -> None:
    """What another user can still do in a sticky dir: create our file's name before our first save."""
    d = _dir(tmp_path, 0o1777)
    planted = d / "task.pt"
    _checkpoint(planted, steps=10_000)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafeCheckpoint, match=rf"task.pt is owned by uid {NOBODY}, not you .*remove it") as err:
        load_checkpoint(planted)
    assert "\n" not in str(err.value)


@as_root
def test_a_link_another_user_planted_to_a_checkpoint_of_ours_is_not_loaded(tmp_path: Path) -> None:
    d = _dir(tmp_path, 0o1777)
    ours = tmp_path / "old.pt"
    _checkpoint(ours)
    link = d / "task.pt"
    link.symlink_to(ours)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(UnsafeCheckpoint, match=f"owned by uid {NOBODY}"):
        load_checkpoint(link)


def test_our_own_checkpoint_loads(tmp_path: Path) -> None:
    path = _dir(tmp_path, 0o1777) / "task.pt"
    _checkpoint(path, steps=4)
    assert load_checkpoint(path)["steps"] == 4
