"""`freeride serve`'s flags reach the manager's configuration."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from freeride.cli.main import build_parser
from freeride.cli.serve import serve_config


def test_every_serve_flag_reaches_the_config(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--runtime-dir",
            str(tmp_path),
            "--margin",
            "0.5ms",
            "--checkpoint-every",
            "5s",
            "--backend-timeout",
            "7s",
            "--side-priority",
            "same",
            "--hang-after",
            "3s",
            "--hang-factor",
            "4",
            "--restart-backoff",
            "200ms",
            "--restart-backoff-max",
            "9s",
            "--max-loss",
            "30s",
            "--max-loss-steps",
            "500",
        ]
    )
    config = serve_config(args)
    assert (config.margin_ns, config.checkpoint_every_s, config.backend_timeout_s) == (500_000, 5.0, 7.0)
    assert config.side_priority == "same"
    assert (config.hang_after_s, config.hang_factor) == (3.0, 4.0)
    assert (config.restart_backoff_s, config.restart_backoff_max_s) == (0.2, 9.0)
    assert (config.max_loss_s, config.max_loss_steps) == (30.0, 500)


def test_serve_defaults(tmp_path: Path) -> None:
    config = serve_config(build_parser().parse_args(["serve", "--runtime-dir", str(tmp_path)]))
    assert config.side_priority == "low" and config.hang_after_s == 10.0 and config.max_loss_s == 120.0


def test_a_bad_side_priority_is_refused_by_the_parser(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--runtime-dir", str(tmp_path), "--side-priority", "high"])


def test_a_config_file_sets_serve_options_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    from freeride.cli.main import parse_args

    config = tmp_path / "serve.toml"
    config.write_text(
        'hang-after = "30s"\nhang_factor = 4\nside-priority = "same"\nmps = true\nmetrics-port = 9464\nmargin = "1ms"\n'
    )
    args = parse_args(["serve", "--runtime-dir", str(tmp_path), "--config", str(config), "--margin", "2ms"])
    got = serve_config(args)
    assert (got.hang_after_s, got.hang_factor, got.side_priority, got.mps) == (30.0, 4.0, "same", True)
    assert got.metrics_port == 9464
    assert got.margin_ns == 2_000_000  # given on the command line too: the command line wins


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("hang-afterr = 3\n", "unknown option 'hang-afterr'; the options are:"),
        ("mps = 1\n", "mps must be true or false"),
        ('side-priority = "high"\n', "side-priority must be one of ['low', 'same']"),
        ("margin = [1]\n", "margin must be a value as on the command line"),
        ("hang-after = \n", "is not TOML"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_the_key(tmp_path: Path, text: str, said: str) -> None:
    from freeride.cli.main import parse_args

    config = tmp_path / "serve.toml"
    config.write_text(text)
    with pytest.raises(SystemExit, match=re.escape(said)):
        parse_args(["serve", "--runtime-dir", str(tmp_path), "--config", str(config)])
    with pytest.raises(SystemExit, match="cannot read --config"):
        parse_args(["serve", "--config", str(tmp_path / "missing.toml")])
