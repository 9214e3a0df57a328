"""Stand-in for NVIDIA's ``nvidia-cuda-mps-control``, for tests on machines without a GPU.

The real program needs an NVIDIA driver and GPU. FreeRide talks to it only
through its command line (``-d``) and one command per invocation on stdin, so
this script imitates exactly that surface:

* ``-d`` daemonizes: a background process writes ``nvidia-cuda-mps-control.pid``
  into ``$CUDA_MPS_PIPE_DIRECTORY`` and a line to ``$CUDA_MPS_LOG_DIRECTORY/control.log``,
  then waits to be told to quit (it gives up by itself after two minutes so a
  failed test cannot leak it);
* without arguments it reads commands from stdin and answers like the driver
  (replies captured from driver 595 in public test suites: PIDs one per line,
  ``0`` for a successful ``terminate_client``, ``1G``-style limits), or fails
  with exit status 1 when no daemon is running on the pipe directory.

Every invocation appends ``{"argv", "stdin", "pipe", "log"}`` as a JSON line to
``<pipe dir>/fake-calls.jsonl`` so tests can check what was sent with which
environment, and the daemon's pid goes to ``<pipe dir>/fake-daemon.pid`` at once
(before it is "ready") so teardown can always kill it. Servers and clients come from ``<pipe dir>/fake-servers.json``
(``{"<server pid>": [client pids]}``), which tests write.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

PID_FILE = "nvidia-cuda-mps-control.pid"


def record(pipe: Path, argv: list[str], stdin: str) -> None:
    entry = {"argv": argv, "stdin": stdin, "pipe": str(pipe), "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY")}
    with open(pipe / "fake-calls.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def daemon_pid(pipe: Path) -> int | None:
    try:
        pid = int((pipe / PID_FILE).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def daemonize(pipe: Path, log: Path) -> int:
    if os.environ.get("FAKE_MPS_FAIL_START"):
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    if os.fork():
        return 0  # like the real -d: return at once, the daemon comes up behind
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    (pipe / "fake-daemon.pid").write_text(str(os.getpid()))  # for test teardown
    signal.signal(signal.SIGTERM, lambda *_: None)  # woken by the quit command
    signal.alarm(120)  # safety net: never outlive a test run
    if os.environ.get("FAKE_MPS_SLOW_START"):
        time.sleep(float(os.environ["FAKE_MPS_SLOW_START"]))
    (pipe / PID_FILE).write_text(str(os.getpid()))
    with open(log / "control.log", "a") as f:
        f.write(f"[fake] control daemon started pid={os.getpid()}\n")
    signal.pause()
    (pipe / PID_FILE).unlink(missing_ok=True)
    with open(log / "control.log", "a") as f:
        f.write("[fake] exiting\n")
    os._exit(0)


def servers(pipe: Path) -> dict[str, list[int]]:
    path = pipe / "fake-servers.json"
    return json.loads(path.read_text()) if path.exists() else {}


def answer(pipe: Path, line: str) -> tuple[str, int]:
    cmd, *args = line.split()
    table = servers(pipe)
    if cmd == "get_server_list":
        return "\n".join(table), 0
    if cmd == "get_client_list":
        if args[0] not in table:
            return f"Server {args[0]} not found", 0
        return "\n".join(str(c) for c in table[args[0]]), 0
    if cmd == "terminate_client":
        clients = table.get(args[0], [])
        if int(args[1]) not in clients:
            return "1", 0
        clients.remove(int(args[1]))
        (pipe / "fake-servers.json").write_text(json.dumps(table))
        return "0", 0
    if cmd == "get_default_device_pinned_mem_limit":
        return "1G", 0
    if cmd == "get_default_active_thread_percentage":
        return "25.0", 0
    if cmd == "quit":
        pid = daemon_pid(pipe)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
        return "", 0
    return f"Unrecognized command {cmd}", 1


def main() -> int:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    log = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    stdin = "" if sys.argv[1:] else sys.stdin.read()
    record(pipe, sys.argv[1:], stdin)
    if sys.argv[1:] == ["-d"]:
        return daemonize(pipe, log)
    if sys.argv[1:]:
        print(f"unsupported arguments {sys.argv[1:]}", file=sys.stderr)
        return 2
    if daemon_pid(pipe) is None:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    status = 0
    for line in stdin.splitlines():
        if line.strip():
            reply, status = answer(pipe, line)
            if reply:
                print(reply)
    return status


if __name__ == "__main__":
    sys.exit(main())
