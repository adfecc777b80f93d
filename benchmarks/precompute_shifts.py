"""Make the Fashion-MNIST shifted sets of ``benchmarks/quality.py`` once, in parallel, into its cache.

    python benchmarks/precompute_shifts.py --data-dir data --cache-dir /tmp/qcache --shift-examples 2000 --workers 16
    python benchmarks/precompute_shifts.py --split val --shift-examples 1000 --corruptions gaussian_noise,fog

``quality.py`` (and ``rank1_defaults.py``, on the validation split) corrupt the images they need
one (corruption, severity) after another on one core, and save them under a name that hashes the
clean images. On a many-core machine that runs several benchmark processes side by side (a GPU
machine), this fills the same cache file first, one (corruption, severity) per worker, so no
process corrupts anything and none writes the file while another reads it.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bayesify.evaluation.corruptions import CORRUPTIONS, SEVERITIES, corrupt_images
from benchmarks._quality_tasks import Scale, build_task, validation_view
from benchmarks.quality import DEFAULT_CACHE, DEFAULT_DATA


def _one(job: tuple[Tensor, str, int]) -> tuple[str, Tensor]:
    torch.set_num_threads(1)
    x, name, severity = job
    return f"{name}/{severity}", corrupt_images(x, name, severity)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="fashion-mnist")
    parser.add_argument("--split", choices=["test", "val"], default="test", help="val: rank1_defaults.py's sets")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--corruptions", help="comma-separated (default: all 15)")
    parser.add_argument("--shift-examples", type=int)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    corruptions = CORRUPTIONS if args.corruptions is None else tuple(c for c in args.corruptions.split(",") if c)
    task = build_task(args.task, Scale(data_dir=args.data_dir, shift_examples=args.shift_examples))
    if args.split == "val":
        task = validation_view(task)
    x = task.x_test if task.shift_examples is None else task.x_test[: task.shift_examples]
    key = hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]  # as _quality_shifts.image_shifts names it
    path = args.cache_dir / f"imagenet-c-{key}.pt"
    cached = torch.load(path) if path.exists() else {}
    jobs = [(x, name, s) for name in corruptions for s in SEVERITIES if f"{name}/{s}" not in cached]
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        for name, images in pool.map(_one, jobs):
            cached[name] = images
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(cached, path)
    print(f"{path}: {len(jobs)} new sets of {len(x)} images in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
