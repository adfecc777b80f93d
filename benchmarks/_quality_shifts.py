"""Shifted test sets for ``benchmarks/quality.py``: every (corruption, severity) copy of a test set.

* images: the 15 ImageNet-C corruptions x 5 severities of ``bayesify.evaluation.corruptions``
  (computed once per run and cached: corrupting is the slow part of the benchmark);
* 1-d signals (MNIST-1D): the :data:`SIGNAL_CORRUPTIONS` below x 5 severities;
* tables (breast cancer, diabetes; features standardised with the training statistics): the
  :data:`TABLE_CORRUPTIONS` below x 5 severities.

Every corruption draws from its own generator seeded by (corruption, severity), so a shifted set
is the same on every run and for every method and seed.

Signal corruptions (``x`` is ``[N, 1, L]``; ``sd`` is the training set's standard deviation):

| name | what it does | severities 1-5 |
|---|---|---|
| ``gaussian_noise`` | adds N(0, (a * sd)^2) to every time step | a = 0.1, 0.2, 0.3, 0.5, 0.75 |
| ``impulse_noise`` | sets a fraction f of time steps to +-3 sd | f = 0.03, 0.06, 0.1, 0.15, 0.2 |
| ``time_shift`` | shifts each signal by d steps left or right (random sign), edge value padded | d = 2, 4, 6, 8, 10 (of 40) |
| ``amplitude_scale`` | multiplies each signal by g or 1/g (random) | g = 1.25, 1.5, 2, 2.5, 3 |
| ``linear_drift`` | adds a ramp from 0 to +-c sd over the signal (random sign) | c = 0.25, 0.5, 1, 1.5, 2 |

Table corruptions (features standardised, so 1 is one training standard deviation):

| name | what it does | severities 1-5 |
|---|---|---|
| ``gaussian_noise`` | adds N(0, a^2) to every feature | a = 0.1, 0.25, 0.5, 0.75, 1.0 |
| ``feature_dropout`` | sets a fraction f of the entries to 0 (the training mean) | f = 0.1, 0.2, 0.3, 0.4, 0.5 |
| ``feature_scale`` | multiplies each feature by g or 1/g (random per feature) | g = 1.25, 1.5, 2, 2.5, 3 |
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from bayesify.evaluation.corruptions import CORRUPTIONS, SEVERITIES, corrupt_images

__all__ = ["SIGNAL_CORRUPTIONS", "TABLE_CORRUPTIONS", "ShiftedSet", "image_shifts", "signal_shifts", "table_shifts"]

ShiftedSet = tuple[str, int, Tensor]
"""``(corruption, severity, inputs)``; the labels are the clean test set's."""


def _generator(name: str, severity: int) -> torch.Generator:
    # a stable seed per (corruption, severity): Python's hash() of a string changes between runs
    digest = hashlib.sha256(f"{name}/{severity}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _random_sign(n: int, g: torch.Generator) -> Tensor:
    return torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)


# ---- 1-d signals --------------------------------------------------------------------------------


def _gaussian_noise(x: Tensor, sd: float, s: int, g: torch.Generator) -> Tensor:
    a = (0.1, 0.2, 0.3, 0.5, 0.75)[s - 1]
    return x + a * sd * torch.randn(x.shape, generator=g)


def _impulse_noise(x: Tensor, sd: float, s: int, g: torch.Generator) -> Tensor:
    f = (0.03, 0.06, 0.1, 0.15, 0.2)[s - 1]
    hit = torch.rand(x.shape, generator=g) < f
    spikes = 3.0 * sd * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
    return torch.where(hit, spikes, x)


def _time_shift(x: Tensor, sd: float, s: int, g: torch.Generator) -> Tensor:
    d = (2, 4, 6, 8, 10)[s - 1]
    length = x.shape[-1]
    sign = _random_sign(len(x), g).long()
    # index of the source step for each output step, clamped: the edge value is repeated
    steps = torch.arange(length).view(1, 1, -1) - (sign * d).view(-1, 1, 1)
    return x.gather(-1, steps.clamp(0, length - 1).expand_as(x))


