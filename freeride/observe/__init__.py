"""Observability: traces, timelines, Prometheus metrics, status views and cost reports."""

__all__: list[str] = []
