"""Reading what a task class declares (options, peak memory, device kind), and the one resolver of task names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from freeride.tasks.declared import Declared, OptionError, OptionInfo, declared, declared_in_source, validate_options
from freeride.tasks.targets import catalog, load, resolve

DECL = Declared(
    name="T",
    options=(
        OptionInfo(name="n", type="int"),
        OptionInfo(name="rate", type="float", default=0.5),
        OptionInfo(name="fast", type="bool", default=False),
        OptionInfo(name="tag", type="str", default=""),
    ),
)


def test_options_are_converted_to_the_declared_types() -> None:
    assert validate_options(DECL, {"n": 3, "rate": 2, "fast": "true", "tag": 7}) == {
        "n": 3,
        "rate": 2.0,
        "fast": True,
        "tag": "7",
    }


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"n": 1, "nn": 2}, "unknown option 'nn'"),
        ({}, "missing required option 'n'"),
        ({"n": 1.5}, "n must be int, got float 1.5"),
        ({"n": True}, "n must be int, got bool True"),
        ({"n": 1, "rate": "fast"}, "rate must be float"),
        ({"n": 1, "fast": 3}, "fast must be bool"),
    ],
)
def test_bad_options_name_the_problem_and_list_what_is_accepted(options: dict[str, object], problem: str) -> None:
    with pytest.raises(OptionError) as caught:
        validate_options(DECL, options)  # type: ignore[arg-type]
    assert problem in str(caught.value)
    assert "It accepts: n: int, rate: float = 0.5, fast: bool = False, tag: str = ''" in str(caught.value)


def test_a_task_taking_kwargs_accepts_any_name() -> None:
    assert validate_options(Declared(name="T", open=True), {"anything": 1}) == {"anything": 1}


@pytest.mark.parametrize("name", sorted(catalog()))
def test_source_reading_agrees_with_inspecting_the_imported_class(name: str) -> None:
    assert declared_in_source(catalog()[name]) == declared(load(name))


def test_the_manager_reads_a_sample_without_importing_torch() -> None:
    code = (
        "import sys; from freeride.tasks.declared import declared_in_source; "
        "d = declared_in_source('freeride.sidetasks.vision:ResNet18Training'); "
        "assert d is not None and 'batch_size' in [o.name for o in d.options], d; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_an_unreadable_class_is_left_to_the_worker(tmp_path: Path) -> None:
    path = tmp_path / "dyn.py"
    path.write_text("import freeride\nBase = freeride.IterativeTask\nclass T(Base):\n    def step(self): pass\n")
    assert declared_in_source(f"{path}:T") is None  # a base it cannot follow: no guess
    assert declared_in_source(f"{path}:Missing") is None
    assert declared_in_source("no_such_module_here:T") is None


@pytest.mark.parametrize(
    "name",
    ["pagerank", "pagerank:PageRank", "freeride.sidetasks.pagerank:PageRank", "sidetasks.pagerank:PageRank"],
)
def test_every_spelling_of_a_sample_resolves_to_one_target(name: str) -> None:
    assert resolve(name) == "freeride.sidetasks.pagerank:PageRank"


def test_a_task_in_a_file_resolves_to_an_absolute_path_and_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mine.py").write_text(
        "from freeride import IterativeTask\n"
        "class Mine(IterativeTask):\n"
        "    peak_memory = 1 << 20\n"
        "    def __init__(self, *, k: int = 2) -> None:\n        self.k = k\n"
        "    def step(self) -> None:\n        pass\n"
        "class NotATask:\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    target = resolve("mine.py:Mine")
    assert target == f"{tmp_path / 'mine.py'}:Mine"
    cls = load(target)
    assert cls.__name__ == "Mine" and cls(k=3).k == 3  # type: ignore[call-arg]
    assert declared(cls) == declared_in_source(target)
    assert declared(cls).peak_memory == 1 << 20
    with pytest.raises(TypeError, match="not a subclass"):
        load("mine.py:NotATask")


@pytest.mark.parametrize("name", ["nope", "a b:C", "x.py:1C"])
def test_a_name_that_is_no_task_is_refused_with_the_forms_accepted(name: str) -> None:
    with pytest.raises(ValueError, match="side task"):
        resolve(name)
