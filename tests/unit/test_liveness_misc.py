"""Lesser defects: the demo's runtime directory, and submit's import check that must not import."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import pytest

import freeride.cli.demo
from freeride import protocol as p
from freeride.serve.intake import check_spec


@pytest.mark.parametrize("fails", [False, True], ids=["reported", "failed"])
def test_the_demo_removes_its_runtime_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fails: bool) -> None:
    made: list[Path] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(prefix: str = "") -> str:
        made.append(Path(real_mkdtemp(prefix=prefix, dir=tmp_path)))
        return str(made[-1])

    async def demo_in(options: freeride.cli.demo.DemoOptions, runtime_dir: Path) -> freeride.cli.demo.DemoReport:
        (runtime_dir / "state" / "logs").mkdir(parents=True)
        (runtime_dir / "control").write_text("a socket file")
        if fails:
            raise RuntimeError("the demo failed")
        return freeride.cli.demo.DemoReport(options=options, status=None)  # type: ignore[arg-type]

    monkeypatch.setattr(freeride.cli.demo.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(freeride.cli.demo, "_demo_in", demo_in)
    if fails:
        with pytest.raises(RuntimeError):
            asyncio.run(freeride.cli.demo._demo(freeride.cli.demo.DemoOptions()))
    else:
        asyncio.run(freeride.cli.demo._demo(freeride.cli.demo.DemoOptions()))
    [runtime_dir] = made
    assert not runtime_dir.exists()


def test_submit_checks_a_target_without_importing_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # a package whose import is slow (torch for torch.nn): the manager's loop must not run it
    pkg = tmp_path / "slowpkg_for_submit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    (pkg / "tasks.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check_spec(p.IterativeSpec(target="slowpkg_for_submit.tasks:Task")) == ""
    assert not (tmp_path / "imported").exists()
    assert "slowpkg_for_submit" not in sys.modules
    problem = check_spec(p.IterativeSpec(target="no_such_package_here.x:Task"))
    assert "cannot import module" in problem
