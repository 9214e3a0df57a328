"""The import hook patches a module right after it executes, or at once if already imported."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from freeride.backends import importhook
from freeride.backends.launch import launch_env, read_mode


@pytest.fixture
def fake_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "fr_fake_framework.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fr_fake_framework"
    sys.modules.pop("fr_fake_framework", None)
    importhook.uninstall()


def patch(module: ModuleType) -> None:
    module.VALUE = module.VALUE + 41  # type: ignore[attr-defined]


def test_patch_runs_on_import(fake_pkg: str) -> None:
    importhook.install()
    importhook.register(fake_pkg, patch)
    module = __import__(fake_pkg)
    assert module.VALUE == 42


def test_patch_runs_at_once_on_an_imported_module(fake_pkg: str) -> None:
    module = __import__(fake_pkg)
    importhook.register(fake_pkg, patch)
    assert module.VALUE == 42
    importhook.register(fake_pkg, patch)  # never twice
    assert module.VALUE == 42


def test_a_failing_patch_does_not_break_the_import(fake_pkg: str, caplog: pytest.LogCaptureFixture) -> None:
    def broken(module: ModuleType) -> None:
        raise RuntimeError("framework changed")

    importhook.install()
    importhook.register(fake_pkg, broken)
    module = __import__(fake_pkg)
    assert module.VALUE == 1
    assert "training continues without FreeRide" in caplog.text


def test_launch_env_puts_the_hook_first_and_keeps_the_users_path() -> None:
    env = launch_env({"PYTHONPATH": "/user/lib", "X": "1"}, events="ipc:///tmp/fr/events")
    parts = env["PYTHONPATH"].split(":")
    assert (
        parts[0].endswith("_autoload") and parts[1] == "/user/lib" and (Path(parts[0]) / "sitecustomize.py").is_file()
    )
    assert env["FREERIDE_EVENTS"] == "ipc:///tmp/fr/events" and env["X"] == "1"
    assert read_mode(env) == ("emit", None)


def test_profile_mode_needs_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="profile_dir"):
        launch_env({}, events="ipc:///x", mode="profile")
    env = launch_env({}, events="ipc:///x", mode="profile", profile_dir=tmp_path)
    assert read_mode(env) == ("profile", tmp_path)
