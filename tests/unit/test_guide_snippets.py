"""The side-task guide shows its examples as they are: each code block is in an example file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "writing-side-tasks.md"
EXAMPLES = ROOT / "docs" / "examples"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)


def test_every_python_block_of_the_guide_is_verbatim_in_an_example_file() -> None:
    blocks = python_blocks(GUIDE.read_text())
    sources = {path.name: path.read_text() for path in EXAMPLES.glob("*.py")}
    assert len(blocks) >= 6
    for block in blocks:
        assert any(block in source for source in sources.values()), f"not in any example:\n{block}"


def test_every_example_is_in_the_guide_and_every_example_it_names_exists() -> None:
    text = GUIDE.read_text()
    named = set(re.findall(r"docs/examples/(\w+\.py)", text))
    assert named == {path.name for path in EXAMPLES.glob("*.py")}


def test_a_block_that_drifted_from_its_file_is_caught() -> None:
    drifted = "```python\n    def step(self) -> None:\n        pass\n```\n"
    [block] = python_blocks(drifted)
    assert not any(block in path.read_text() for path in EXAMPLES.glob("*.py"))
