"""A stand-in for the CUDA driver's stream memory operations, because no CUDA exists on CPU machines.

Each stream is a thread that runs what was queued on it in order, as a CUDA
stream does: a write stores a 32-bit value at a host address, a wait polls the
word at its address until a bit of its mask is set, a "kernel" is a Python
callable. Host registration is the identity (unified addressing), so the gate
word is the real shared page: a stand-in stream in one process sees what
another process wrote there. Only the order and the gating are imitated, not
the device's timing.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["FakeStreamOps"]

_POLL_S = 50e-6


class _Stream:
    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.pending = 0
        self.idle = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"fake-stream-{handle}", daemon=True)
        self.thread.start()

    def put(self, op: Callable[[], None] | None) -> None:
        with self.idle:
            self.pending += 1
        self.queue.put(op)

    def _run(self) -> None:
        while True:
            op = self.queue.get()
            if op is None:
                return
            try:
                op()
            finally:
                with self.idle:
                    self.pending -= 1
                    self.idle.notify_all()


class FakeStreamOps:
    """:class:`~freeride.gpu.bubblegate.StreamOps` on threads; :meth:`launch` queues a kernel."""

    def __init__(self) -> None:
        self._streams: dict[int, _Stream] = {}
        self._stopping = threading.Event()
        self.mapped: set[int] = set()
        self._sizes: dict[int, int] = {}
        self.writes: list[tuple[int, int]] = []
        """(stream, value) of every write queued, in queueing order."""

    def stream(self) -> int:
        handle = 0x1000 + len(self._streams)
        self._streams[handle] = _Stream(handle)
        return handle

    def _on(self, stream: int) -> _Stream:
        return self._streams[stream]

    def map_host(self, address: int, size: int) -> int:
        assert address not in self.mapped, "registered twice"
        self.mapped.add(address)
        self._sizes[address] = size
        return address

    def unmap_host(self, address: int) -> None:
        self.mapped.remove(address)
        del self._sizes[address]

    def _registered(self, address: int) -> bool:
        """Whether ``address`` lies in registered memory (a word of a registered page)."""
        return any(base <= address < base + size for base, size in self._sizes.items())

    def write(self, stream: int, device_address: int, value: int) -> None:
        assert self._registered(device_address), "write to unregistered memory"
        self.writes.append((stream, value))

        def store() -> None:
            ctypes.c_uint32.from_address(device_address).value = value

        self._on(stream).put(store)

    def wait_any(self, stream: int, device_address: int, mask: int) -> None:
        assert self._registered(device_address), "wait on unregistered memory"

        def wait() -> None:
            word = ctypes.c_uint32.from_address(device_address)
            while not word.value & mask and not self._stopping.is_set():
                time.sleep(_POLL_S)

        self._on(stream).put(wait)

    def launch(self, stream: int, kernel: Callable[[], None]) -> None:
        self._on(stream).put(kernel)

    def synchronize(self, stream: int, timeout_s: float = 10.0) -> None:
        s = self._on(stream)
        with s.idle:
            if not s.idle.wait_for(lambda: s.pending == 0, timeout=timeout_s):
                raise TimeoutError(f"fake stream {stream:#x} still has {s.pending} ops queued")

    def busy(self, stream: int) -> int:
        """Ops queued on ``stream`` and not yet done."""
        s = self._on(stream)
        with s.idle:
            return s.pending

    def close(self) -> None:
        """End every stream's thread; waits still blocked give up."""
        self._stopping.set()
        for s in self._streams.values():
            s.queue.put(None)
        for s in self._streams.values():
            s.thread.join(5)
