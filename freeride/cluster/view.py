"""Cluster status and report: the queue's jobs and every node's bubbles, as text or plain data (pure)."""

from __future__ import annotations

from typing import Any, get_args

from freeride.cluster import messages as m
from freeride.units import format_bytes, format_ns, printable

__all__ = ["cluster_report", "format_cluster_status", "format_report", "job_reason"]


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def _counts(status: m.QueueStatus) -> dict[str, int]:
    counts: dict[str, int] = {state: 0 for state in m.JOB_STATES}
    for job in status.jobs:
        counts[job.state] += 1
    return counts


def job_reason(job: m.JobRecord, now: float) -> str:
    """Why a job is where it is: what a queued one waits for, how its last attempt ended, its lease."""
    last = job.history[-1] if job.history else None
    ended = (
        f"attempt {last.attempt} {last.outcome} on {last.node}" + (f": {last.detail}" if last.detail else "")
        if last
        else ""
    )
    match job.state:
        case "queued":
            needs = []
            if job.spec.device_kind == "gpu":
                needs.append("a GPU")
            if job.spec.peak_memory > 0:
                needs.append(f"{format_bytes(job.spec.peak_memory)} spare")
            waiting = "waiting for a node that offers room" + (f" with {' and '.join(needs)}" if needs else "")
            return f"{waiting}; {ended}" if ended else waiting
        case "leased":
            lease = f"lease held, renewed by {job.node}; expires in {max(0.0, job.lease_deadline - now):.0f}s"
            return lease + ("; cancel requested, stopping" if job.cancel_requested else "")
        case "failed":
            return job.error or ended
        case "cancelled":
            return (
                ended if last is not None and last.outcome in ("cancelled", "expired") else "cancelled before a lease"
            )
        case _:
            return ""


def format_cluster_status(status: m.QueueStatus, *, jobs: bool = True) -> str:
    """Jobs by state, every node that leased (with its manager's bubbles), then each job."""
    counts = _counts(status)
    lines = [
        f"jobs: {len(status.jobs)} (" + ", ".join(f"{k} {v}" for k, v in counts.items()) + ");"
        f" leases expired: {status.expired}",
        "",
        f"{'node':16} {'seen':>8} {'leases':>6} {'devices':>8} {'bubble time':>12} {'used':>7} {'interference':>13}",
    ]
    for node in sorted(status.nodes, key=lambda n: n.node):
        s = node.summary
        lines.append(
            f"{printable(node.node)[:16]:16} {status.now - node.last_seen:>7.1f}s {node.leases:>6}"
            f" {s.alive_devices:>3}/{s.devices:<4} {format_ns(s.bubble_ns):>12} {_share(s.used_ns, s.bubble_ns):>7}"
            f" {_share(s.interference_ns, s.train_ns):>13}"
        )
    if jobs:
        lines += [
            "",
            f"{'job':>5} {'name':24} {'state':9} {'attempt':>7} {'failed':>6} {'node':16} {'steps':>8}"
            f" {'checkpoint':>10}  why",
        ]
        for job in sorted(status.jobs, key=lambda j: j.job_id):
            ckpt = str(job.checkpointed_steps) if job.checkpointed_steps >= 0 else "-"
            where = printable(job.node)[:16] if job.state != "queued" else ""  # a queued job's last node is history
            failed = f"{job.failures}/{job.max_attempts}"
            lines.append(
                f"{job.job_id:>5} {printable(job.spec.name)[:24]:24} {job.state:9} {job.attempt:>7} {failed:>6}"
                f" {where or '-':16} {job.steps:>8} {ckpt:>10}  {printable(job_reason(job, status.now))}".rstrip()
            )
    lines += [
        "",
        "seen: since the node last renewed its leases; used: side-task compute inside bubbles, as a share of bubble"
        " time; interference: side-task compute past bubble ends, as a share of training time (each node's manager,"
        " since it started)",
    ]
    return "\n".join(lines)


def cluster_report(status: m.QueueStatus) -> dict[str, Any]:
    """Every node's bubbles and the queue's accounting, summed over the cluster (plain data, JSON-ready)."""
    nodes: dict[str, Any] = {}
    totals = {"bubble_ns": 0, "used_ns": 0, "train_ns": 0, "interference_ns": 0}
    for node in sorted(status.nodes, key=lambda n: n.node):
        s = node.summary
        row = {
            "bubble_ns": s.bubble_ns,
            "used_ns": s.used_ns,
            "train_ns": s.train_ns,
            "interference_ns": s.interference_ns,
        }
        nodes[node.node] = {**row, "devices": s.devices, "alive_devices": s.alive_devices}
        for key, value in row.items():
            totals[key] += value
    outcomes = {outcome: 0 for outcome in get_args(m.Outcome)}
    attempts_by_node: dict[str, int] = {}
    for job in status.jobs:
        for attempt in job.history:
            outcomes[attempt.outcome] += 1
            attempts_by_node[attempt.node] = attempts_by_node.get(attempt.node, 0) + 1
    for name, count in attempts_by_node.items():
        nodes.setdefault(name, {})["attempts"] = count
    return {
        "nodes": nodes,
        "total": {
            **totals,
            "harvested_share": totals["used_ns"] / totals["bubble_ns"] if totals["bubble_ns"] else 0.0,
            "interference_share": totals["interference_ns"] / totals["train_ns"] if totals["train_ns"] else 0.0,
        },
        "jobs": _counts(status),
        "attempts": outcomes,
        "steps_of_finished_jobs": sum(j.steps for j in status.jobs if j.state == "finished"),
    }


def format_report(report: dict[str, Any]) -> str:
    total = report["total"]
    lines = [
        f"{'node':16} {'bubble time':>12} {'harvested':>10} {'training':>12} {'interference':>13} {'attempts':>8}",
    ]
    for name, row in report["nodes"].items():
        lines.append(
            f"{printable(name)[:16]:16} {format_ns(row.get('bubble_ns', 0)):>12}"
            f" {_share(row.get('used_ns', 0), row.get('bubble_ns', 0)):>10} {format_ns(row.get('train_ns', 0)):>12}"
            f" {_share(row.get('interference_ns', 0), row.get('train_ns', 0)):>13} {row.get('attempts', 0):>8}"
        )
    lines.append(
        f"{'cluster':16} {format_ns(total['bubble_ns']):>12} {total['harvested_share']:>10.1%}"
        f" {format_ns(total['train_ns']):>12} {total['interference_share']:>13.2%}"
    )
    jobs, attempts = report["jobs"], report["attempts"]
    lines += [
        "",
        "jobs: " + ", ".join(f"{k} {v}" for k, v in jobs.items()),
        "attempts: " + ", ".join(f"{k} {v}" for k, v in attempts.items()),
        f"steps of finished jobs: {report['steps_of_finished_jobs']}",
    ]
    return "\n".join(lines)
