"""A training project with packages named like FreeRide's folders trains under ``freeride launch``, hooks attached.

FreeRide installs one import package, ``freeride``; its rank side and samples
import as ``freeride.backends`` and ``freeride.sidetasks``. A job's own
``backends``/``sidetasks`` packages are what the job imports, in every rank.
The job is a real ``torch.distributed.pipelining`` run (gloo, CPU).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import freeride_cmd, serving, status

TRAIN = Path(__file__).resolve().parents[2] / "tools" / "train"
STEPS = 6
CHECK = """\
import backends, sidetasks  # the job's own packages, beside this script

assert backends.WHOSE == sidetasks.WHOSE == "the job's own", (backends.__file__, sidetasks.__file__)
print("own packages imported", flush=True)
"""


def _job(tmp_path: Path) -> Path:
    job = tmp_path / "job"
    shutil.copytree(TRAIN, job, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("backends", "sidetasks"):
        (job / name).mkdir()
        (job / name / "__init__.py").write_text('WHOSE = "the job\'s own"\n')
    script = job / "torchpipe_gpt.py"
    text = script.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    script.write_text(head + sep + CHECK + rest)
    return script


def test_a_job_with_its_own_backends_package_trains_under_launch(runtime_dir: Path, tmp_path: Path) -> None:
    script = _job(tmp_path)
    train = [sys.executable, str(script), "--spawn", "2", "--compute", "sleep", "--micro-batches", "4"]
    train += ["--sleep-forward-ms", "10", "--sleep-backward-ms", "20", "--steps", str(STEPS)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FREERIDE_")}
    with serving(runtime_dir):
        cmd = [*freeride_cmd("launch", "--runtime-dir", str(runtime_dir), "--"), *train]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        reply = status(runtime_dir)
    assert done.returncode == 0, done.stderr[-4000:]
    # the launcher's process and both ranks ran the check
    assert done.stdout.count("own packages imported") == 3, done.stdout[-2000:]
    assert "manager reachable" in done.stderr, done.stderr[-4000:]  # FreeRide's hooks attached all the same
    assert len(reply.devices) == 2 and all(d.steps == STEPS and d.bubbles > 0 for d in reply.devices), reply.devices
