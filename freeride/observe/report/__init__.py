"""``freeride report``: what a traced run's bubbles held, what it cost, what it saved.

Reads a trace written by :class:`~freeride.observe.trace.TraceWriter` (``freeride serve
--trace``) and, optionally, the trace of a baseline run of the same job without
side tasks. Per stage it reports the bubble share (announced bubble time inside
training steps over step time) and the harvested share (side-task busy time
inside those bubbles over bubble time); for the job, the training slowdown
(median step time against the baseline's) and the cost saving by FreeRide's
formula::

    saving = (sum_i W_i / R_i / k - (T_fr - T_van)) / T_van

with W_i the work (steps) task i did, R_i its throughput (steps/s) alone on the
cheap GPU, k the price of the training GPUs over the price of one cheap GPU,
and T_fr / T_van the training time with FreeRide and without (the baseline's
median step time times the steps run). The first ``warmup_steps`` steps
(start-up: ranks waiting for each other) are left out of every number.

The package re-exports, by concern: :mod:`~freeride.observe.report.saving` (the
formula and its prices), :mod:`~freeride.observe.report.options` (what the report
is asked for), :mod:`~freeride.observe.report.records` (the report and its
table), :mod:`~freeride.observe.report.build` (from traces to the report) and,
beneath them, :mod:`~freeride.observe.report.spans` (interval arithmetic).
"""

from freeride.observe.report.build import build_report
from freeride.observe.report.options import ReportOptions, parse_throughputs
from freeride.observe.report.records import Report, StageReport, TaskReport
from freeride.observe.report.saving import Prices, cost_saving, price_ratio

__all__ = [
    "Prices",
    "Report",
    "ReportOptions",
    "StageReport",
    "TaskReport",
    "build_report",
    "cost_saving",
    "parse_throughputs",
    "price_ratio",
]
