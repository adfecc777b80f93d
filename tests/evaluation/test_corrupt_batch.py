"""Batched corruptions give corrupt-tta's own numbers, image by image, bit for bit."""

import warnings

import numpy as np
import pytest

from bayesify.evaluation import _corrupt_batch
from bayesify.evaluation._corrupt_batch import corrupt_batch, fast_corruptions


def _one_by_one(pixels: np.ndarray, severity: int, corruption: str) -> np.ndarray:
    from corrupt_tta import corrupt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.stack([np.asarray(corrupt(image, severity, corruption), dtype=np.float32) for image in pixels])


@pytest.mark.parametrize("corruption", ["frost", "glass_blur", "zoom_blur"])
@pytest.mark.parametrize("shape", [(5, 32, 32, 3), (3, 13, 21, 3)])
def test_batched_corruptions_equal_the_library_image_by_image(corruption, shape):
    assert corruption in fast_corruptions()  # the installed corrupt-tta is the verified one
    pixels = np.random.default_rng(7).integers(0, 256, size=shape, dtype=np.uint8)
    for severity in (1, 2, 3, 4, 5):
        np.random.seed(severity)
        expected = _one_by_one(pixels, severity, corruption)
        next_expected = np.random.rand()  # where the library leaves numpy's generator
        np.random.seed(severity)
        got = corrupt_batch(pixels, severity, corruption)
        assert got.dtype == np.float32 and got.shape == shape
        assert np.array_equal(got, expected), f"{corruption} severity {severity} differs from corrupt-tta"
        assert np.random.rand() == next_expected, f"{corruption} draws differently from numpy's generator"


@pytest.mark.parametrize("severity, amount", [(1, 0.03), (5, 0.27)])
def test_impulse_noise_is_the_library_salt_and_pepper_but_fixed_by_the_seed(severity, amount):
    gray = np.full((64, 16, 16, 3), 100, dtype=np.uint8)
    np.random.seed(3)
    first = corrupt_batch(gray, severity, "impulse_noise")
    np.random.seed(3)
    assert np.array_equal(corrupt_batch(gray, severity, "impulse_noise"), first)  # the library's is not
    np.random.seed(4)
    assert not np.array_equal(corrupt_batch(gray, severity, "impulse_noise"), first)
    untouched = np.float32(np.clip(gray[0, 0, 0, 0] / 255.0, 0, 1) * 255)  # the library's arithmetic
    salt, pepper = first == 255, first == 0
    assert np.all(salt | pepper | (first == untouched))
    # each value flipped with probability `amount` (49k values: 4 standard deviations < 0.01), half to each side
    assert abs((salt | pepper).mean() - amount) < 0.01 and abs(salt.mean() - pepper.mean()) < 0.01
    library = _one_by_one(gray[:16], severity, "impulse_noise")
    assert abs((library != untouched).mean() - amount) < 0.02


def test_other_corruptions_and_other_library_versions_go_image_by_image(monkeypatch):
    pixels = np.random.default_rng(0).integers(0, 256, size=(2, 16, 16, 3), dtype=np.uint8)
    np.random.seed(1)
    expected = _one_by_one(pixels, 3, "fog")
    np.random.seed(1)
    assert np.array_equal(corrupt_batch(pixels, 3, "fog"), expected)

    import corrupt_tta

    fast_corruptions.cache_clear()
    monkeypatch.setattr(corrupt_tta, "__version__", "0.2.0")
    try:
        assert fast_corruptions() == {}  # unverified release: the library's own code only
    finally:
        monkeypatch.undo()
        fast_corruptions.cache_clear()
    assert set(fast_corruptions()) == {"frost", "glass_blur", "impulse_noise", "zoom_blur"}
    assert _corrupt_batch.VERIFIED_VERSION == corrupt_tta.__version__
