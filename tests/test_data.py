"""Data sets by name: the embedded ones, image folders, and clear errors."""

import pytest
import torch
from PIL import Image

from bayesify.zoo.data import DataKind, InMemoryDataset, load_data


def test_digits():
    bundle = load_data("digits")
    assert (len(bundle.train), len(bundle.test)) == (1257, 540)
    x, y = bundle.train[0]
    assert x.shape == (1, 8, 8) and 0.0 <= float(bundle.train.inputs.min()) and float(bundle.train.inputs.max()) <= 1.0
    assert bundle.kind is DataKind.IMAGE and bundle.num_classes == 10 and bundle.input_shape == (1, 8, 8)
    z = bundle.normalize(bundle.train.inputs)
    assert abs(float(z.mean())) < 1e-4 and abs(float(z.std()) - 1) < 1e-3


def test_mnist1d_and_breast_cancer():
    signals = load_data("mnist1d")
    assert (len(signals.train), len(signals.test)) == (4000, 1000) and signals.input_shape == (1, 40)
    assert signals.kind is DataKind.SIGNAL
    table = load_data("breast_cancer")  # "_" and "-" are the same
    assert table.input_shape == (30,) and table.binary and table.kind is DataKind.TABULAR
    assert abs(float(table.train.inputs.mean())) < 1e-4


def test_in_memory_batches_work_with_a_plain_data_loader():
    data = InMemoryDataset(torch.arange(10.0).view(10, 1), torch.arange(10))
    x, y = next(iter(torch.utils.data.DataLoader(data, batch_size=4)))
    assert torch.equal(x.squeeze(1), y.float()) and x.shape == (4, 1)


def test_image_folder(tmp_path):
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            Image.new("RGB", (40, 30), color=(10, 20, 30)).save(tmp_path / split / cls / "a.png")
    bundle = load_data(f"folder:{tmp_path}")
    assert bundle.num_classes == 2 and len(bundle.train) == 2
    assert bundle.test[0][0].shape == (3, 224, 224)


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("mnist", {}, "data='mnist' is not a known data set; accepted: digits"),
        ("cifar10", {}, "needs --data-dir"),
        ("cifar100", {"data_dir": "/nonexistent"}, "pass --download"),
        ("folder:/nonexistent", {}, "ImageNet-style tree"),
    ],
)
def test_errors_name_the_value_and_the_fix(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_data(name, **kwargs)
