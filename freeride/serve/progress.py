"""What an unmodified program says of its progress: a file it writes, or lines it prints.

A program knows nothing of FreeRide, so the manager reads its progress from
the outside, at most every :data:`PERIOD_S`:

* a progress file that the program rewrites: a number (the step) or a JSON
  object of numbers (``{"step": 120, "loss": 0.31}``);
* the program's stdout (the manager already appends it to
  ``LOG_DIR/task-ID-NAME.out``), matched line by line against a regular
  expression whose named groups are metrics, ``step`` being the step count.

Reads are bounded (:data:`MAX_READ`), so a program that prints gigabytes costs
the manager's loop a bounded slice per period (the latest: older lines are skipped); a line that does not parse is
skipped, never an error: the program is the user's, its output is not ours.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from freeride.protocol import I64_MAX
from freeride.serve.imperative import ExitInfo, ImperativeProcess

__all__ = ["MAX_READ", "PERIOD_S", "Progress", "ProgressReader", "progress_source", "watch_progress"]

logger = logging.getLogger(__name__)

PERIOD_S = 0.5
"""How often the manager reads a program's progress, at most."""
MAX_READ = 64 << 10
"""Bytes read per period: a progress file's head, or the last of the program's new stdout (the manager's
loop grants bubbles: a read and its regex must stay well under a millisecond or so)."""
MAX_METRICS = 64
"""Numbers kept from one read (a JSON file could hold any number of keys)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Progress:
    """What a read found."""

    step: int = -1
    """The program's step count, -1 if it did not say."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Its other numbers (finite only)."""


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _progress(values: dict[str, float]) -> Progress:
    step = values.pop("step", None)
    metrics = dict(list(values.items())[:MAX_METRICS])
    return Progress(step=min(int(step), I64_MAX) if step is not None and step >= 0 else -1, metrics=metrics)


class ProgressReader:
    """Reads one program's progress from a file or from its stdout log.

    Args:
        file: The progress file (absolute), or None.
        pattern: The regular expression for stdout lines, or None.
        stdout: The program's stdout log, read from its end at construction.
    """

    def __init__(self, *, file: Path | None = None, pattern: str = "", stdout: Path | None = None) -> None:
        if (file is None) == (not pattern):
            raise ValueError("give a progress file or a pattern (and not both)")
        if pattern and stdout is None:
            raise ValueError("a progress pattern needs the program's stdout log")
        self.file = file
        self.pattern = re.compile(pattern) if pattern else None
        self.stdout = stdout
        self._offset = 0
        self._partial = b""
        if stdout is not None:  # an earlier run's lines (the log is appended to) are not this run's
            try:
                self._offset = stdout.stat().st_size
            except OSError:
                self._offset = 0

    def read(self) -> Progress | None:
        """What the program said since the last read (the latest value of each number); None if nothing."""
        return self._read_file() if self.file is not None else self._read_lines()

    def _read_file(self) -> Progress | None:
        assert self.file is not None
        try:
            with open(self.file, "rb") as f:
                text = f.read(MAX_READ).decode("utf-8", "replace").strip()
        except OSError:
            return None  # not written yet, or being replaced
        if not text:
            return None
        value = _number(text)
        if value is not None:
            return _progress({"step": value})
        try:
            data = json.loads(text)
        except ValueError:
            return None  # half-written: the next read gets it
        if not isinstance(data, dict):
            return None
        values = {
            str(k)[:256]: float(v)
            for k, v in data.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        return _progress(values)

    def _read_lines(self) -> Progress | None:
        assert self.pattern is not None and self.stdout is not None
        try:
            with open(self.stdout, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size - self._offset > MAX_READ:  # only the latest values count: skip to the tail
                    self._offset, self._partial = size - MAX_READ, b""
                    f.seek(self._offset)
                    f.readline()  # the rest of a line begun before the tail
                    self._offset = f.tell()
                f.seek(self._offset)
                chunk = f.read(MAX_READ)
        except OSError:
            return None
        if not chunk:
            return None
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished line waits for its end
        if len(self._partial) > MAX_READ:  # a "line" that never ends is not progress
            self._partial = b""
        values: dict[str, float] = {}
        for raw in lines:
            match = self.pattern.search(raw.decode("utf-8", "replace"))
            if match is None:
                continue
            for name, text in match.groupdict().items():
                value = _number(text) if text is not None else None
                if value is not None:
                    values[name[:256]] = value
        return _progress(values) if values else None


def progress_source(*, file: str, pattern: str, cwd: Path, stdout: Path) -> ProgressReader | None:
    """The reader a program's spec asks for (a relative file is the program's, under its cwd), or None."""
    if file:
        return ProgressReader(file=cwd / file if not os.path.isabs(file) else Path(file))
    if pattern:
        return ProgressReader(pattern=pattern, stdout=stdout)
    return None


async def watch_progress(
    program: ImperativeProcess, reader: ProgressReader, apply: Callable[[Progress], None]
) -> ExitInfo:
    """Wait for the program to exit, handing what ``reader`` finds to ``apply`` every :data:`PERIOD_S`."""
    while True:
        try:
            async with asyncio.timeout(PERIOD_S):
                info = await program.wait()  # shielded: the timeout does not cancel the exit
        except TimeoutError:
            _apply(reader, apply)
            continue
        _apply(reader, apply)  # its last words
        return info


def _apply(reader: ProgressReader, apply: Callable[[Progress], None]) -> None:
    progress = reader.read()
    if progress is not None:
        apply(progress)
