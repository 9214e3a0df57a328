"""An independent checker of the Trace Event Format (JSON Object Format), for tests.

Written from the format's description, not from freeride/observe/trace.py: required
fields per phase, numeric timestamps, durations >= 0, metadata with the args
Perfetto reads, and per track (pid, tid) timestamps that never go back and
complete slices that do not overlap (FreeRide writes no nested slices).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["check_trace", "load_checked"]

_PHASES = set("BEXiIbneCMsftPOND") | {"(", ")"}
_META_ARGS = {
    "process_name": ("name", str),
    "thread_name": ("name", str),
    "process_sort_index": ("sort_index", int),
    "thread_sort_index": ("sort_index", int),
    "process_labels": ("labels", str),
}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_trace(doc: Any) -> list[dict[str, Any]]:
    """Return the events of ``doc``; raise AssertionError naming the first violation."""
    assert isinstance(doc, dict), "JSON Object Format: the top level is an object"
    assert isinstance(doc.get("traceEvents"), list), "traceEvents must be a list"
    if "displayTimeUnit" in doc:
        assert doc["displayTimeUnit"] in ("ms", "ns"), f"displayTimeUnit {doc['displayTimeUnit']!r}"
    events: list[dict[str, Any]] = doc["traceEvents"]
    last_ts: dict[tuple[int, int], float] = {}
    last_end: dict[tuple[int, int], float] = {}
    for n, ev in enumerate(events):
        where = f"event {n} {ev!r}"
        assert isinstance(ev, dict), where
        ph = ev.get("ph")
        assert ph in _PHASES, f"{where}: unknown phase"
        assert isinstance(ev.get("name"), str) and ev["name"], f"{where}: name"
        assert isinstance(ev.get("pid"), int) and isinstance(ev.get("tid"), int), f"{where}: pid/tid"
        if "args" in ev:
            assert isinstance(ev["args"], dict), f"{where}: args must be an object"
        if ph == "M":
            assert ev["name"] in _META_ARGS, f"{where}: unknown metadata event"
            key, kind = _META_ARGS[ev["name"]]
            assert isinstance(ev.get("args", {}).get(key), kind), f"{where}: metadata needs args.{key}"
            continue
        assert _number(ev.get("ts")), f"{where}: ts must be a number (µs)"
        if "cat" in ev:
            assert isinstance(ev["cat"], str), f"{where}: cat"
        track = (ev["pid"], ev["tid"])
        ts = float(ev["ts"])
        assert ts >= last_ts.get(track, float("-inf")), f"{where}: ts goes back on track {track}"
        last_ts[track] = ts
        if ph == "X":
            assert _number(ev.get("dur")) and ev["dur"] >= 0, f"{where}: X needs dur >= 0"
            assert ts >= last_end.get(track, float("-inf")) - 1e-3, f"{where}: overlaps the previous slice"
            last_end[track] = ts + float(ev["dur"])
        elif ph in ("i", "I"):
            assert ev.get("s", "t") in ("g", "p", "t"), f"{where}: instant scope"
        elif ph == "C":
            assert all(_number(v) for v in ev.get("args", {}).values()), f"{where}: counter args must be numbers"
    return events


def load_checked(path: Path) -> list[dict[str, Any]]:
    """Parse ``path`` as strict JSON and check it."""
    return check_trace(json.loads(path.read_text()))
