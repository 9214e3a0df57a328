"""The imperative sample program: outputs, progress file, and resuming from its own outputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from _sidetaskfix import deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.sidetasks._imageio import read_image, write_pnm
from freeride.sidetasks._imageops import edge_pipeline, synthetic_scene
from freeride.sidetasks.imaging_cli import PROGRESS_FILE, main

ARGS = ["--images", "6", "--size", "32", "--sigma", "1.0", "--seed", "3"]


def _progress(out: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((out / PROGRESS_FILE).read_text())
    return data


def test_writes_edge_maps_and_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["--out", str(out), *ARGS]) == 0
    names = sorted(p.name for p in out.glob("*.pgm"))
    assert names == [f"edges_{i:08d}.pgm" for i in range(6)]
    assert _progress(out) == {"done": 6, "total": 6, "last": "edges_00000005.pgm"}
    _, _, edges = edge_pipeline(synthetic_scene(4, 32, seed=3).unsqueeze(0), 1.0)
    torch.testing.assert_close(read_image(out / names[4])[0], (edges[0, 0] * 255).round() / 255, atol=1e-6, rtol=0)
    assert "6 processed, 0 already done" in capsys.readouterr().out


def test_rerun_skips_finished_images(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    main(["--out", str(out), *ARGS])
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.pgm")}
    capsys.readouterr()
    main(["--out", str(out), *ARGS])
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.pgm")} == stamps
    assert "0 processed, 6 already done" in capsys.readouterr().out


def test_resumes_after_an_interrupted_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A run killed part-way leaves some outputs, maybe a half-written temporary file and a stale
    # progress file; rerunning must finish exactly the missing images, byte-identical to a clean run.
    clean, broken = tmp_path / "clean", tmp_path / "broken"
    main(["--out", str(clean), *ARGS])
    main(["--out", str(broken), *ARGS])
    for i in (2, 3, 5):
        (broken / f"edges_{i:08d}.pgm").unlink()
    (broken / ".edges_00000002.pgm.tmp").write_bytes(b"P5\n32 32\n255\n\x00\x01")
    (broken / PROGRESS_FILE).write_text(json.dumps({"done": 1, "total": 6, "last": "edges_00000000.pgm"}))
    capsys.readouterr()
    main(["--out", str(broken), *ARGS])
    assert "3 processed, 3 already done" in capsys.readouterr().out
    for f in clean.glob("*.pgm"):
        assert (broken / f.name).read_bytes() == f.read_bytes()
    assert _progress(broken)["done"] == 6


def test_more_images_extends_a_finished_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    main(["--out", str(out), *ARGS])
    main(["--out", str(out), *[a if a != "6" else "9" for a in ARGS]])
    assert len(list(out.glob("*.pgm"))) == 9 and _progress(out)["done"] == 9


def test_input_folder(tmp_path: Path) -> None:
    data, out = tmp_path / "in", tmp_path / "out"
    (data / "nested").mkdir(parents=True)
    write_pnm(data / "a.pgm", synthetic_scene(0, 20, seed=0)[1])
    np.save(data / "nested" / "b.npy", synthetic_scene(1, 12, seed=0).numpy())
    assert main(["--out", str(out), "--input", str(data)]) == 0
    assert sorted(os.listdir(out)) == ["a.pgm.edges.pgm", "nested__b.npy.edges.pgm", PROGRESS_FILE]
    assert read_image(out / "nested__b.npy.edges.pgm").shape == (1, 12, 12)  # native size is kept


@pytest.mark.parametrize(
    "bad", [["--images", "-1"], ["--images", "2", "--sigma", "0"], ["--images", "2", "--size", "1"]]
)
def test_bad_arguments_exit_with_usage(tmp_path: Path, bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "o"), *bad])
    assert exc.value.code == 2
