"""``tools/gpu/check.sh --dry-run``: the GPU check's own path on CPU, end to end, as CI runs it.

One short run (two workloads, one pair of five steps each, one A/A pair shown
with both): the stage with emulated neighbours under a real ``freeride serve``
with a side task in its bubbles, the memory cap failing an over-cap task alone
while training goes on, and the sections that need a GPU saying so. Nothing here
depends on how fast the machine is: the test checks that every section ran and
what the report names, not the figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_a_report_of_every_section(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "tools/gpu/check.sh"), "--dry-run", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = out.read_text()
    assert "# FreeRide GPU check (CPU (dry run))" in report
    assert "the figures are CPU figures" in report
    assert "result: all sections ran" in report
    sections = ("## a. Pipeline stage", "## b. MPS memory cap", "## c. Tail", "## d. NVML", "## f. Side work", "## g.")
    for section in sections:
        assert section in report
    assert "needs a CUDA device" in report  # the GPU tests ran, and skipped
    assert "| graph-sgd | host |" in report  # on CPU the stage's waits block the host
    # the A/A pair runs with the first workload, and the second workload's section counts it too
    later = report[report.index("### pagerank in the bubbles") :]
    assert "| pagerank | host |" in report
    assert "from the section 'graph-sgd in the bubbles of an emulated-neighbour stage'" in later
    floors = [line for line in report.splitlines() if line.startswith("| A/A noise floor, step time")]
    assert len(floors) == 2 and all(line.split(" | ")[3] == "1" for line in floors), floors
    assert "-> fails alone" in report and "-> goes on" in report
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in report
