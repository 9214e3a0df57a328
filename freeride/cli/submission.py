"""``freeride submit``'s side of a submission: check the task before sending it, and watch it start.

A task's options are checked against its ``__init__`` here, where the class
can be imported (the manager checks them again from source), and a task whose
setup fails shows its error and traceback in the submit output, not only in
the manager's log.
"""

from __future__ import annotations

import os
import time

import msgspec

from freeride import protocol as p
from freeride.tasks.declared import OptionError, declared, validate_options
from freeride.transport import ControlClient
from freeride.units import format_ns, printable

__all__ = ["absolute_paths", "await_start", "check_submission", "report_start", "task_details"]

_POLL_S = 0.05
_PATH_WORDS = ("dir", "path", "file", "root", "out", "output", "input", "log")
"""An option named so (or ending ``_dir``, ``_path``, ...) names a file or directory."""


def absolute_paths(options: p.Options, cwd: str) -> p.Options:
    """``options`` with every relative path made absolute against ``cwd``, where the submitter stands.

    The task runs elsewhere (in its worker's own directory, or on another
    node), where a relative path would name another place or none.
    """

    def is_path(key: str) -> bool:
        return key in _PATH_WORDS or key.rpartition("_")[2] in _PATH_WORDS

    return {
        key: os.path.normpath(os.path.join(cwd, value))
        if is_path(key) and isinstance(value, str) and value and not os.path.isabs(value) and "://" not in value
        else value
        for key, value in options.items()
    }


def check_submission(spec: p.IterativeSpec) -> p.IterativeSpec:
    """``spec`` with options converted to the declared types and the class's declarations filled in.

    A task that cannot be imported here (installed only where the manager
    runs) passes unchecked: the manager checks it.

    Raises:
        SystemExit: options that do not match the class, or a target that is no task.
    """
    from freeride.tasks.targets import load

    spec = msgspec.structs.replace(spec, options=absolute_paths(spec.options, os.getcwd()))
    try:
        cls = load(spec.target)
    except ImportError:
        return spec
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"freeride: {exc}") from None
    decl = declared(cls)
    try:
        options = validate_options(decl, spec.options)
    except OptionError as exc:
        raise SystemExit(f"freeride: {exc}") from None
    return msgspec.structs.replace(
        spec,
        options=options,
        peak_memory=decl.peak_memory if spec.peak_memory < 0 else spec.peak_memory,
        device_kind="gpu" if decl.device_kind == "gpu" else spec.device_kind,
    )


def await_start(client: ControlClient, task_id: int, wait_s: float) -> p.TaskStatus | None:
    """Poll status while the task starts (not while it waits for a device), for at most ``wait_s``.

    Returns:
        Its last status (None if never seen).
    """
    deadline = time.monotonic() + wait_s
    last: p.TaskStatus | None = None
    while wait_s > 0:
        reply = client.request(p.StatusRequest())
        if isinstance(reply, p.StatusReply):
            last = next((t for t in reply.tasks if t.task_id == task_id), last)
        if last is not None and last.state != "starting":
            return last
        if time.monotonic() >= deadline:
            return last
        time.sleep(_POLL_S)  # a user-facing wait, bounded by --wait
    return last


def report_start(status: p.TaskStatus | None) -> int:
    """Print how the task started; the exit code of ``freeride submit`` (1 if it already failed)."""
    if status is None:
        return 0
    if status.state == "failed":
        print(f"task {status.task_id} failed: {printable(status.error)}")
        if status.traceback:
            print(status.traceback)
        return 1
    if status.state == "pending" and status.pending_reason:
        print(f"task {status.task_id} pending: {printable(status.pending_reason)}")
    elif status.state == "running":
        print(f"task {status.task_id} is running")
    return 0


def task_details(t: p.TaskStatus) -> list[str]:
    """Status lines on what a task declared and how it fits: estimates, bubbles missed, why it waits."""
    lines = []
    if t.pending_reason:
        lines.append(f"pending: {printable(t.pending_reason)}")
    if t.waiting:
        lines.append("waiting for its own input (gives bubbles back)")
    if t.estimates:
        shown = ", ".join(
            f"{printable(kind) or 'step'} {format_ns(ns) if ns >= 0 else '?'}"
            for kind, ns in sorted(t.estimates.items())
        )
        lines.append(f"step estimates: {shown}")
    if t.no_fit:
        lines.append(f"kept out of {t.no_fit} bubbles: {printable(t.no_fit_reason)}")
    if t.state == "failed" and t.traceback:
        lines += [printable(line) for line in t.traceback.splitlines()]
    return lines
