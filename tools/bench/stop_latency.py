"""How fast and how completely an imperative side task is stopped at a bubble's end.

Drives a CPU-bound program through synthetic bubbles with
:class:`freeride.serve.imperative.ImperativeProcess` (resume at bubble start, deadline
timer at its end) and reports, as a markdown table:

* stop latency: bubble deadline -> program observed in state ``T``;
* ran past deadline: the program's own last heartbeat timestamp minus the
  deadline (the program writes ``time.monotonic_ns()`` to shared memory on every
  loop turn, so this is the time it computed after the bubble ended);
* CPU while suspended: its CPU time (``/proc/<pid>/schedstat``) from shortly after
  the deadline to the next resume;
* share of the bubble used: its CPU time between resume and deadline over the
  bubble length.

Run: ``python tools/bench/stop_latency.py --bubbles 1000`` (about 15 ms a bubble).
Pin the driver and the program to different cores (the defaults) to measure the
runtime rather than the scheduler; ``--same-core`` shows the other case.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from freeride.serve.imperative import ImperativeProcess

__all__ = ["main"]

_PROGRAM = """
import mmap, struct, sys, time
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 16)
pack, now, n = struct.Struct("<QQ").pack_into, time.monotonic_ns, 0
while True:
    n += 1
    pack(m, 0, n, now())
"""
_HEARTBEAT = struct.Struct("<QQ")


def _schedstat_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat", "rb") as f:
        return int(f.read().split()[0])


def _pct(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _row(name: str, values_ns: list[int]) -> str:
    us = [v / 1000 for v in values_ns]
    return (
        f"| {name} | {_pct(values_ns, 0.5) / 1000:.1f} | {_pct(values_ns, 0.99) / 1000:.1f} | "
        f"{max(us):.1f} | {statistics.fmean(us):.1f} |"
    )


async def _run(args: argparse.Namespace) -> None:
    bubble_ns, period_ns = int(args.bubble_ms * 1e6), int(args.period_ms * 1e6)
    with tempfile.TemporaryDirectory(prefix="freeride-bench-") as tmp:
        hb_path = Path(tmp) / "heartbeat"
        hb_path.write_bytes(bytes(16))
        with open(hb_path, "r+b") as f:
            hb = mmap.mmap(f.fileno(), 16)
        proc = ImperativeProcess(
            [sys.executable, "-c", _PROGRAM, str(hb_path)],
            env=dict(os.environ),
            log_dir=Path(tmp),
            name="spin",
            cpu_affinity=[args.program_cpu],
            margin_ns=args.margin_us * 1000,
        )
        await proc.start()
        try:
            # warm up: the interpreter starts inside bubbles like any other work
            while _HEARTBEAT.unpack_from(hb)[0] == 0:
                proc.resume(time.monotonic_ns() + bubble_ns)
                await asyncio.sleep(period_ns / 1e9)
            proc.stop_latencies_ns.clear()
            past, suspended_cpu, used = [], [], []
            start = time.monotonic_ns()
            cpu_mid = _schedstat_ns(proc.pid)
            for i in range(args.bubbles):
                t_bubble = start + i * period_ns
                await asyncio.sleep(max(0, t_bubble - time.monotonic_ns()) / 1e9)
                cpu_resume = _schedstat_ns(proc.pid)
                if i:
                    suspended_cpu.append(cpu_resume - cpu_mid)
                deadline = time.monotonic_ns() + bubble_ns
                proc.resume(deadline)
                # look again halfway between the deadline and the next bubble
                await asyncio.sleep((deadline + (period_ns - bubble_ns) // 2 - time.monotonic_ns()) / 1e9)
                cpu_mid = _schedstat_ns(proc.pid)
                used.append(cpu_mid - cpu_resume)
                past.append(max(0, _HEARTBEAT.unpack_from(hb)[1] - deadline))
            stops = list(proc.stop_latencies_ns)
        finally:
            await proc.terminate()
            hb.close()
    print(
        f"{args.bubbles} bubbles of {args.bubble_ms} ms every {args.period_ms} ms; "
        f"driver cpu {sorted(os.sched_getaffinity(0))}, program cpu {args.program_cpu}, "
        f"margin {args.margin_us} us, loop {type(asyncio.get_running_loop()).__module__}, "
        f"stops observed {len(stops)}\n"
    )
    print("| metric (us) | p50 | p99 | max | mean |\n| --- | --- | --- | --- | --- |")
    print(_row("stop latency: deadline -> stopped", stops))
    print(_row("ran past deadline (program heartbeat)", past))
    print(_row("CPU while suspended, per bubble", suspended_cpu))
    share = [u / bubble_ns for u in used]
    print(f"\nshare of bubble used: mean {statistics.fmean(share):.3f}, p1 {sorted(share)[len(share) // 100]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bubbles", type=int, default=1000)
    parser.add_argument("--bubble-ms", type=float, default=5.0)
    parser.add_argument("--period-ms", type=float, default=15.0)
    parser.add_argument("--margin-us", type=int, default=0)
    parser.add_argument("--driver-cpu", type=int, default=0)
    parser.add_argument("--program-cpu", type=int, default=-1, help="default: the last core")
    parser.add_argument("--same-core", action="store_true", help="program on the driver's core")
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--rt", action="store_true", help="run the driver SCHED_FIFO (needs privileges)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.program_cpu < 0:
        args.program_cpu = args.driver_cpu if args.same_core else cores[-1]
    os.sched_setaffinity(0, [args.driver_cpu])
    if args.rt:
        # reset on fork: the program must not inherit a real-time policy
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(10))
    if args.uvloop:
        import uvloop

        uvloop.run(_run(args))
    else:
        asyncio.run(_run(args))


if __name__ == "__main__":
    main()
