"""FreeRide installs one import package: nothing with a generic name lands on a training job's path.

The rank side (``backends/``) and the samples (``sidetasks/``) import as
``freeride.backends`` and ``freeride.sidetasks``; the runtime finds tasks by
their registered names and never imports the samples to do so.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERIC = ("backends", "sidetasks")


def _sources() -> list[Path]:
    """Every Python file of the project, each once (``freeride/backends`` and ``freeride/sidetasks`` are links)."""
    files = []
    for top in ("freeride", "backends", "sidetasks", "tools", "tests"):
        for path in (ROOT / top).rglob("*.py"):
            relative = path.relative_to(ROOT)
            if relative.parts[:2] not in (("freeride", "backends"), ("freeride", "sidetasks")):
                files.append(path)
    return files


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_no_module_imports_the_folders_by_their_generic_names() -> None:
    bare = [
        (str(path.relative_to(ROOT)), name)
        for path in _sources()
        for name in _imports(path)
        if name.split(".")[0] in GENERIC
    ]
    assert not bare, bare


def test_the_runtime_does_not_import_the_samples() -> None:
    """Only the CLI's ``submit --list`` reads the samples' descriptions."""
    runtime = [path for path in _sources() if path.relative_to(ROOT).parts[0] == "freeride"]
    importing = [
        str(path.relative_to(ROOT))
        for path in runtime
        for name in _imports(path)
        if name.startswith("freeride.sidetasks") and path.relative_to(ROOT) != Path("freeride/cli/submit.py")
    ]
    assert not importing, importing
    code = (
        "import sys; from freeride.tasks.targets import resolve; import freeride.serve.manager, freeride.worker.main; "
        "assert resolve('pagerank') == 'freeride.sidetasks.pagerank:PageRank'; "
        "assert not [m for m in sys.modules if m.startswith('freeride.sidetasks')], 'samples imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


@pytest.mark.parametrize("name", GENERIC)
def test_only_the_freeride_names_import_outside_the_source_tree(name: str) -> None:
    env = {"PATH": "/usr/bin:/bin"}  # no PYTHONPATH, and not run from the source tree
    bare = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, cwd="/", env=env)
    assert bare.returncode != 0 and "No module named" in bare.stderr, bare.stderr
    subprocess.run([sys.executable, "-c", f"import freeride.{name}"], check=True, cwd="/", env=env)
