"""The bubble gate on a real GPU: how soon side work starts after the device reaches a bubble, and what it costs.

A training stream computes, opens the gate (:mod:`freeride.gpu.bubblegate`)
where it reaches a wait, waits for a "receive" (a spin kernel on a second
stream, of a random length per bubble, that starts when the stage reaches the
wait, as a neighbour's send would), closes the gate and runs a small first
kernel. Side work is short pieces (a matmul each), queued ahead on a
lowest-priority stream, each behind a wait on the gate.

Measured per bubble, on the device's timeline:

* **start lag**: from the gate's opening to the first side piece past its wait;
* **trainer delay**: from the receive's end to the end of the training stream's
  first kernel after it, with side work minus without (the same bubbles run
  both ways, alternating blocks of bubbles);
* **bubble use**: side-piece time inside bubbles over bubble time; **overrun**:
  side-piece time outside bubbles over bubble time.

``--side process`` runs the side work in a second process (under MPS when
``CUDA_MPS_PIPE_DIRECTORY`` is set for it; ``--side-env`` sets variables in
that process only, so that the trainer stays outside MPS while the side
process is an MPS client with, say, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25``):
its event times are put on the host's monotonic clock by a calibration pair in
each process, and the error bound of the two pairs is printed. ``--side
stream`` keeps it in the trainer's process (one context: exact); ``--side
green`` too, on the stream of a green context holding ``--sm-percent`` of the
device's SMs (``torch.cuda.green_contexts``, where the torch in use has them).
Prints one JSON object.

    python tools/gpu/gate_bench.py --side stream --bubbles 400
    python tools/gpu/gate_bench.py --side green --sm-percent 25
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from freeride.backends.device_clock import Calibration, calibrate, torch_device_api  # noqa: E402
from freeride.gpu.bubblegate import BubbleGate, GateWord, cuda_stream_ops  # noqa: E402

__all__ = ["main"]

_LOOKAHEAD = 64
"""Side pieces queued and not yet done, at most (more than a bubble holds: the host never starves the device)."""


def _q(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p * (len(ordered) - 1)))]


def _host_clock(torch: Any) -> Calibration:
    """Device event times on the host's monotonic clock (as the device timeline calibrates; nine tries)."""
    return calibrate(torch_device_api(), torch.cuda.Stream(), tries=9)


class _Side:
    """Side pieces queued ahead on a low-priority stream, each behind the gate; their device intervals."""

    def __init__(self, torch: Any, gate: BubbleGate, size: int, per_piece: int, stream: Any = None) -> None:
        self._torch = torch
        self._gate = gate
        least = torch.cuda.Stream.priority_range()[0]
        self.stream = torch.cuda.Stream(priority=least) if stream is None else stream
        self._a = torch.randn(size, size, device="cuda")
        self._per_piece = per_piece
        self.pieces: list[tuple[Any, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="side-pieces", daemon=True)

    def start(self) -> None:
        self.queue_ahead()
        self._thread.start()

    def queue_ahead(self, n: int = _LOOKAHEAD) -> None:
        torch = self._torch
        with torch.cuda.stream(self.stream):
            for _ in range(n):
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True, blocking=True)
                self._gate.wait_on(self.stream)
                begin.record(self.stream)
                x = self._a
                for _ in range(self._per_piece):
                    x = x @ self._a
                end.record(self.stream)
                self.pieces.append((begin, end))

    def _run(self) -> None:
        done = 0
        while not self._stop.is_set():
            self.pieces[done][1].synchronize()
            done += 1
            if not self._stop.is_set():
                self.queue_ahead(1)

    def stop(self) -> None:
        """Stop queueing; the caller releases the gate so that what waits drains."""
        self._stop.set()
        self._thread.join(30)
        self.stream.synchronize()


