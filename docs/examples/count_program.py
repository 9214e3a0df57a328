"""A plain program that knows nothing of FreeRide: run it as an imperative side task.

It "trains" for --steps steps, prints one line per step and keeps its own
progress in its working directory, so that submitted again after a cancel it
goes on from there (FreeRide has no checkpoint of a program).

    freeride submit --imperative --name count --progress-pattern 'step (?P<step>\\d+) loss (?P<loss>[\\d.]+)' \\
        -- python "$PWD/docs/examples/count_program.py" --steps 200
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-s", type=float, default=0.001)
    args = parser.parse_args()
    state = Path("count.state")  # in its working directory (--cwd, or its own)
    first = int(state.read_text()) if state.exists() else 0
    for step in range(first + 1, args.steps + 1):
        end = time.perf_counter() + args.step_s
        while time.perf_counter() < end:  # the work: it runs only while FreeRide lets it
            pass
        print(f"step {step} loss {1 / step:.6f}", flush=True)
        tmp = state.with_suffix(".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, state)  # atomic: a stop or kill never leaves half a number


if __name__ == "__main__":
    main()
