"""ImageNet-C corruptions applied on the fly, with the maintained ``corrupt-tta`` package.

The paper's robustness numbers (cNLL / cA / cECE) average the metrics over the 15 benchmark
corruptions x 5 severities of Hendrycks & Dietterich (2019). Instead of pre-computed
CIFAR-10-C / ImageNet-C files, bayesify corrupts any image test set as it is evaluated, with
``corrupt_tta.corrupt`` (the ImageNet-C code, fixed for numpy 2 / scikit-image). Corruptions
draw from numpy's global generator; :func:`corrupt_images` seeds it (for the call, or for each image) and
restores it afterwards, so a corrupted test set is the same on every run; the evaluator seeds each image by
its place in the test set, so what an image gets does not depend on the batch it comes in. Three slow corruptions (frost,
glass blur, zoom blur) run batched, with the library's numbers bit for bit, and impulse noise
draws from a seeded generator, which the library's does not (``_corrupt_batch.py``).

Small images: the ImageNet-C parameters are tuned for 224-pixel images, and some (blur kernels,
frost crops, pixelation) degenerate on 8x8 inputs. Images with a side below ``min_size``
(default 32, the CIFAR size) are upsampled bilinearly by an integer factor to at least
``min_size``, corrupted there, and reduced back to their size by area averaging. Gray images
are corrupted as RGB (the gray channel repeated) and turned back to gray by the channel mean.

References:
    Hendrycks & Dietterich, "Benchmarking Neural Network Robustness to Common Corruptions and
    Perturbations", ICLR 2019.
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from bayesify.evaluation._corrupt_batch import corrupt_batch

__all__ = ["CORRUPTIONS", "SEVERITIES", "corrupt_images", "corruption_seed", "parse_corruptions", "parse_severities"]

CORRUPTIONS: tuple[str, ...] = (
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness",
    "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)  # fmt: skip
"""The 15 ImageNet-C benchmark corruptions (noise, blur, weather, digital)."""

SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)


def parse_corruptions(names: str | Iterable[str] | None) -> tuple[str, ...]:
    """``None`` or ``"all"``: the 15; otherwise a comma-separated string or a list, validated."""
    if names is None or names == "all":
        return CORRUPTIONS
    items = [n.strip() for n in names.split(",")] if isinstance(names, str) else [str(n) for n in names]
    items = [n for n in items if n]
    unknown = [n for n in items if n not in CORRUPTIONS]
    severity_given = [n for n in unknown if n.partition(":")[0] in CORRUPTIONS]
    if severity_given:  # (the --ood option's NAME:SEVERITY form)
        raise ValueError(
            f"corruptions={severity_given!r}: name the corruptions alone and their severities apart "
            f"(--severities 3, or severities=(3,)); every corruption runs at every severity given."
        )
    if unknown or not items:
        raise ValueError(f"corruptions={unknown or names!r} unknown; choose from: {', '.join(CORRUPTIONS)} (or 'all').")
    return tuple(items)


def parse_severities(severities: Iterable[int]) -> tuple[int, ...]:
    """Validated severities: one or more integers from 1 to 5, in the order given."""
    items = tuple(severities)
    bad = [s for s in items if isinstance(s, bool) or s not in SEVERITIES]
    if bad or not items:
        raise ValueError(f"severities={list(items)!r}: pass one or more integers from 1 to 5 (e.g. 1,3,5).")
    return items


def corrupt_images(
    images: Tensor,
    corruption: str,
    severity: int,
    *,
    seed: int | Sequence[int] = 0,
    min_size: int = 32,
) -> Tensor:
    """Corrupt a batch of images ``[N, C, H, W]`` in ``[0, 1]`` (C = 1 or 3); same shape back.

    Args:
        images: the clean images, values in [0, 1] (before mean/std normalisation).
        corruption: one of :data:`CORRUPTIONS`.
        severity: 1 to 5.
        seed: seeds numpy's generator for this call (restored afterwards), the images drawn in turn; or one seed
            per image, each image corrupted under its own (what an image gets then does not depend on the
            others in the batch: :func:`corruption_seed` of its index in the set).
        min_size: images with a smaller side are corrupted at an upsampled size (see module doc).

    Raises:
        ValueError: an unknown corruption, a severity outside 1-5, or not 1/3-channel images.
    """
    parse_corruptions([corruption])
    if isinstance(severity, bool) or severity not in SEVERITIES:
        raise ValueError(f"severity={severity!r} must be an integer from 1 to 5.")
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(
            f"corruptions need [N, C, H, W] images with 1 or 3 channels, got shape {tuple(images.shape)}; "
            "they apply to image data sets only."
        )
    n, channels, h, w = images.shape
    seeds = None if np.ndim(seed) == 0 else [int(value) for value in seed]  # (one int: numpy's or a 0-d tensor too)
    if seeds is not None and len(seeds) != n:
        raise ValueError(f"seed: {len(seeds)} seeds for {n} images; pass one int, or one seed per image.")
    x = images.detach().float().cpu().clamp(0, 1)
    factor = max(1, math.ceil(min_size / min(h, w)))
    if factor > 1:
        x = F.interpolate(x, scale_factor=factor, mode="bilinear", align_corners=False).clamp(0, 1)
    rgb = x.expand(n, 3, *x.shape[2:]) if channels == 1 else x
    pixels = (rgb.permute(0, 2, 3, 1).numpy() * 255.0).round().astype(np.uint8)  # [N, H, W, 3]

    state = np.random.get_state()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if seeds is None:
                np.random.seed(int(seed) % 2**32)
                out = corrupt_batch(pixels, severity, corruption)
            else:
                parts = []
                for image, image_seed in zip(pixels, seeds):
                    np.random.seed(image_seed % 2**32)
                    parts.append(corrupt_batch(image[None], severity, corruption))
                out = np.concatenate(parts) if parts else np.zeros(pixels.shape, np.float32)
    finally:
        np.random.set_state(state)

    result = torch.from_numpy(np.clip(out, 0, 255) / 255.0).float().permute(0, 3, 1, 2)
    if channels == 1:
        result = result.mean(1, keepdim=True)
    if factor > 1:
        result = F.interpolate(result, size=(h, w), mode="area")
    return result.to(images.dtype)


def corruption_seed(base: int, corruption: str, severity: int, index: int) -> int:
    """A fixed seed per (corruption, severity, image index in the set), independent of the evaluation's order and
    batch size; distinct for every tuple (numpy's ``SeedSequence``: a sum of the parts gave severity 2's image 0
    the seed of severity 1's image 101)."""
    entropy = [base % 2**32, CORRUPTIONS.index(corruption), severity, index]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])
