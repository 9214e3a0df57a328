"""The test folders share one import namespace: a basename used twice fails collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename() -> None:
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts)
    assert [n for n, c in names.items() if c > 1 and n != "conftest.py"] == []
