"""tools/bench/attack_suite.py: every row names tests that exist, and a run's report reads back into verdicts."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from _benchfix import fixture_mod  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(name="suite")
def fixture_suite(mod: Callable[[str], ModuleType]) -> ModuleType:
    return mod("attack_suite")


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test")
    }


def test_every_attack_names_tests_that_exist_or_the_benchmark_that_measures_it(suite: ModuleType) -> None:
    defined: dict[str, set[str]] = {}
    for attack in suite.ATTACKS:
        assert attack.tests or attack.measured, f"{attack.id} {attack.attack}: neither tested nor measured"
        for node in attack.tests:
            path, _, name = node.partition("::")
            if path not in defined:
                assert (ROOT / path).is_file(), f"{attack.id}: no file {path}"
                defined[path] = _tests_in(ROOT / path)
            assert name in defined[path], f"{attack.id}: no test {node}"


_REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.unit.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.unit.test_a" name="test_param[1]" time="0.1"/>
<testcase classname="tests.unit.test_a" name="test_param[2]" time="0.1"><failure message="x"/></testcase>
<testcase classname="tests.ipc.test_b" name="test_root" time="0"><skipped message="needs root"/></testcase>
<testcase classname="tests.ipc.test_b" name="test_error" time="0"><error message="setup"/></testcase>
</testsuite></testsuites>"""


def test_a_report_reads_back_into_verdicts(suite: ModuleType) -> None:
    results = suite.outcomes(_REPORT)
    assert results == {
        "tests/unit/test_a.py::test_ok": "passed",
        "tests/unit/test_a.py::test_param": "failed",  # one case of it failed
        "tests/ipc/test_b.py::test_root": "skipped",
        "tests/ipc/test_b.py::test_error": "failed",
    }
    a = suite.Attack
    rows = suite.verdicts(
        [
            a("1", "held", "", ("tests/unit/test_a.py::test_ok", "tests/ipc/test_b.py::test_root")),
            a("2", "broken", "", ("tests/unit/test_a.py::test_ok", "tests/unit/test_a.py::test_param")),
            a("3", "skipped", "", ("tests/ipc/test_b.py::test_root",)),
            a("4", "not in the run", "", ("tests/unit/test_a.py::test_gone",)),
            a("5", "benchmark", "", measured="tools/bench/flood.py"),
        ],
        results,
    )
    assert [v for _, v in rows] == ["held", "broken", "not run here", "broken", "measured"]
    table = suite.table(rows)
    assert "| 5 | benchmark |  | measured (tools/bench/flood.py) | 0 |" in table
