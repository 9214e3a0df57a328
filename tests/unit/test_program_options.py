"""An imperative program's options: checked alike by client and manager, its environment, its progress."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import msgspec
import pytest

from freeride import protocol as p
from freeride.cli.main import build_parser, main
from freeride.cli.program import cancel_outcome, program_spec
from freeride.serve.progress import MAX_METRICS, MAX_READ, ProgressReader, progress_source
from freeride.tasks.programs import BASE_ENV_KEYS, device_env, parse_env, program_env, spec_problem


def program(**fields: object) -> p.ProgramSpec:
    return msgspec.structs.replace(p.ProgramSpec(argv=["true"]), **fields)


def submit_args(*args: str) -> argparse.Namespace:
    argv = list(args)
    cut = argv.index("--")
    parsed = build_parser().parse_args(["submit", "--imperative", *argv[:cut]])
    parsed.command = argv[cut + 1 :]
    return parsed


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"cwd": "rel/dir"}, "cwd must be an absolute path"),
        ({"env": {"A=B": "x"}}, "environment variable name 'A=B' is invalid"),
        ({"env": {"": "x"}}, "is invalid"),
        ({"env": {"A": "x\0y"}}, "holds a NUL byte"),
        ({"env": {"BIG": "x" * (64 * 1024 + 1)}}, "BIG is longer than 65536 characters"),
        ({"progress_file": "p.json", "progress_pattern": "(?P<step>\\d+)"}, "not both"),
        ({"progress_pattern": "step (\\d+)"}, "has no named group"),
        ({"progress_pattern": "step (?P<step>\\d+"}, "is not a regular expression"),
    ],
)
def test_a_bad_program_option_is_named(fields: dict[str, object], words: str) -> None:
    assert words in spec_problem(program(**fields))


def test_program_options_on_an_iterative_task_are_refused() -> None:
    with pytest.raises(TypeError, match="cwd"):  # an iterative task's spec has no such field
        p.IterativeSpec(target="m:C", cwd="/tmp", sync_every=2)  # type: ignore[call-arg]
    assert spec_problem(program(cwd="/tmp", env={"A": "1"}, sync_every=4, progress_file="p.json")) == ""


def test_sync_every_is_bounded_on_the_wire() -> None:
    frame = msgspec.msgpack.encode(program(sync_every=1))
    decoder = msgspec.msgpack.Decoder(p.TaskSpec)
    assert decoder.decode(frame).sync_every == 1
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(frame.replace(b"\xaasync_every\x01", b"\xaasync_every\xff"))


def test_parse_env_reads_pairs_and_rejects_a_pair_without_a_value() -> None:
    assert parse_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(ValueError, match="--env expects NAME=VALUE, got 'A'"):
        parse_env(["A"])


def test_a_program_gets_the_base_and_its_own_variables_not_the_managers() -> None:
    manager = {"PATH": "/m/bin", "HOME": "/home/m", "LANG": "C.UTF-8", "AWS_SECRET_ACCESS_KEY": "s3cret"}
    env = program_env({"FOO": "bar", "PATH": "/c/bin"}, manager)
    assert env == {"PATH": "/c/bin", "HOME": "/home/m", "LANG": "C.UTF-8", "FOO": "bar"}
    assert "PATH" in BASE_ENV_KEYS and program_env({}, {})["PATH"] == os.defpath


def test_a_program_sees_its_devices_gpu_alone() -> None:
    assert device_env("cuda:3") == {"CUDA_VISIBLE_DEVICES": "3"}
    assert device_env("cpu:0") == {"CUDA_VISIBLE_DEVICES": ""}


def test_the_client_resolves_paths_sends_its_environment_and_checks_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FROM_SHELL", "1")
    spec = program_spec(submit_args("--cwd", "work", "--env", "A=1", "--sync-every", "8", "--", "./run.sh", "x"))
    assert spec.cwd == str(tmp_path / "work") and spec.argv == [str(tmp_path / "run.sh"), "x"]
    assert spec.env["A"] == "1" and spec.env["FROM_SHELL"] == "1" and spec.sync_every == 8
    clean = program_spec(submit_args("--clean-env", "--env", "A=1", "--", "true"))
    assert clean.env == {"A": "1"} and clean.cwd == ""
    with pytest.raises(SystemExit, match="--cwd 'nope' is not a directory"):
        program_spec(submit_args("--cwd", "nope", "--", "true"))
    with pytest.raises(SystemExit, match=r"--sync-every must be in 0\.\.1000000, got -1"):
        program_spec(submit_args("--sync-every", "-1", "--", "true"))
    with pytest.raises(SystemExit, match="has no named group"):
        program_spec(submit_args("--progress-pattern", "step \\d+", "--", "true"))


def test_program_options_without_imperative_fail_in_the_client(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--cwd, --sync-every only apply to --imperative programs"):
        main(["submit", "some.module:Task", "--cwd", "/tmp", "--sync-every", "3"])


def test_cancel_says_what_a_program_keeps_and_what_a_task_keeps() -> None:
    assert "starts from the beginning" in cancel_outcome("imperative")
    assert "checkpoint" not in cancel_outcome("imperative")
    assert cancel_outcome("iterative") == "its checkpoint is kept; submit it again to resume"


def test_a_progress_file_holds_a_step_or_metrics(tmp_path: Path) -> None:
    path = tmp_path / "progress"
    reader = ProgressReader(file=path)
    assert reader.read() is None  # not written yet
    path.write_text("42\n")
    seen = reader.read()
    assert seen is not None and seen.step == 42 and seen.metrics == {}
    path.write_text(json.dumps({"step": 7, "loss": 0.5, "name": "x", "nan": None}))
    seen = reader.read()
    assert seen is not None and seen.step == 7 and seen.metrics == {"loss": 0.5}
    path.write_text('{"step": 8, "lo')  # caught half-written
    assert reader.read() is None
    path.write_text(json.dumps({f"m{i}": i for i in range(MAX_METRICS + 10)}))
    seen = reader.read()
    assert seen is not None and seen.step == -1 and len(seen.metrics) == MAX_METRICS


def test_a_progress_pattern_reads_new_whole_lines_only(tmp_path: Path) -> None:
    out = tmp_path / "task.out"
    out.write_text("step 99 loss 9.0\n")  # an earlier run's: the log is appended to
    reader = ProgressReader(pattern=r"step (?P<step>\d+) loss (?P<loss>[\d.]+)", stdout=out)
    assert reader.read() is None
    with open(out, "a") as f:
        f.write("warming up\nstep 1 loss 2.5\nstep 2 loss 2.25\nstep 3 lo")
    seen = reader.read()
    assert seen is not None and seen.step == 2 and seen.metrics == {"loss": 2.25}
    with open(out, "a") as f:
        f.write("ss 2.0\n")
    seen = reader.read()
    assert seen is not None and seen.step == 3 and seen.metrics == {"loss": 2.0}


def test_a_program_that_prints_a_lot_is_read_from_its_latest_lines(tmp_path: Path) -> None:
    out = tmp_path / "task.out"
    out.touch()
    reader = ProgressReader(pattern=r"step (?P<step>\d+)", stdout=out)
    with open(out, "a") as f:
        f.writelines(f"step {i} of a long run\n" for i in range(4 * MAX_READ // 20))
        f.write("step 7 of a long run\n")
    seen = reader.read()
    assert seen is not None and seen.step == 7  # the last line, not the first slice's
    assert reader.read() is None


def test_a_relative_progress_file_is_under_the_programs_cwd(tmp_path: Path) -> None:
    reader = progress_source(file="p.json", pattern="", cwd=tmp_path, stdout=tmp_path / "o")
    assert reader is not None and reader.file == tmp_path / "p.json"
    assert progress_source(file="", pattern="", cwd=tmp_path, stdout=tmp_path / "o") is None
