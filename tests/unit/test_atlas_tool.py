"""tools/atlas.py: cases as data, the theory column from freeride.backends.schedule, the table it writes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def atlas() -> ModuleType:
    spec = importlib.util.spec_from_file_location("atlas", ROOT / "tools" / "atlas.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["atlas"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_theory_is_the_simulated_idle_share(atlas: ModuleType) -> None:
    case = atlas.Case
    assert atlas.theory(case(backend="sim", schedule="1f1b", p=4, m=4)) == pytest.approx(3 / 7)  # (p-1)/(m+p-1)
    assert atlas.theory(case(backend="sim", schedule="1f1b", p=4, m=8)) == pytest.approx(3 / 11)
    assert atlas.theory(case(backend="torchpipe", schedule="gpipe", p=2, m=4)) == pytest.approx(1 / 5)
    # interleaved: (p-1) / (v*m + p-1) with the per-chunk passes halved
    assert atlas.theory(case(backend="megatron", schedule="interleaved", p=2, m=4, v=2)) == pytest.approx(1 / 9)
    assert atlas.theory(case(backend="torchpipe", schedule="zbv", p=2, m=4, v=2, model="-")) is None


def test_the_cases_cover_the_asked_backends_and_schedules(atlas: ModuleType) -> None:
    kinds = {(c.backend, c.schedule) for c in atlas.CASES}
    assert kinds == {
        ("sim", "1f1b"), ("sim", "interleaved"), ("deepspeed", "1f1b"), ("megatron", "1f1b"),
        ("megatron", "interleaved"), ("torchpipe", "1f1b"), ("torchpipe", "interleaved"), ("torchpipe", "zbv"),
        ("torchpipe", "gpipe"), ("torchpipe", "interleaved-zb"), ("torchpipe", "looped-bfs"),
        ("torchpipe", "dualpipev"), ("deepspeed", "dualpipev"),
    }  # fmt: skip
    assert {(c.p, c.m) for c in atlas.CASES} == {(2, 4), (2, 8), (4, 4), (4, 8)}
    assert len({c.ident for c in atlas.CASES}) == len(atlas.CASES)
    assert all(c.backend in atlas.COMMANDS for c in atlas.CASES)


def test_deepspeed_is_told_its_schedule_unless_1f1b(atlas: ModuleType, tmp_path: Path) -> None:
    dualpipev = atlas.COMMANDS["deepspeed"](
        atlas.Case(backend="deepspeed", schedule="dualpipev", p=2, m=4, v=2), 5, tmp_path
    )
    assert dualpipev[dualpipev.index("--schedule") + 1] == "dualpipev" and "--stages" in dualpipev
    assert "--schedule" not in atlas.COMMANDS["deepspeed"](
        atlas.Case(backend="deepspeed", schedule="1f1b", p=2, m=4), 5, tmp_path
    )


def test_commands_name_the_schedule_and_split_the_layers(atlas: ModuleType, tmp_path: Path) -> None:
    case = atlas.Case(backend="torchpipe", schedule="interleaved", p=2, m=8, v=2)
    cmd = atlas.COMMANDS["torchpipe"](case, 5, tmp_path)
    assert cmd[1].endswith("tools/train/torchpipe_gpt.py")
    text = " ".join(cmd)
    assert "--spawn 2 --micro-batches 8 --layers 8 --steps 5" in text and "--schedule interleaved --vpp 2" in text
    assert "--sleep-forward-ms 2.5 --sleep-backward-ms 5" in text  # 10 / 20 ms per stage, halved per chunk, 2 blocks
    ds = " ".join(atlas.COMMANDS["deepspeed"](atlas.Case(backend="deepspeed", schedule="1f1b", p=4, m=4), 5, tmp_path))
    assert "--stages 4" in ds and "--schedule" not in ds
    sim = " ".join(atlas.COMMANDS["sim"](atlas.Case(backend="sim", schedule="interleaved", p=2, m=4, v=2), 5, tmp_path))
    assert f"sim --runtime-dir {tmp_path} --schedule interleaved --stages 2 --microbatches 4 --chunks 2" in sim


def test_the_table_shows_each_measure_and_failures(atlas: ModuleType) -> None:
    case = atlas.Case(backend="sim", schedule="1f1b", p=2, m=4)
    rows = [
        atlas.Row(case=case, theory=0.2, measured=0.21, used=0.5, step_ms=154.2, picture=f"{case.ident}.png"),
        atlas.Row(case=case, theory=None, note="profile failed (1): boom"),
    ]
    lines = atlas.table(rows, pictures="atlas").splitlines()
    assert lines[2] == "| sim | 1f1b | 2 | 4 | 1 | 20 % | 21 % | 50 % | 154 ms | [step](atlas/sim-1f1b-p2-m4.png) |  |"
    assert lines[3] == "| sim | 1f1b | 2 | 4 | 1 | - | - | - | - | - | profile failed (1): boom |"


def test_list_runs_nothing_and_a_filter_that_matches_nothing_is_refused(
    atlas: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert atlas.main(["--list", "--only", "zbv"]) == 0
    assert capsys.readouterr().out.count("| torchpipe | zbv |") == 4
    with pytest.raises(SystemExit):
        atlas.main(["--only", "no-such-case"])


def test_a_case_with_more_stages_than_cores_is_not_run(
    atlas: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On the CPU stand-in a device is a core: two stages sharing one would be one device."""
    monkeypatch.setattr(atlas.os, "sched_getaffinity", lambda pid: {0, 1})
    case = atlas.Case(backend="deepspeed", schedule="1f1b", p=4, m=4)
    row = atlas.run_case(case, out=tmp_path, steps=2, used_steps=2, with_used=True, timeout_s=1)
    assert row.note == "needs 4 cores (one per stage), this machine has 2"
    assert row.theory == pytest.approx(3 / 7) and row.measured is None and not list(tmp_path.iterdir())


def test_rows_left_for_want_of_cores_do_not_fail_the_run_and_a_failed_row_does(
    atlas: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(atlas.os, "sched_getaffinity", lambda pid: {0, 1})
    assert atlas.main(["--only", "sim-1f1b-p4", "--out", str(tmp_path)]) == 0
    assert "needs 4 cores" in capsys.readouterr().out

    def failing(case: object, **_: object) -> object:
        return atlas.Row(case=case, theory=None, note="profile failed (1): boom")

    monkeypatch.setattr(atlas, "run_case", failing)
    assert atlas.main(["--only", "sim-1f1b-p2-m4", "--out", str(tmp_path)]) == 1
