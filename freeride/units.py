"""Parsing and printing the sizes and durations users type: ``2G``, ``512M``, ``5ms``."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "format_ns", "parse_bytes", "parse_duration_ns", "parse_share", "printable"]

_SIZE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_TIME = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 1_000_000_000}


def parse_bytes(text: str) -> int:
    """``"2G"`` -> 2147483648. Suffixes K, M, G, T (powers of 1024), optional ``iB``/``B``.

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (try 512M or 2G)")
    return int(float(m.group(1)) * _SIZE[m.group(2).upper()])


def parse_duration_ns(text: str) -> int:
    """``"5ms"`` -> 5000000. Units ns, us, ms, s; a bare number means seconds.

    Raises:
        ValueError: not a duration.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ns|us|µs|ms|s)?\s*", text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (try 5ms or 0.2s)")
    return int(float(m.group(1)) * _TIME[m.group(2) or "s"])


def parse_share(text: str) -> float:
    """``"0.5%"`` -> 0.005; a bare number is the share itself (``"0.005"``).

    Raises:
        ValueError: not a share.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(%?)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a share: {text!r} (try 0.5% or 0.005)")
    return float(m.group(1)) / (100 if m.group(2) else 1)


def format_bytes(n: int) -> str:
    if n < 0:
        return "?"
    value = float(n)
    for suffix in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {suffix}" if suffix == "B" else f"{value:.1f} {suffix}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_ns(ns: int) -> str:
    if ns < 10_000:
        return f"{ns / 1e3:.1f} µs"
    if ns < 10_000_000:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


def printable(text: str) -> str:
    """``text`` with control characters escaped.

    Names, errors and metric keys come from other processes; an escape sequence
    printed raw would drive the reader's terminal.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