def _trainer(torch: Any, gate: BubbleGate, ns: argparse.Namespace, with_side: list[bool]) -> dict[str, Any]:
    """Run the bubbles; per bubble the (open, receive end, first kernel end) events and whether side work ran."""
    compute = torch.cuda.current_stream()
    recv = torch.cuda.Stream()
    w = torch.randn(ns.train_size, ns.train_size, device="cuda") / ns.train_size**0.5
    out = torch.empty_like(w)
    small = torch.zeros(1 << 16, device="cuda")
    # cycles of the spin kernel per ms, from one timed spin
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record(compute)
    torch.cuda._sleep(10_000_000)
    t1.record(compute)
    t1.synchronize()
    cycles_per_ms = 10_000_000 / max(1e-3, t0.elapsed_time(t1))
    rng = random.Random(ns.seed)
    bubbles: list[tuple[Any, Any, Any, bool]] = []
    for i in range(len(with_side)):
        for _ in range(ns.train_kernels):
            torch.matmul(w, w, out=out)  # forward-like work
        opened = torch.cuda.Event(enable_timing=True)
        if with_side[i]:
            gate.open_on(compute)
        opened.record(compute)
        recv.wait_event(opened)
        with torch.cuda.stream(recv):
            torch.cuda._sleep(int(rng.uniform(ns.bubble_ms[0], ns.bubble_ms[1]) * cycles_per_ms))
        received = torch.cuda.Event(enable_timing=True)
        received.record(recv)
        compute.wait_event(received)
        if with_side[i]:
            gate.close_on(compute)
        small.add_(1)  # the first kernel after the bubble
        resumed = torch.cuda.Event(enable_timing=True)
        resumed.record(compute)
        bubbles.append((opened, received, resumed, with_side[i]))
    # these streams only, not the device's: side pieces wait behind the closed gate until the caller releases it
    compute.synchronize()
    recv.synchronize()
    return {"bubbles": bubbles, "cycles_per_ms": cycles_per_ms}


def _plan(ns: argparse.Namespace) -> list[bool]:
    """Blocks of bubbles with the gate opened (side work) and without, alternating: ``bubbles`` of each."""
    out: list[bool] = []
    left = {False: ns.bubbles, True: ns.bubbles}
    side = False
    while left[False] or left[True]:
        n = min(20, left[side])
        out += [side] * n
        left[side] -= n
        side = not side
    return out


def _summarise(
    intervals: list[tuple[int, int, int, bool]], pieces: list[tuple[int, int]], error_ns: int
) -> dict[str, Any]:
    """Figures from (open, receive end, first kernel end, side) per bubble and (begin, end) per piece, in ns."""
    lag: list[float] = []
    delay_side: list[float] = []
    delay_alone: list[float] = []
    use = outside = bubble_total = 0
    ordered = sorted(pieces)
    j = 0
    for opened, received, resumed, side in intervals:
        (delay_side if side else delay_alone).append((resumed - received) / 1e3)
        if not side:
            continue
        bubble_total += received - opened
        while j < len(ordered) and ordered[j][0] < opened:
            j += 1
        if j < len(ordered) and ordered[j][0] < received:
            lag.append((ordered[j][0] - opened) / 1e3)
    gated = [(o, r) for o, r, _, s in intervals if s]
    until = intervals[-1][2] if intervals else 0  # then the gate is released: what drains is not counted
    for begin, end in ordered:
        if begin > until:
            break
        inside = sum(max(0, min(end, r) - max(begin, o)) for o, r in gated if o < end and begin < r)
        use += inside
        outside += (end - begin) - inside
    return {
        "bubbles_gated": len(gated),
        "pieces": len(pieces),
        "start_lag_us": {"p50": _q(lag, 0.5), "p99": _q(lag, 0.99), "n": len(lag)},
        "bubble_use": use / bubble_total if bubble_total else float("nan"),
        "overrun_of_bubble_time": outside / bubble_total if bubble_total else float("nan"),
        "first_kernel_us": {
            "alone_p50": _q(delay_alone, 0.5),
            "alone_p99": _q(delay_alone, 0.99),
            "side_p50": _q(delay_side, 0.5),
            "side_p99": _q(delay_side, 0.99),
            "delay_p50": _q(delay_side, 0.5) - _q(delay_alone, 0.5),
            "delay_p99": _q(delay_side, 0.99) - _q(delay_alone, 0.99),
        },
        "clock_error_us": error_ns / 1e3,
    }


def _green_stream(torch: Any, percent: int) -> tuple[Any, int]:
    """A stream of a new green context holding ``percent`` of the device's SMs, and how many SMs that is."""
    from torch.cuda import green_contexts

    if not green_contexts.SUPPORTED:
        raise RuntimeError(f"torch {torch.__version__} was built without green contexts")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    count = max(1, round(sms * percent / 100))
    context: Any = green_contexts.GreenContext.create(num_sms=count, device_id=0)
    return context.Stream(), count


