"""`freeride launch`'s manager options: what a started manager runs, and `serve --metrics-host`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from freeride.cli.launch import launch_serve_argv
from freeride.cli.main import build_parser
from freeride.cli.serve import serve_config


def _launch(tmp_path: Path, *flags: str) -> list[str]:
    args = build_parser().parse_args(["launch", "--runtime-dir", str(tmp_path), *flags])
    return launch_serve_argv(args)


def test_a_started_manager_serves_the_launchs_runtime_dir_until_its_jobs_end(tmp_path: Path) -> None:
    argv = _launch(tmp_path, "--serve-args", "--side-priority same --state-dir '/scratch/a b'")
    assert argv[:3] == [sys.executable, "-P", "-m"]  # -P: nothing imported from the launch's cwd
    serve = argv[argv.index("serve") + 1 :]
    assert serve == [
        "--runtime-dir",
        str(tmp_path),
        "--exit-with-jobs",
        "--side-priority",
        "same",
        "--state-dir",
        "/scratch/a b",
    ]
    config = serve_config(build_parser().parse_args(["serve", *serve]))
    assert config.side_priority == "same" and config.state_dir == Path("/scratch/a b")


def test_keep_manager_starts_one_that_stays(tmp_path: Path) -> None:
    assert "--exit-with-jobs" not in _launch(tmp_path, "--keep-manager")


def test_tcp_and_keys_pass_through_launch(tmp_path: Path) -> None:
    argv = _launch(tmp_path, "--tcp", "10.0.0.1:5555", "--keys-dir", str(tmp_path / "k"))
    serve = argv[argv.index("serve") + 1 :]
    assert serve[2:6] == ["--tcp", "10.0.0.1:5555", "--keys-dir", str(tmp_path / "k")]


@pytest.mark.parametrize("flag", ["--runtime-dir=/x", "--tcp 1.2.3.4:5", "--exit-with-jobs"])
def test_launchs_own_options_are_refused_in_serve_args(tmp_path: Path, flag: str) -> None:
    with pytest.raises(ValueError, match="to launch itself"):
        _launch(tmp_path, f"--serve-args={flag}")  # one word starting with -- needs the = form


def test_metrics_host_reaches_the_config(tmp_path: Path) -> None:
    serve = ["serve", "--runtime-dir", str(tmp_path), "--metrics-port", "0"]
    assert serve_config(build_parser().parse_args(serve)).metrics_host == "127.0.0.1"
    config = serve_config(build_parser().parse_args([*serve, "--metrics-host", "0.0.0.0"]))
    assert config.metrics_host == "0.0.0.0"
