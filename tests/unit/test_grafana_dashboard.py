"""docs/grafana/freeride.json: every PromQL query in it names only metrics the manager exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from test_fleet_metrics import _device, exported, status

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "freeride.json"

_FUNCTIONS = {
    # PromQL functions and aggregations, and Grafana's label_values()
    "sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "rate", "irate", "increase", "delta",
    "histogram_quantile", "clamp_min", "clamp_max", "label_replace", "label_values", "abs", "time",
}  # fmt: skip
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}


def _queries(node: Any) -> list[str]:
    """Every PromQL text in the dashboard: panel targets and template variable queries."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            else:
                found.extend(_queries(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_queries(value))
    return found


def metric_names(query: str) -> set[str]:
    """The metric names a PromQL query selects (without a parser: what is left once the rest is taken out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", query)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\$\w+", "", text)  # Grafana variables
    text = re.sub(r"label_values\(([^,)]*),[^)]*\)", r"\1", text)  # Grafana's label_values(metric, label)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {w for w in words if w not in _FUNCTIONS and w not in _KEYWORDS and not re.fullmatch(r"\d+\w*", w)}


def _exported_names() -> set[str]:
    """Every sample name a manager with a GPU and a CPU device, tasks and a measured job exports."""
    return {s.name for f in exported(status(_device("cuda:0"), _device("cpu:1", stage=1))) for s in f.samples}


def test_the_query_parser_finds_the_metrics() -> None:
    query = 'sum by (le, hostname) (rate(freeride_x_bucket{hostname=~"$h"}[$__rate_interval])) / on(a) freeride_y > 0'
    assert metric_names(query) == {"freeride_x_bucket", "freeride_y"}
    assert metric_names("label_values(freeride_z_total, hostname)") == {"freeride_z_total"}


def test_every_query_names_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 10
    exported = _exported_names()
    unknown = {q: sorted(metric_names(q) - exported) for q in queries if metric_names(q) - exported}
    assert unknown == {}
    assert all(metric_names(q) for q in queries), "a query that names no metric"


def test_the_dashboard_shows_what_an_operator_asks_first() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = set().union(*(metric_names(q) for q in _queries(dashboard)))
    assert {
        "freeride_bubble_used_seconds_total",  # bubble time used
        "freeride_training_cost_ratio",  # the job's measured cost
        "freeride_interference_seconds_total",  # interference
        "freeride_side_task_steps_total",  # per-task progress
    } <= used
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p["targets"])
