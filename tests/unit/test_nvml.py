"""NvmlMonitor against the stand-in NVML library (tests/standins/fake_nvml.c) and without NVML.

pynvml loads ``libnvidia-ml.so.1`` once per process, so every configuration of
the stand-in runs in its own interpreter with ``LD_LIBRARY_PATH`` pointing at it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import freeride.gpu.nvml as nvml_mod
from freeride.gpu.nvml import NvmlMonitor

SOURCE = Path(__file__).resolve().parents[1] / "standins" / "fake_nvml.c"
GIB = 1 << 30


@pytest.fixture(scope="module")
def fake_libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Builds the stand-in twice: as a current driver and as one without the _v3 calls."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the NVML stand-in")
    out = {}
    for name, flags in (("v3", []), ("v2", ["-DFAKE_NVML_NO_V3"])):
        lib_dir = tmp_path_factory.mktemp(f"nvml-{name}")
        subprocess.run(
            ["gcc", "-shared", "-fPIC", *flags, "-o", str(lib_dir / "libnvidia-ml.so.1"), str(SOURCE)],
            check=True,
        )
        out[name] = lib_dir
    return out


def run_monitor(lib_dir: Path, script: str, **env: str) -> tuple[Any, str]:
    """Runs ``script`` (with ``mon = NvmlMonitor.open()`` and ``emit(obj)``) against the stand-in."""
    prelude = (
        "import json, logging, sys\n"
        "logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format='%(levelname)s %(message)s')\n"
        "from freeride.gpu.nvml import NvmlMonitor\n"
        "def emit(obj): print(json.dumps(obj))\n"
        "mon = NvmlMonitor.open()\n"
    )
    full_env = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir), **env}
    proc = subprocess.run(
        [sys.executable, "-c", prelude + script], env=full_env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


DEVICES = f"{80 * GIB}:{2 * GIB};{40 * GIB}:0"
PROCS = f"0:111:{GIB},0:222:na,1:333:{3 * GIB}"
MPS_PROCS = f"0:444:{GIB // 2},0:222:{GIB // 4}"

READ_ALL = """
emit({
    "count": mon.count,
    "devices": [[d.index, d.uuid, d.total, d.free, d.used] for d in mon.devices()],
    "procs": [sorted(mon.process_memory(i).items()) for i in range(mon.count)],
})
mon.close()
mon.close()
"""


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_devices_and_process_memory(fake_libs: dict[str, Path], tmp_path: Path, version: str) -> None:
    trace = tmp_path / "trace"
    result, _ = run_monitor(
        fake_libs[version],
        READ_ALL,
        FAKE_NVML_DEVICES=DEVICES,
        FAKE_NVML_PROCS=PROCS,
        FAKE_NVML_MPS_PROCS=MPS_PROCS,
        FAKE_NVML_TRACE=str(trace),
    )
    assert result["count"] == 2
    assert result["devices"] == [
        [0, "GPU-fake-0000", 80 * GIB, 78 * GIB, 2 * GIB],
        [1, "GPU-fake-0001", 40 * GIB, 40 * GIB, 0],
    ]
    # compute and MPS lists merged; "not available" (-1) loses to a reported size
    assert result["procs"] == [[[111, GIB], [222, GIB // 4], [444, GIB // 2]], [[333, 3 * GIB]]]
    called = set(trace.read_text().split())
    assert called == {
        f"nvmlDeviceGetComputeRunningProcesses_{version}",
        f"nvmlDeviceGetMPSComputeRunningProcesses_{version}",
    }


def test_transient_errors_return_the_last_answer_and_warn_once(fake_libs: dict[str, Path], tmp_path: Path) -> None:
    fail = tmp_path / "fail"
    script = f"""
import pathlib
fail = pathlib.Path({str(fail)!r})
good = (mon.devices(), mon.process_memory(0))
fail.touch()
bad = [(mon.devices(), mon.process_memory(0)) for _ in range(3)]
fail.unlink()
emit({{"same": all(b == good for b in bad), "after": len(mon.devices()), "good": len(good[0])}})
"""
    result, stderr = run_monitor(fake_libs["v3"], script, FAKE_NVML_FAIL_FILE=str(fail), FAKE_NVML_PROCS="0:9:1")
    assert result == {"same": True, "after": 1, "good": 1}
    warnings = [line for line in stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 2  # memory info once, process list once
    assert "keeping the last answer" in warnings[0]


def test_failure_before_any_answer_gives_empty_results(fake_libs: dict[str, Path], tmp_path: Path) -> None:
    fail = tmp_path / "fail"
    fail.touch()
    result, _ = run_monitor(
        fake_libs["v3"], "emit([mon.devices(), mon.process_memory(0)])", FAKE_NVML_FAIL_FILE=str(fail)
    )
    assert result == [[], {}]


def test_init_failure_means_no_nvml(fake_libs: dict[str, Path]) -> None:
    result, stderr = run_monitor(fake_libs["v3"], "emit(mon is None)", FAKE_NVML_INIT_ERROR="9")
    assert result is True
    assert "INFO [nvml] not available" in stderr


def test_bad_index_is_a_caller_error(fake_libs: dict[str, Path]) -> None:
    script = """
try:
    mon.process_memory(5)
except ValueError as exc:
    emit(str(exc))
"""
    result, _ = run_monitor(fake_libs["v3"], script)
    assert "index must be in [0, 1)" in result


@pytest.fixture
def fresh_log_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml_mod, "_unavailable_logged", False)


@pytest.mark.usefixtures("fresh_log_flag")
def test_without_pynvml_open_returns_none_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with caplog.at_level(logging.INFO, logger="freeride.gpu.nvml"):
        assert NvmlMonitor.open() is None
        assert NvmlMonitor.open() is None
    assert len(caplog.records) == 1
    assert caplog.records[0].levelno == logging.INFO


@pytest.mark.usefixtures("fresh_log_flag")
def test_without_the_library_open_returns_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pynvml = pytest.importorskip("pynvml")

    def missing() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", missing)
    with caplog.at_level(logging.INFO, logger="freeride.gpu.nvml"):
        assert NvmlMonitor.open() is None
    assert "not available" in caplog.text
