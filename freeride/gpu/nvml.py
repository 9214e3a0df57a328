"""Device and per-process GPU memory from NVML, for placement and accounting.

Thin layer over NVIDIA's official bindings (package ``nvidia-ml-py``, module
``pynvml``). :meth:`NvmlMonitor.open` returns None on machines without NVML (no
package, no ``libnvidia-ml.so.1``, no driver), which is how FreeRide runs on
CPU-only hosts. Once open, the monitor never raises NVML errors into its caller:
a failing call is logged (a warning the first time, debug afterwards) and the
last good answer is returned, so polling every 100 ms from the manager's loop is
safe. Each call costs a few ioctls; do not call it per bubble.

Process ids are host PIDs (NVML does not know PID namespaces). Memory of a
process is -1 where NVML does not report it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import TracebackType
from typing import Any

__all__ = ["DeviceMemory", "NvmlMonitor"]

logger = logging.getLogger(__name__)

_PROCESS_CALLS = {
    "compute": ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
    "mps": ("nvmlDeviceGetMPSComputeRunningProcesses_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v2"),
}
_unavailable_logged = False


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceMemory:
    """Memory of one device, in bytes."""

    index: int
    """NVML index (PCI bus order; equals the CUDA ordinal only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``)."""
    uuid: str
    """``GPU-...`` identifier; empty if NVML did not report it."""
    total: int
    free: int
    used: int


def _log_unavailable(reason: str) -> None:
    global _unavailable_logged
    if not _unavailable_logged:
        _unavailable_logged = True
        logger.info("[nvml] not available (%s): no GPU memory monitoring", reason)


class NvmlMonitor:
    """Polls NVML for device and per-process memory. Create with :meth:`open`."""

    def __init__(self, nvml: Any, handles: list[Any], uuids: list[str]) -> None:
        self._nvml, self._handles, self._uuids = nvml, handles, uuids
        self._devices: dict[int, DeviceMemory] = {}
        self._procs: dict[int, dict[int, int]] = {}
        self._level = dict.fromkeys(_PROCESS_CALLS, 0)
        self._reported: set[tuple[str, int, int]] = set()
        self._open = True

    @classmethod
    def open(cls) -> NvmlMonitor | None:
        """Initialise NVML.

        Returns:
            A monitor, or None where NVML is not available (logged once, at info).
        """
        try:
            import pynvml
        except ImportError as exc:
            _log_unavailable(f"cannot import pynvml: {exc}")
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            _log_unavailable(str(exc))
            return None
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as exc:
            _log_unavailable(f"cannot list devices: {exc}")
            pynvml.nvmlShutdown()
            return None
        uuids = []
        for handle in handles:
            try:
                uuids.append(str(pynvml.nvmlDeviceGetUUID(handle)))
            except pynvml.NVMLError:
                uuids.append("")
        logger.info("[nvml] %d device(s): %s", len(handles), ", ".join(uuids))
        return cls(pynvml, handles, uuids)

    @property
    def count(self) -> int:
        """Number of devices NVML reported at open."""
        return len(self._handles)

    def uuid_of(self, device: str) -> str:
        """The ``GPU-...`` UUID of a manager device name.

        ``cuda:N`` is NVML's device N, as for free memory (the CUDA ordinal
        too where CUDA orders devices by PCI bus, as ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
        makes it do); read once at open, so it never changes while the manager runs.

        Returns:
            The UUID, or "" for another kind of device, an index NVML does
            not have, or a UUID NVML did not report.
        """
        kind, _, index = device.partition(":")
        if kind != "cuda" or not index.isdigit() or int(index) >= len(self._uuids):
            return ""
        return self._uuids[int(index)]

    def _report(self, what: str, index: int, exc: Exception) -> None:
        code = int(getattr(exc, "value", -1))
        key = (what, index, code)
        level = logging.DEBUG if key in self._reported else logging.WARNING
        self._reported.add(key)
        logger.log(level, "[nvml] %s of device %d failed: %s; keeping the last answer", what, index, exc)

    def devices(self) -> list[DeviceMemory]:
        """Memory of every device; a device whose query fails keeps its last answer (or is left out)."""
        if not self._open:
            return []
        out = []
        for index, handle in enumerate(self._handles):
            try:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except self._nvml.NVMLError as exc:
                self._report("memory info", index, exc)
            else:
                self._devices[index] = DeviceMemory(
                    index=index, uuid=self._uuids[index], total=int(mem.total), free=int(mem.free), used=int(mem.used)
                )
            if index in self._devices:
                out.append(self._devices[index])
        return out

    def process_memory(self, index: int) -> dict[int, int]:
        """Device memory per process on one device: compute and MPS clients together.

        Args:
            index: NVML device index.

        Returns:
            ``{pid: bytes}``, -1 bytes where NVML does not say; the last good answer
            (or an empty dict) if NVML fails.

        Raises:
            ValueError: If ``index`` is not a device index.
        """
        if not 0 <= index < len(self._handles):
            raise ValueError(f"index must be in [0, {len(self._handles)}), got {index}")
        if not self._open:
            return {}
        merged: dict[int, int] = {}
        for kind in _PROCESS_CALLS:
            try:
                procs = self._list(kind, self._handles[index])
            except self._nvml.NVMLError as exc:
                self._report(f"{kind} process list", index, exc)
                return dict(self._procs.get(index, {}))
            for proc in procs:
                used = -1 if proc.usedGpuMemory is None else int(proc.usedGpuMemory)
                merged[int(proc.pid)] = max(used, merged.get(int(proc.pid), -1))
        self._procs[index] = merged
        return dict(merged)

    def _list(self, kind: str, handle: Any) -> list[Any]:
        """Process list of one kind, through the newest call the driver has."""
        calls = _PROCESS_CALLS[kind]
        while self._level[kind] < len(calls):
            fn = getattr(self._nvml, calls[self._level[kind]], None)
            try:
                if fn is None:
                    raise self._nvml.NVMLError(self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
                return list(fn(handle))
            except self._nvml.NVMLError as exc:
                if exc.value == self._nvml.NVML_ERROR_NOT_SUPPORTED:
                    return []
                if exc.value != self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
                logger.debug("[nvml] %s not in this driver, falling back", calls[self._level[kind]])
                self._level[kind] += 1
        return []

    def close(self) -> None:
        """Shut NVML down (idempotent)."""
        if not self._open:
            return
        self._open = False
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            logger.warning("[nvml] shutdown failed: %s", exc)

    def __enter__(self) -> NvmlMonitor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
