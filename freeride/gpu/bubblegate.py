"""Side work released by the device: a word in shared host memory that the training stream opens and closes.

A bubble announced over a socket reaches a side task's kernels only after the
host has learned of it (a helper thread, a socket, a worker, Python, kernel
launches): a fraction of a millisecond, several times the device's own
latency. The bubble gate moves the release onto the device:

* The gate is one 32-bit word in a page of shared host memory (a file in the
  runtime directory, mapped by every process that uses it and registered with
  CUDA so that the device reads and writes it directly).
* The training rank's compute stream **opens** the gate where it reaches a
  bubble (a stream write of the word, queued right before the wait) and
  **closes** it where it leaves (queued right after the wait). The device does
  both when it gets there, whatever the host is doing at that moment.
* A side worker queues its next pieces of work ahead of the bubble, each behind
  a **wait** on the gate on the worker's own stream: a piece starts when the
  device opens the gate and none starts after it closes, so the side stream
  pauses between bubbles on the device, piece by piece.
* The host can write the word too: a manager **releases** the waiting work
  when the rank that would open the gate is gone, so that nothing waits forever.

The page holds more than one gate word: word 0 (what a single gate uses, as
the GPU check's benchmark does) and one per **slot** (1 .. :data:`SLOTS`), so
that each side task of a device waits on a word of its own and an opening
releases only the task it is meant for. Beside them the manager writes a
**control** word (:meth:`GateWord.set_control`): which slot the training
stream is to open at the next bubbles, and the shortest bubble worth opening
for; a rank reads it on the host each time it reaches a bubble.

Each word holds a sequence number (one per opening) above two flags: whether
the gate is open, and whether the host rather than a stream wrote it. Waits
test only the open flag (``CU_STREAM_WAIT_VALUE_AND``); the sequence number
tells the host which bubble the device is in.

The CUDA driver's stream memory operations (``cuStreamWriteValue32``,
``cuStreamWaitValue32``) and host registration are reached through
:class:`StreamOps`; :func:`cuda_stream_ops` binds them from ``libcuda`` with
ctypes, and tests on machines without CUDA pass a stand-in. :func:`probe` says
whether a device can use the gate (and if not, why) before anything relies on it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "HOST",
    "OPEN",
    "SLOTS",
    "BubbleGate",
    "GateState",
    "GateUnavailable",
    "GateWord",
    "StreamOps",
    "cuda_stream_ops",
    "decode",
    "encode",
    "page_path",
    "probe",
    "stream_handle",
]

logger = logging.getLogger(__name__)

OPEN = 1
"""The flag a side stream's wait tests: set from a bubble's start to its end."""
HOST = 2
"""Set when the host wrote the word (a release or a reset), not a training stream."""
_SEQ_SHIFT = 2
_SEQ_MASK = (1 << (32 - _SEQ_SHIFT)) - 1
_WORD_BYTES = 4
_PAGE = mmap.PAGESIZE
_CONTROL = 8
"""Byte offset of the manager's control word (64 bits: the shortest bubble worth opening for, above the slot)."""
_FIRST_SLOT = 64
"""Byte offset of slot 1's word (slot 0's is at the page's start)."""
_HOLDER_BITS = 16
SLOTS = min((_PAGE - _FIRST_SLOT) // _WORD_BYTES, (1 << _HOLDER_BITS) - 1)
"""Slots of gate words in a page besides word 0: side tasks of one device that may use the gate."""


def _offset(slot: int) -> int:
    if not 0 <= slot <= SLOTS:
        raise ValueError(f"a gate slot is 0 .. {SLOTS}, got {slot}")
    return 0 if slot == 0 else _FIRST_SLOT + (slot - 1) * _WORD_BYTES


def page_path(directory: Path, device: str) -> Path:
    """Where the manager keeps ``device``'s gate page in its runtime ``directory`` (ranks and workers derive it)."""
    safe = "".join(c if c.isalnum() else "-" for c in device)
    return directory / f"gate-{safe}"


@dataclass(frozen=True, slots=True)
class GateState:
    """What a gate word says."""

    seq: int
    """How many times the gate has opened (modulo 2**30): which bubble the device is in, or was last."""
    open: bool
    host: bool
    """The host wrote it (a release or a reset)."""


def encode(seq: int, *, open: bool, host: bool = False) -> int:
    """The word for ``seq`` and the two flags."""
    return ((seq & _SEQ_MASK) << _SEQ_SHIFT) | (HOST if host else 0) | (OPEN if open else 0)


def decode(value: int) -> GateState:
    return GateState(seq=(value >> _SEQ_SHIFT) & _SEQ_MASK, open=bool(value & OPEN), host=bool(value & HOST))


class GateUnavailable(RuntimeError):
    """The device gate cannot be used here; the message says why (the host path is used instead)."""


class GateWord:
    """The page of shared host memory that holds a gate's word (one per device).

    The manager creates it (:meth:`create`); a rank and the workers of that
    device attach to it (:meth:`attach`), which refuses a file this user does not
    own or that others could write: a planted gate would let another user
    stall or release side work.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        try:
            self._map = mmap.mmap(fd, _PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._words: Any = (ctypes.c_uint32 * (_PAGE // _WORD_BYTES)).from_buffer(self._map)
        self._control: ctypes.c_uint64 | None = ctypes.c_uint64.from_buffer(self._map, _CONTROL)
        self.address = ctypes.addressof(self._words)
        """The page's host address, word 0's (page-aligned: the page is registered with CUDA whole)."""

    @classmethod
    def create(cls, path: Path) -> GateWord:
        """A new closed gate at ``path`` (mode 0600).

        Raises:
            OSError: ``path`` exists (a gate is made once per manager) or cannot be written.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, _PAGE)
        except BaseException:
            os.close(fd)
            raise
        word = cls(path, fd)
        word.write(encode(0, open=False, host=True))
        return word

    @classmethod
    def attach(cls, path: Path) -> GateWord:
        """The gate the manager made at ``path``.

        Raises:
            GateUnavailable: No such file, a link, not this user's, writable by others, or the wrong size.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise GateUnavailable(f"cannot open the bubble gate {path}: {exc.strerror}") from exc
        info = os.fstat(fd)
        why = ""
        if not stat.S_ISREG(info.st_mode):
            why = "not a regular file"
        elif info.st_uid != os.geteuid():
            why = f"owned by uid {info.st_uid}, not this user's"
        elif info.st_mode & 0o077:
            why = f"mode {stat.S_IMODE(info.st_mode):o}: others may read or write it"
        elif info.st_size != _PAGE:
            why = f"{info.st_size} bytes, not one page"
        if why:
            os.close(fd)
            raise GateUnavailable(f"refusing the bubble gate {path}: {why}")
        return cls(path, fd)

    def read(self, slot: int = 0) -> int:
        assert self._words is not None, "read after close"
        return int(self._words[_offset(slot) // _WORD_BYTES])

    def state(self, slot: int = 0) -> GateState:
        return decode(self.read(slot))

    def write(self, value: int, slot: int = 0) -> None:
        """Store ``value`` in ``slot``'s word from the host (an aligned 32-bit store: the device sees it whole)."""
        assert self._words is not None, "write after close"
        self._words[_offset(slot) // _WORD_BYTES] = value & 0xFFFFFFFF

    def release(self, slot: int = 0) -> None:
        """Open ``slot``'s gate from the host: whatever waits there runs (the rank that would open it is gone)."""
        self.write(encode(self.state(slot).seq, open=True, host=True), slot)

    def shut(self, slot: int = 0) -> None:
        """Close ``slot``'s gate from the host (nothing queued there runs until a stream opens it)."""
        self.write(encode(self.state(slot).seq, open=False, host=True), slot)

    def control(self) -> tuple[int, int]:
        """(slot, shortest bubble in ns): the slot a training stream opens at a bubble expected to last at least
        that long (slot 0: none). One aligned 64-bit load: the two never come from different writes."""
        assert self._control is not None, "read after close"
        value = int(self._control.value)
        return value & ((1 << _HOLDER_BITS) - 1), value >> _HOLDER_BITS

    def set_control(self, slot: int, min_open_ns: int = 0) -> None:
        """Name the slot training streams open at bubbles expected to last at least ``min_open_ns`` (0: none)."""
        assert self._control is not None, "write after close"
        _offset(slot)
        self._control.value = (max(0, min(min_open_ns, (1 << (64 - _HOLDER_BITS)) - 1)) << _HOLDER_BITS) | slot

    def close(self) -> None:
        """Unmap the page (idempotent); the file stays for the others that use it."""
        if self._words is None:
            return
        self._words = self._control = None  # the ctypes views hold the map's buffer: release them first
        self._map.close()


class StreamOps(Protocol):
    """The CUDA calls the gate makes (:func:`cuda_stream_ops`; tests pass a stand-in).

    Streams are raw handles (``torch.cuda.Stream.cuda_stream``); addresses are ints.
    """

    def map_host(self, address: int, size: int) -> int:
        """Register ``size`` bytes of host memory at ``address`` with the device; the device address of it."""
        ...

    def unmap_host(self, address: int) -> None: ...

    def write(self, stream: int, device_address: int, value: int) -> None:
        """Queue a store of ``value`` on ``stream`` (done when the stream gets there)."""
        ...

    def wait_any(self, stream: int, device_address: int, mask: int) -> None:
        """Queue a wait on ``stream`` until the word has a bit of ``mask`` set."""
        ...

    def synchronize(self, stream: int) -> None: ...


def stream_handle(stream: Any) -> int:
    """The raw handle of a ``torch.cuda.Stream`` (or a stand-in's int)."""
    return stream if isinstance(stream, int) else int(stream.cuda_stream)


class BubbleGate:
    """One process's use of a device's gate: open and close on a training stream, wait on a side stream.

    Args:
        word: The gate's page (attached or created).
        ops: The CUDA calls.
    """

    def __init__(self, word: GateWord, ops: StreamOps) -> None:
        self.word = word
        self._ops = ops
        self._device_address = ops.map_host(word.address, _PAGE)
        self._seqs: dict[int, int] = {}
        """Openings of each slot by this process's streams so far, continuing the word's count (a restarted rank)."""
        self._closed = False

    @property
    def seq(self) -> int:
        """The sequence number of word 0's latest opening queued by this process."""
        return self._seq(0)

    def _seq(self, slot: int) -> int:
        seq = self._seqs.get(slot)
        return self.word.state(slot).seq if seq is None else seq

    def _address(self, slot: int) -> int:
        return self._device_address + _offset(slot)

    def open_on(self, stream: Any, slot: int = 0) -> int:
        """Queue the opening of ``slot``'s gate on ``stream`` (the training stream, at a bubble's start); its seq."""
        seq = self._seqs[slot] = (self._seq(slot) + 1) & _SEQ_MASK
        self._ops.write(stream_handle(stream), self._address(slot), encode(seq, open=True))
        return seq

    def close_on(self, stream: Any, slot: int = 0) -> None:
        """Queue the closing of ``slot``'s gate on ``stream`` (the training stream, where the bubble ends)."""
        self._ops.write(stream_handle(stream), self._address(slot), encode(self._seq(slot), open=False))

    def wait_on(self, stream: Any, slot: int = 0) -> None:
        """Queue, on a side stream, a wait until ``slot``'s gate is open: the work queued after it starts then."""
        self._ops.wait_any(stream_handle(stream), self._address(slot), OPEN)

    def release(self, slot: int = 0) -> None:
        """:meth:`GateWord.release`."""
        self.word.release(slot)

    def shut(self, slot: int = 0) -> None:
        """:meth:`GateWord.shut`."""
        self.word.shut(slot)

    def close(self) -> None:
        """Unregister and unmap (idempotent). Work still queued behind a wait must be done first."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ops.unmap_host(self.word.address)
        finally:
            self.word.close()


def probe(ops: StreamOps, stream: Any, directory: Path) -> str:
    """Why the gate cannot be used with ``stream``'s device ("" where it can).

    Writes the word on the stream and checks the host sees it, then queues a
    wait that is already satisfied and checks the stream passes it, on a
    scratch page in ``directory``.
    """
    path = directory / f".gate-probe-{os.getpid()}"
    try:
        word = GateWord.create(path)
    except OSError as exc:
        return f"cannot make a scratch gate in {directory}: {exc.strerror}"
    try:
        gate = BubbleGate(word, ops)
        try:
            handle = stream_handle(stream)
            gate.open_on(handle)
            ops.synchronize(handle)
            if not word.state().open:
                return "a stream's write to mapped host memory did not reach the host"
            gate.wait_on(handle)
            ops.synchronize(handle)
            return ""
        finally:
            gate.close()
    except (GateUnavailable, OSError) as exc:
        return str(exc)
    finally:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------ libcuda
_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_DEVICEMAP = 0x02
_WAIT_VALUE_AND = 0x2
_WRITE_VALUE_DEFAULT = 0x0


class _CudaStreamOps:
    """:class:`StreamOps` through the driver API (the calling thread's current context is the runtime's)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        u32, u64, vp, uint = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint
        self._register = self._fn("cuMemHostRegister_v2", "cuMemHostRegister", [vp, ctypes.c_size_t, uint])
        self._device_pointer = self._fn(
            "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer", [ctypes.POINTER(u64), vp, uint]
        )
        self._unregister = self._fn("cuMemHostUnregister", "", [vp])
        self._write = self._fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32", [vp, u64, u32, uint])
        self._wait = self._fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32", [vp, u64, u32, uint])
        self._sync = self._fn("cuStreamSynchronize", "", [vp])
        self._error_name = lib.cuGetErrorName
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def _fn(self, name: str, older: str, argtypes: list[Any]) -> Any:
        fn = getattr(self._lib, name, None) or (getattr(self._lib, older, None) if older else None)
        if fn is None:
            raise GateUnavailable(f"the CUDA driver has no {name}: update the NVIDIA driver")
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        return fn

    def _check(self, result: int, what: str) -> None:
        if result == 0:
            return
        name = ctypes.c_char_p()
        self._error_name(result, ctypes.byref(name))
        raise GateUnavailable(f"{what} failed: {(name.value or b'?').decode()} ({result})")

    def map_host(self, address: int, size: int) -> int:
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_DEVICEMAP
        self._check(self._register(address, size, flags), "cuMemHostRegister")
        device = ctypes.c_uint64()
        self._check(self._device_pointer(ctypes.byref(device), address, 0), "cuMemHostGetDevicePointer")
        return int(device.value)

    def unmap_host(self, address: int) -> None:
        self._check(self._unregister(address), "cuMemHostUnregister")

    def write(self, stream: int, device_address: int, value: int) -> None:
        self._check(self._write(stream, device_address, value, _WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")

    def wait_any(self, stream: int, device_address: int, mask: int) -> None:
        self._check(self._wait(stream, device_address, mask, _WAIT_VALUE_AND), "cuStreamWaitValue32")

    def synchronize(self, stream: int) -> None:
        self._check(self._sync(stream), "cuStreamSynchronize")


def cuda_stream_ops() -> StreamOps:
    """The driver's stream memory operations, from ``libcuda.so.1``.

    Call it on a thread where PyTorch has used the device (its context is then
    current there).

    Raises:
        GateUnavailable: No CUDA driver, or one without these calls.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise GateUnavailable(f"no CUDA driver: {exc}") from exc
    return _CudaStreamOps(lib)
