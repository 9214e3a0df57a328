"""``freeride cluster submit`` refuses bad input at once, before it reaches Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from freeride.cli.main import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sweep-shard"], "give the jobs a --name"),
        (["sweep-shard", "--name", "s", "--shards", "0"], "--shards must be >= 1"),
        (["sweep-shard", "--name", "s", "--opt", "nope=1"], "nope"),
        (["no-such-task", "--name", "s"], "unknown side task 'no-such-task'"),
        (["sweep-shard", "--name", "s", "--checkpoint-dir", "/no/such/dir"], "is not a directory"),
    ],
)
def test_bad_submissions_fail_before_any_queue_is_reached(args: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["cluster", "submit", "--address", "127.0.0.1:1", *args])


def test_bad_agent_settings_fail_with_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["cluster", "join", "--address", "127.0.0.1:1", "--runtime-dir", str(tmp_path), "--lease", "1s"])
    assert code == 2
    assert "lease_s must be at least 3 ticks" in capsys.readouterr().err


def test_an_address_where_no_ray_listens_is_one_line_and_3(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray", reason="the cluster queue needs Ray: pip install 'freeride-runtime[ray]'")
    assert main(["cluster", "status", "--address", "127.0.0.1:1"]) == 3  # refused at once: Ray would retry
    assert "no Ray cluster answers at 127.0.0.1:1" in capsys.readouterr().err


def test_a_relative_path_option_is_made_absolute_where_the_submitter_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each node would resolve it against another directory (the sweep refused it on every node, 3 times)."""
    from freeride.cli.cluster import _job_specs
    from freeride.cli.main import build_parser

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(
        ["cluster", "submit", "sweep-shard", "--name", "s", "--shards", "2", "--opt", "out=results/sum"]
    )
    specs = _job_specs(args)
    assert [spec.options["out"] for spec in specs] == [str(tmp_path / "results" / "sum")] * 2
    kept = {"out": "/abs/x", "data_dir": "s3://bucket/x", "name": "a/b", "size": 3}
    from freeride.cli.submission import absolute_paths

    assert absolute_paths(kept, str(tmp_path)) == kept  # absolute, a URL, not a path option, not a string
    assert absolute_paths({"data_dir": "../d"}, str(tmp_path)) == {"data_dir": str(tmp_path.parent / "d")}