def _amplitude_scale(x: Tensor, sd: float, s: int, g: torch.Generator) -> Tensor:
    gain = (1.25, 1.5, 2.0, 2.5, 3.0)[s - 1]
    factor = gain ** _random_sign(len(x), g)
    return x * factor.view(-1, *([1] * (x.dim() - 1)))


def _linear_drift(x: Tensor, sd: float, s: int, g: torch.Generator) -> Tensor:
    c = (0.25, 0.5, 1.0, 1.5, 2.0)[s - 1]
    ramp = torch.linspace(0.0, 1.0, x.shape[-1])
    return x + c * sd * _random_sign(len(x), g).view(-1, 1, 1) * ramp


SIGNAL_CORRUPTIONS: dict[str, Callable[[Tensor, float, int, torch.Generator], Tensor]] = {
    "gaussian_noise": _gaussian_noise,
    "impulse_noise": _impulse_noise,
    "time_shift": _time_shift,
    "amplitude_scale": _amplitude_scale,
    "linear_drift": _linear_drift,
}


def signal_shifts(x_test: Tensor, train_sd: float) -> list[ShiftedSet]:
    """All :data:`SIGNAL_CORRUPTIONS` x 5 severities of ``x_test`` (``[N, C, L]``)."""
    return [
        (name, s, fn(x_test, train_sd, s, _generator(name, s)))
        for name, fn in SIGNAL_CORRUPTIONS.items()
        for s in SEVERITIES
    ]


# ---- tables -------------------------------------------------------------------------------------


def _table_noise(x: Tensor, s: int, g: torch.Generator) -> Tensor:
    return x + (0.1, 0.25, 0.5, 0.75, 1.0)[s - 1] * torch.randn(x.shape, generator=g)


def _feature_dropout(x: Tensor, s: int, g: torch.Generator) -> Tensor:
    f = (0.1, 0.2, 0.3, 0.4, 0.5)[s - 1]
    return torch.where(torch.rand(x.shape, generator=g) < f, torch.zeros_like(x), x)


def _feature_scale(x: Tensor, s: int, g: torch.Generator) -> Tensor:
    gain = (1.25, 1.5, 2.0, 2.5, 3.0)[s - 1]
    return x * gain ** _random_sign(x.shape[-1], g)


TABLE_CORRUPTIONS: dict[str, Callable[[Tensor, int, torch.Generator], Tensor]] = {
    "gaussian_noise": _table_noise,
    "feature_dropout": _feature_dropout,
    "feature_scale": _feature_scale,
}


def table_shifts(x_test: Tensor) -> list[ShiftedSet]:
    """All :data:`TABLE_CORRUPTIONS` x 5 severities of standardised features ``x_test`` (``[N, F]``)."""
    return [(name, s, fn(x_test, s, _generator(name, s))) for name, fn in TABLE_CORRUPTIONS.items() for s in SEVERITIES]


# ---- images -------------------------------------------------------------------------------------


def image_shifts(
    x_test: Tensor, corruptions: tuple[str, ...] = CORRUPTIONS, cache_dir: str | Path | None = None
) -> list[ShiftedSet]:
    """ImageNet-C ``corruptions`` x 5 severities of images ``x_test`` (``[N, C, H, W]`` in [0, 1]).

    Each set is corrupted once (seed 0 for every set, as ``corrupt_images`` defaults) and, with
    ``cache_dir``, saved there under a name that hashes the clean images, so later runs load it.
    """
    key = hashlib.sha256(x_test.numpy().tobytes()).hexdigest()[:16]
    path = None if cache_dir is None else Path(cache_dir) / f"imagenet-c-{key}.pt"
    cached: dict[str, Tensor] = torch.load(path) if path is not None and path.exists() else {}
    out, new = [], False
    for name in corruptions:
        for s in SEVERITIES:
            if f"{name}/{s}" not in cached:
                cached[f"{name}/{s}"], new = corrupt_images(x_test, name, s), True
            out.append((name, s, cached[f"{name}/{s}"]))
    if path is not None and new:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(cached, path)
    return out
