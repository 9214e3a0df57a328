"""``FREERIDE_RUNTIME_DIR``: every command that takes ``--runtime-dir`` falls back to it, so a pod names it once."""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from freeride.cli import common
from freeride.cli.launch import launch_serve_argv
from freeride.cli.main import build_parser
from freeride.cli.serve import serve_config
from freeride.transport.endpoints import RUNTIME_DIR_ENV

CLI = Path(__file__).resolve().parents[2] / "freeride" / "cli"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every (sub)command that takes ``--runtime-dir``."""
    for action in parser._actions:
        if "--runtime-dir" in action.option_strings:
            yield path
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def test_no_command_fixes_a_runtime_dir_of_its_own() -> None:
    parser = build_parser()
    commands = list(_commands(parser))
    assert {("serve",), ("launch",), ("status",), ("submit",), ("profile",), ("profile-task",)} <= set(commands)
    for path in commands:
        sub = parser
        for name in path:
            (choices,) = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
            sub = choices.choices[name]
        (option,) = [a for a in sub._actions if "--runtime-dir" in a.option_strings]
        assert option.default is None, path  # unset: common.runtime_dir asks the environment


def test_only_the_shared_helper_reads_the_option() -> None:
    readers = []
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "runtime_dir" and ast.unparse(node.value) == "args":
                readers.append(path.name)
    assert set(readers) == {"common.py"}


def test_the_environment_names_the_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path / "rt"))
    parser = build_parser()
    assert common.runtime_dir(parser.parse_args(["status"])) == tmp_path / "rt"
    assert common.endpoints(parser.parse_args(["submit", "pagerank"])).control.startswith(f"ipc://{tmp_path}/rt/")
    assert serve_config(parser.parse_args(["serve"])).state_dir == tmp_path / "rt" / "state"
    serve = launch_serve_argv(parser.parse_args(["launch"]))
    assert serve[serve.index("--runtime-dir") + 1] == str(tmp_path / "rt")  # the manager a launch starts
    # the option still wins over the environment
    assert common.runtime_dir(parser.parse_args(["status", "--runtime-dir", str(tmp_path)])) == tmp_path
