"""ImageNet-C corruptions on the fly (corrupt-tta), small images included."""

import numpy as np
import pytest
import torch

from bayesify.evaluation.corruptions import CORRUPTIONS, corrupt_images, parse_corruptions, parse_severities


def test_the_fifteen_benchmark_corruptions():
    assert len(CORRUPTIONS) == 15 and len(set(CORRUPTIONS)) == 15
    assert "speckle_noise" not in CORRUPTIONS and "saturate" not in CORRUPTIONS  # the 4 extra ones stay out


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_every_corruption_on_gray_8x8_and_rgb_images(corruption):
    gray = torch.rand(3, 1, 8, 8)
    out = corrupt_images(gray, corruption, 3)
    assert out.shape == gray.shape and out.dtype == gray.dtype
    assert 0.0 <= float(out.min()) and float(out.max()) <= 1.0
    rgb = corrupt_images(torch.rand(2, 3, 12, 16), corruption, 5, min_size=8)
    assert rgb.shape == (2, 3, 12, 16)


def test_corruptions_change_images_more_with_severity_and_repeat_with_the_seed():
    x = torch.rand(16, 1, 8, 8)
    light, heavy = corrupt_images(x, "gaussian_noise", 1), corrupt_images(x, "gaussian_noise", 5)
    assert (light - x).abs().mean() < (heavy - x).abs().mean()
    assert torch.equal(corrupt_images(x, "gaussian_noise", 3, seed=4), corrupt_images(x, "gaussian_noise", 3, seed=4))
    assert not torch.equal(
        corrupt_images(x, "gaussian_noise", 3, seed=4), corrupt_images(x, "gaussian_noise", 3, seed=5)
    )


def test_numpy_global_state_is_left_as_it_was():
    np.random.seed(123)
    expected = np.random.rand()
    np.random.seed(123)
    corrupt_images(torch.rand(2, 1, 8, 8), "shot_noise", 2)
    assert np.random.rand() == expected


def test_bad_names_severities_and_shapes_name_the_fix():
    with pytest.raises(ValueError, match="choose from: gaussian_noise"):
        corrupt_images(torch.rand(1, 1, 8, 8), "rain", 1)
    with pytest.raises(ValueError, match="severity=6"):
        corrupt_images(torch.rand(1, 1, 8, 8), "fog", 6)
    with pytest.raises(ValueError, match="1 or 3 channels"):
        corrupt_images(torch.rand(1, 2, 8, 8), "fog", 1)
    assert parse_corruptions("fog, frost") == ("fog", "frost")
    assert parse_corruptions(None) == CORRUPTIONS == parse_corruptions("all")
    with pytest.raises(ValueError, match=r"\['fog:3'\]: name the corruptions alone and their severities apart \(--severities 3"):
        parse_corruptions("fog:3,frost")  # (--ood's NAME:SEVERITY form; was "unknown")
    x = torch.rand(3, 1, 8, 8)  # one seed as numpy's integer or a 0-d tensor is one seed, not a sequence
    one = corrupt_images(x, "gaussian_noise", 2, seed=7)
    assert torch.equal(corrupt_images(x, "gaussian_noise", 2, seed=np.int64(7)), one)
    assert torch.equal(corrupt_images(x, "gaussian_noise", 2, seed=torch.tensor(7)), one)
    with pytest.raises(ValueError, match="seed: 2 seeds for 3 images"):
        corrupt_images(torch.rand(3, 1, 8, 8), "fog", 1, seed=[1, 2])


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_every_corrupted_set_is_fixed_by_its_seed(corruption):
    x = torch.rand(4, 1, 8, 8)
    assert torch.equal(corrupt_images(x, corruption, 4, seed=9), corrupt_images(x, corruption, 4, seed=9))


def test_severities_are_one_to_five():
    assert parse_severities((5, 1)) == (5, 1)
    for bad in ((), (0,), (6,), (True,)):
        with pytest.raises(ValueError, match="one or more integers from 1 to 5"):
            parse_severities(bad)
