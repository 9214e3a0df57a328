"""The attack and fault suite: every attack tried on FreeRide, the tests that reproduce it, and whether it holds.

Each row of :data:`ATTACKS` (tools/bench/_attacks.py) names an attack (another local user, a hostile
or careless client, a fault) and the tests that reproduce it: a test fails
if the defence is taken away. Running this script runs those tests and prints
the table docs/security.md keeps, with each attack ``held`` (its tests
passed), ``broken`` (one failed) or ``not run here`` (every test skipped,
e.g. one that needs root or a memory cgroup). A row without tests points to
the benchmark that measures it.

    flock /tmp/freeride-bench.lock .venv/bin/python tools/bench/attack_suite.py
    .venv/bin/python tools/bench/attack_suite.py --list     # the rows, nothing run

The same tests run in CI with the rest of the suite; this only gathers them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path

from _attacks import ATTACKS, Attack  # tools/bench is the script's directory

__all__ = ["ATTACKS", "Attack", "main", "outcomes", "verdicts"]

ROOT = Path(__file__).resolve().parents[2]


def outcomes(junit_xml: str) -> dict[str, str]:
    """``path::function`` -> ``passed``, ``failed`` or ``skipped`` from a pytest JUnit XML report.

    A parametrized test counts as failed if any case failed, as skipped if every case was.
    """
    seen: dict[str, list[str]] = {}
    for case in ET.fromstring(junit_xml).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        node = f"{path}::{case.get('name', '').split('[')[0]}"
        if case.find("failure") is not None or case.find("error") is not None:
            result = "failed"
        elif case.find("skipped") is not None:
            result = "skipped"
        else:
            result = "passed"
        seen.setdefault(node, []).append(result)
    return {
        node: "failed" if "failed" in results else "skipped" if set(results) == {"skipped"} else "passed"
        for node, results in seen.items()
    }


def verdicts(attacks: Iterable[Attack], results: dict[str, str]) -> list[tuple[Attack, str]]:
    """Each attack with ``held``, ``broken``, ``not run here`` or ``measured`` (no test: see its benchmark)."""
    out = []
    for attack in attacks:
        mine = [results.get(t, "missing") for t in attack.tests]
        if not mine:
            verdict = "measured"
        elif "failed" in mine or "missing" in mine:
            verdict = "broken"
        elif "passed" in mine:
            verdict = "held"
        else:
            verdict = "not run here"
        out.append((attack, verdict))
    return out


def table(rows: list[tuple[Attack, str]]) -> str:
    lines = ["| issue | attack or fault | what holds it off | today | tests |", "| --- | --- | --- | --- | ---: |"]
    for attack, verdict in rows:
        shown = verdict + (f" ({attack.measured})" if attack.measured and not attack.tests else "")
        needs = f", {attack.needs}" if attack.needs else ""
        lines.append(f"| {attack.id} | {attack.attack} | {attack.defence} | {shown} | {len(attack.tests)}{needs} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the rows without running their tests")
    args = parser.parse_args()
    if args.list:
        print(table([(a, "not run") for a in ATTACKS]))
        return 0
    nodes = sorted({t for a in ATTACKS for t in a.tests})
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "attacks.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *nodes]
        subprocess.run(cmd, cwd=ROOT, check=False, stdout=sys.stderr)
        rows = verdicts(ATTACKS, outcomes(report.read_text()))
    print(table(rows))
    return 0 if all(v != "broken" for _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
