"""GPU work a stopped PyTorch side task leaves running, per ``sync_every`` K. CUDA only.

A PyTorch training loop runs as an imperative side task
(:class:`freeride.serve.imperative.ImperativeProcess`, ``sync_every=K``). After every
step it queues, on its own stream, a device-side increment of a step counter and
an asynchronous copy of that counter into shared host memory registered with
``cudaHostRegister``. That copy is done by the GPU's copy engine, so the counter
keeps moving after ``SIGSTOP`` for exactly as long as queued work remains. The
driver resumes the task for a while, stops it, and watches the counter:

* tail: stop call -> last change of the counter;
* queued steps: how many steps completed after the stop.

Expect tail ~ K x step time (plus the kernel running at the stop) with K > 0 and
up to the launch-queue depth without it (K = 0). Run on a machine with a GPU::

    python tools/bench/gpu_tail.py --ks 0 1 2 4 --width 4096 --depth 8
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
import mmap, sys, torch
path, width, depth, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
f = open(path, "r+b")
shared = mmap.mmap(f.fileno(), 4096)
host = torch.frombuffer(shared, dtype=torch.int64, count=1)
err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), 4096, 0)
if int(err) != 0:
    sys.exit(f"cudaHostRegister of {path} failed: CUDA error {int(err)}")
step = torch.zeros(1, dtype=torch.int64, device="cuda")
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(batch, width, device="cuda")
while True:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    step += 1
    host.copy_(step, non_blocking=True)
"""
_COUNTER = struct.Struct("<q")


def _read(shared: mmap.mmap) -> int:
    return int(_COUNTER.unpack_from(shared)[0])


async def _measure(args: argparse.Namespace, k: int, tmp: Path) -> dict[str, float]:
    path = tmp / f"counter-{k}"
    path.write_bytes(bytes(4096))
    with open(path, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 4096)
    proc = ImperativeProcess(
        [sys.executable, "-c", _PROGRAM, str(path), str(args.width), str(args.depth), str(args.batch)],
        env=dict(os.environ),
        log_dir=tmp,
        name=f"tail-k{k}",
        sync_every=k,
    )
    await proc.start()
    tails, queued, step_ms = [], [], []
    try:
        proc.resume(time.monotonic_ns() + 600 * 10**9)
        warm_until = time.monotonic() + args.warmup_s
        while _read(shared) < 20:  # start-up and warm-up
            if proc.exited or time.monotonic() > warm_until:
                err = (tmp / f"tail-k{k}.err").read_text(errors="replace")[-2000:]
                what = "exited" if proc.exited else f"made {_read(shared)} steps in {args.warmup_s:.0f} s"
                raise RuntimeError(f"K={k}: the program {what} before its warm-up ended; its stderr:\n{err}")
            await asyncio.sleep(0.01)
        for _ in range(args.reps):
            proc.resume(time.monotonic_ns() + 600 * 10**9)
            n0, t0 = _read(shared), time.monotonic()
            await asyncio.sleep(args.run_s)
            n1 = _read(shared)
            step_s = (time.monotonic() - t0) / max(1, n1 - n0)
            proc.suspend()
            t_stop = time.monotonic()
            at_stop = last = _read(shared)
            t_last = t_stop
            quiet_s = max(0.2, 50 * step_s)
            while time.monotonic() - t_last < quiet_s:
                now = _read(shared)
                if now != last:
                    last, t_last = now, time.monotonic()
                time.sleep(20e-6)  # busy-ish poll; the task is stopped, the loop has nothing else to do
            tails.append((t_last - t_stop) * 1e3)
            queued.append(last - at_stop)
            step_ms.append(step_s * 1e3)
    finally:
        info = await proc.terminate()
        shared.close()
    if not tails:
        raise RuntimeError(f"K={k}: no measurement; program ended with {info} (see {tmp})")
    return {
        "step_ms": statistics.median(step_ms),
        "tail_p50": statistics.median(tails),
        "tail_max": max(tails),
        "queued_p50": statistics.median(queued),
        "queued_max": max(queued),
    }


async def _run(args: argparse.Namespace) -> None:
    # the counter lives in shared memory (tmpfs): CUDA cannot pin pages of a file on disk
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="freeride-gputail-", dir=shm) as tmp:
        rows = [(k, await _measure(args, k, Path(tmp))) for k in args.ks]
    print(f"width {args.width}, depth {args.depth}, batch {args.batch}, {args.reps} stops per K\n")
    print("| K (sync every) | step ms | tail p50 ms | tail max ms | queued steps p50 | queued steps max |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, r in rows:
        print(
            f"| {k or 'off'} | {r['step_ms']:.2f} | {r['tail_p50']:.2f} | {r['tail_max']:.2f} | "
            f"{r['queued_p50']:.0f} | {r['queued_max']:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 16])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--run-s", type=float, default=0.3)
    parser.add_argument("--warmup-s", type=float, default=120.0, help="give up if 20 steps take longer")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_tail.py needs a CUDA device; it measures GPU work that outlives SIGSTOP")
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