def _side_env(pairs: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"gate_bench: --side-env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _child(ns: argparse.Namespace) -> int:
    """The side process: pieces behind the gate until stdin closes, then their times on the host clock."""
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    gate = BubbleGate(GateWord.attach(Path(ns.gate)), cuda_stream_ops())
    side = _Side(torch, gate, ns.piece_size, ns.piece_matmuls)
    clock = _host_clock(torch)
    side.start()
    print("ready", flush=True)
    sys.stdin.read()  # the trainer is done and has released the gate, or is gone
    gate.release()  # as a manager does for a rank that left: what waits drains
    side.stop()
    times = [(clock.host_time(b), clock.host_time(e)) for b, e in side.pieces]
    print(json.dumps({"pieces": times, "error_ns": clock.error_ns}), flush=True)
    gate.close()
    return 0


def run(ns: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    ops = cuda_stream_ops()
    with tempfile.TemporaryDirectory(prefix="frgate-") as tmp:
        path = Path(tmp) / "gate"
        word = GateWord.create(path)
        gate = BubbleGate(word, ops)
        clock = _host_clock(torch)
        child: subprocess.Popen[str] | None = None
        side: _Side | None = None
        side_env: dict[str, str] = ns.side_environ
        green_sms = 0
        if ns.side == "process":
            cmd = [sys.executable, __file__, "--child", "--gate", str(path)]
            cmd += ["--piece-size", str(ns.piece_size), "--piece-matmuls", str(ns.piece_matmuls)]
            child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=side_env)
            assert child.stdout is not None and child.stdin is not None
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError(f"side process failed to start (exit {child.wait(30)})")
        else:
            stream = None
            if ns.side == "green":
                stream, green_sms = _green_stream(torch, ns.sm_percent)
            side = _Side(torch, gate, ns.piece_size, ns.piece_matmuls, stream)
            side.start()
        t0 = time.monotonic()
        result = _trainer(torch, gate, ns, _plan(ns))
        wall_s = time.monotonic() - t0
        gate.release()  # what still waits drains
        if side is not None:
            side.stop()
            pieces = [(clock.host_time(b), clock.host_time(e)) for b, e in side.pieces]
            error_ns = 0  # one context: elapsed_time between events is exact, the offset cancels
        else:
            assert child is not None and child.stdin is not None and child.stdout is not None
            child.stdin.close()
            reply = json.loads(child.stdout.readline())
            child.wait(60)
            pieces = [(int(b), int(e)) for b, e in reply["pieces"]]
            error_ns = clock.error_ns + int(reply["error_ns"])
        bubbles = [(clock.host_time(o), clock.host_time(r), clock.host_time(f), s) for o, r, f, s in result["bubbles"]]
        gate.close()
    out = _summarise(bubbles, pieces, error_ns)
    out.update(
        side=ns.side,
        mps=bool(side_env.get("CUDA_MPS_PIPE_DIRECTORY")) and ns.side == "process",
        trainer_mps=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        side_sm_percent=int(side_env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"))
        if ns.side == "process"
        else (ns.sm_percent if ns.side == "green" else 100),
        green_sms=green_sms,
        bubble_ms=list(ns.bubble_ms),
        wall_s=round(wall_s, 2),
        piece_us=statistics.median((e - b) / 1e3 for b, e in pieces) if pieces else float("nan"),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("stream", "green", "process"), default="stream")
    ap.add_argument("--sm-percent", type=int, default=50, help="green: the share of the SMs its context holds")
    ap.add_argument(
        "--side-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="process: set in the side process only (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)",
    )
    ap.add_argument("--bubbles", type=int, default=400, help="bubbles with side work (as many without)")
    ap.add_argument("--bubble-ms", type=float, nargs=2, default=(0.5, 3.0), help="receive length range (ms)")
    ap.add_argument("--train-size", type=int, default=2048)
    ap.add_argument("--train-kernels", type=int, default=4, help="matmuls of training work between bubbles")
    ap.add_argument("--piece-size", type=int, default=1024)
    ap.add_argument("--piece-matmuls", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gate", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if not 1 <= ns.sm_percent <= 100:
        ap.error(f"--sm-percent must be in 1..100, got {ns.sm_percent}")
    ns.side_environ = _side_env(ns.side_env)  # parsed before CUDA starts: a malformed pair says so at once
    if ns.child:
        return _child(ns)
    print(json.dumps(run(ns)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
