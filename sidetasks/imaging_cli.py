"""Edge-detect a set of images: a plain program, with no FreeRide API in it.

This is the sample *imperative* side task: FreeRide runs it unmodified and
suspends it with SIGSTOP between bubbles. Each image is equalised, blurred and
Sobel-filtered (see :mod:`freeride.sidetasks._imageops`) and its edge map
written as ``.pgm`` under ``--out``. Every output file appears atomically and
``progress.json`` is rewritten atomically after each image, so the program can
be stopped or killed at any point and simply started again with the same
arguments: it skips the images whose outputs already exist.

Usage::

    python -m freeride.sidetasks.imaging_cli --out DIR --images 1000 [--size 256] [--sigma 1.5] [--seed 0]
    python -m freeride.sidetasks.imaging_cli --out DIR --input PHOTOS   # .pgm/.ppm/.npy (PNG/JPEG with Pillow)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from freeride.sidetasks._imageio import IMAGE_SUFFIXES, read_image, write_pnm
from freeride.sidetasks._imageops import edge_pipeline, synthetic_scene

__all__ = ["PROGRESS_FILE", "main", "parse_args"]

PROGRESS_FILE = "progress.json"
"""Name of the progress file written under ``--out``."""

_DESCRIPTION = "Edge-detect images (equalise, blur, Sobel); resumable: rerun with the same arguments."


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(prog="python -m freeride.sidetasks.imaging_cli", description=_DESCRIPTION)
    p.add_argument("--out", type=Path, required=True, help="output folder (created; reused to resume)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", type=int, help="process this many synthetic images")
    src.add_argument("--input", type=Path, help="process every readable image under this folder")
    p.add_argument("--size", type=int, default=256, help="side of the synthetic images in pixels (default 256)")
    p.add_argument("--sigma", type=float, default=1.5, help="blur width in pixels (default 1.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic images (default 0)")
    args = p.parse_args(argv)
    if args.images is not None and args.images < 0:
        p.error(f"--images must be >= 0, got {args.images}")
    if args.size < 4:
        p.error(f"--size must be >= 4, got {args.size}")
    if not args.sigma > 0:
        p.error(f"--sigma must be > 0, got {args.sigma}")
    if args.input is not None and not args.input.is_dir():
        p.error(f"--input {args.input} is not a directory")
    return args


def _work_list(args: argparse.Namespace) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """(output name, loader) for each image, in a fixed order."""
    if args.input is None:
        size: int = args.size
        seed: int = args.seed
        return [(f"edges_{i:08d}.pgm", partial(synthetic_scene, i, size, seed=seed)) for i in range(args.images)]
    root: Path = args.input
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
    return [(f.relative_to(root).as_posix().replace("/", "__") + ".edges.pgm", partial(read_image, f)) for f in files]


def _write_progress(out: Path, done: int, total: int, last: str) -> None:
    tmp = out / f".{PROGRESS_FILE}.tmp"
    tmp.write_text(json.dumps({"done": done, "total": total, "last": last}) + "\n", encoding="utf-8")
    os.replace(tmp, out / PROGRESS_FILE)


def main(argv: Sequence[str] | None = None) -> int:
    """Process the images not yet done; return the exit status."""
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = _work_list(args)
    done = sum(1 for name, _ in work if (out / name).exists())
    skipped, t0 = done, time.perf_counter()
    _write_progress(out, done, len(work), "")
    for name, load in work:
        target = out / name
        if target.exists():
            continue
        image = load()
        _, _, edges = edge_pipeline(image.unsqueeze(0), args.sigma)
        write_pnm(target, edges[0, 0])
        done += 1
        _write_progress(out, done, len(work), name)
    elapsed = time.perf_counter() - t0
    print(f"imaging: {done - skipped} processed, {skipped} already done, {len(work)} total in {elapsed:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
