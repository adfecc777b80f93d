"""The tasks of ``benchmarks/quality.py``: data that ships with packages, a network, shifted test sets.

Every task carves a validation split (20%, stratified for classes, fixed seed) out of the
training set: the methods tune on it (and temperature scaling fits on it); all final models are
trained on the rest. The test set is touched only by the final evaluation.

| task | data (train / val / test) | network | shifted copies |
|---|---|---|---|
| ``digits`` | sklearn digits 8x8 (1005 / 252 / 540) | CNN: conv 16, conv 32, pool, fc 64 | 15 ImageNet-C corruptions x 5 |
| ``mnist1d-conv`` | MNIST-1D (3200 / 800 / 1000) | Conv1d 32, 64, pool, fc 128 (bayesify's ``cnn1d``) | 5 signal corruptions x 5 |
| ``mnist1d-gru`` | MNIST-1D | Conv1d 16 + pool (20 steps), GRU 32, linear | 5 signal corruptions x 5 |
| ``breast-cancer`` | sklearn (318 / 80 / 171), standardised | MLP 64-64, 2 logits | 3 feature corruptions x 5 |
| ``diabetes`` | sklearn regression (247 / 62 / 133), x and y standardised | MLP 64-64, (mean, log variance) | 3 feature corruptions x 5 |
| ``digits-finetune`` | digits: pre-train on half of train, fine-tune on the other half | the digits CNN | as ``digits`` |
| ``digits-resnet`` | digits; not in the default list (the depth check of ``rank1_defaults.py``) | stem + 6 residual blocks with BatchNorm: 14 rank-1 layers | as ``digits`` |
| ``fashion-mnist`` | Fashion-MNIST 28x28 (55000 / 5000 / 10000; ``--max-train`` subsamples) | CNN: conv 16, pool, conv 32, pool, fc 128 | ImageNet-C corruptions x 5 (``--corruptions``, ``--shift-examples``) |
| ``fashion-mnist-resnet`` | Fashion-MNIST | ResNet-8 style: stem 16 + pool, 3 residual stages (16, 32, 64; BatchNorm) | as ``fashion-mnist`` |
| ``*-plain`` | the two above in the *plain* loop: Adam 1e-3 constant, no tuning, the README's recipe | as above | as above |
| ``fashion-split-finetune`` | pre-train on Fashion-MNIST classes 0-4, fine-tune on 2000 labels of classes 5-9 (500 val; test: the 5000 test images of 5-9) | the ResNet-8, a new 5-class head | as ``fashion-mnist`` |
| ``mnist-to-fashion-finetune`` | pre-train on MNIST (all 10 digits), fine-tune on 2000 labels of Fashion-MNIST (500 val; test: Fashion-MNIST test) | the ResNet-8, a new 10-class head | as ``fashion-mnist`` |
| ``*-finetune-plain`` | the two above, fine-tuned in the plain loop | as above | as above |

The Fashion-MNIST tasks are not in the default list (they need ``make data``; ``--data-dir``).
They add out-of-distribution detection: the MNIST test set (10000 images) against the
Fashion-MNIST test set, scored by ``bayesify.evaluation.evaluate(..., ood=...)``.

The image fine-tuning tasks are what a user with a pretrained network and a new task with few labels
has: the network is pre-trained deterministically (``benchmarks/quality.py``'s tuned loop: Adam 2e-3,
cosine, batch 128, 10 epochs on every pre-training image; ``--max-pretrain`` / ``--pretrain-epochs`` shrink
it), its last linear layer is replaced by a *new head* for the target's classes (initialised from the
seed), and every method fine-tunes (or post-processes) that same network: one pre-training per (set,
seed) in a run, shared by the plain and the tuned loop. Two shifts of task, both without a download
beyond ``make data``:

* a split of one set's classes (``fashion-split-finetune``): tops, trousers, pullovers, dresses and
  coats (0-4) to pre-train on; sandals, shirts, sneakers, bags and ankle boots (5-9) to fine-tune on;
* a transfer across sets (``mnist-to-fashion-finetune``): handwritten digits to clothes. MNIST to
  Fashion-MNIST rather than the reverse: on MNIST 2000 labels already give ~98%, which leaves
  little for calibration to show.

Both targets are Fashion-MNIST, so the OOD set is the MNIST test set for both (for the transfer task
that is the pre-training domain's test set: images the body knows well but the head has not seen).
The fine-tuning labels are the first ``--max-train`` (default 2000) of a fixed shuffle of the target's
training images, and a validation split of a quarter of that (500) is carved beside them, as a user
with 2000 labels would keep some for validation.

MC dropout is the one method whose network differs: ``make_net(p)`` puts ``nn.Dropout(p)`` after
every hidden activation (p = 0 gives ``nn.Identity``, so every other method runs exactly the
same architecture).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from benchmarks._quality_shifts import ShiftedSet, image_shifts, signal_shifts, table_shifts

__all__ = ["DEFAULT_TASKS", "FINETUNE_TASK_METHODS", "TASKS", "Scale", "Task", "build_task", "head_name", "validation_view"]

CLASSIFICATION, REGRESSION = "classification", "regression"


@dataclass
class Task:
    """One benchmark task: splits, a network factory and its training budget."""

    name: str
    kind: str  # CLASSIFICATION or REGRESSION
    make_net: Callable[[float], nn.Module]  # dropout p -> a fresh network (seed torch first)
    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor
    make_shifts: Callable[[Tensor], list[ShiftedSet]]  # clean inputs -> their shifted copies
    epochs: int
    batch_size: int
    lr_grid: tuple[float, ...]
    description: str
    y_std: float = 1.0  # regression: the target's training std (metrics in data units)
    # fine-tuning: the pre-training split and its epochs (the final models fine-tune on x_train)
    x_pretrain: Tensor | None = None
    y_pretrain: Tensor | None = None
    pretrain_epochs: int = 0
    pretrain_lr: float = 2e-3
    pretrain_batch_size: int | None = None  # None: batch_size
    # the network pre-training trains (None: make_net); with new_head, its last linear layer is replaced
    # by make_net's (a fresh head for the target's classes) before fine-tuning
    make_pretrain_net: Callable[[float], nn.Module] | None = None
    new_head: bool = False
    pretrain_key: str | None = None  # tasks with the same key share their pre-trained nets (default: name)
    pretrained: dict[int, nn.Module] = field(default_factory=dict, repr=False)  # seed -> pre-trained net
    _shifts: list[ShiftedSet] | None = field(default=None, repr=False)

    @property
    def finetune(self) -> bool:
        return self.x_pretrain is not None

    @property
    def num_train(self) -> int:
        return len(self.y_train)

    max_shifts: int | None = None  # --quick: evenly spaced among the (corruption, severity) sets
    shift_examples: int | None = None  # the shifted sets are made of the first N test examples (None: all)
    # "tuned": the benchmark's loop (cosine decay, tuned learning rate); "plain": what a new user writes
    # (Adam at PLAIN_LR, constant, no tuning, bayesify.kl_loss warmed up over 2/3 of the steps)
    loop: str = "tuned"
    methods: tuple[str, ...] | None = None  # the methods run by default (None: all of the pool)
    x_ood: Tensor | None = None  # out-of-distribution test inputs (the Fashion-MNIST tasks: MNIST test)
    ood_name: str | None = None

    @property
    def y_shift(self) -> Tensor:
        """The labels of the shifted sets."""
        return self.y_test if self.shift_examples is None else self.y_test[: self.shift_examples]

    def shifts(self) -> list[ShiftedSet]:
        """The shifted test sets, made once per run (the same tensors for every method and seed)."""
        if self._shifts is None:
            clean = self.x_test if self.shift_examples is None else self.x_test[: self.shift_examples]
            sets = self.make_shifts(clean)
            if self.max_shifts is not None and len(sets) > self.max_shifts:
                sets = sets[:: math.ceil(len(sets) / self.max_shifts)]
            self._shifts = sets
        return self._shifts


class Standardize(nn.Module):
    """``(x - mean) / std`` with fixed buffers: the network sees raw inputs, so they can be corrupted first."""

    def __init__(self, mean: float, std: float) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean))
        self.register_buffer("std", torch.tensor(std))

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std


def _drop(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


def _digits_cnn(mean: float, std: float, p: float) -> nn.Module:
    return nn.Sequential(
        Standardize(mean, std),
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), _drop(p),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), _drop(p),
        nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), _drop(p), nn.Linear(64, 10),
    )  # fmt: skip


class _Block(nn.Module):
    def __init__(self, channels: int, p: float) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
        )  # fmt: skip
        self.drop = _drop(p)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(torch.relu(x + self.body(x)))


def _digits_resnet(mean: float, std: float, p: float, blocks: int = 6, channels: int = 32) -> nn.Module:
    """A deeper net for the depth question: stem + ``blocks`` residual blocks (2 convs each, BatchNorm) + fc."""
    return nn.Sequential(
        Standardize(mean, std),
        nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
        *[_Block(channels, p) for _ in range(blocks)],
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10),
    )  # fmt: skip


def _signal_cnn(p: float) -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(1, 32, 5, padding=2), nn.ReLU(), _drop(p),
        nn.Conv1d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2), nn.AdaptiveAvgPool1d(8), _drop(p),
        nn.Flatten(), nn.Linear(64 * 8, 128), nn.ReLU(), _drop(p), nn.Linear(128, 10),
    )  # fmt: skip


class SignalGRU(nn.Module):
    """A small recurrent classifier: a Conv1d stem halves the 40 steps, a GRU reads the 20, a linear head."""

    def __init__(self, p: float, hidden: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2), _drop(p))
        self.gru = nn.GRU(16, hidden, batch_first=True)
        self.drop = _drop(p)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: Tensor) -> Tensor:
        steps, _ = self.gru(self.stem(x).transpose(1, 2))  # [B, 20, hidden]
        return self.head(self.drop(steps[:, -1]))


def _fashion_cnn(mean: float, std: float, p: float, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        Standardize(mean, std),
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), _drop(p),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), _drop(p),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), _drop(p), nn.Linear(128, classes),
    )  # fmt: skip


class _DownBlock(nn.Module):
    """A residual block that changes width and halves the size: 3x3 stride 2, 3x3; 1x1 stride-2 shortcut."""

    def __init__(self, inputs: int, outputs: int, p: float) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(inputs, outputs, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(),
            nn.Conv2d(outputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs),
        )  # fmt: skip
        self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride=2, bias=False), nn.BatchNorm2d(outputs))
        self.drop = _drop(p)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(torch.relu(self.shortcut(x) + self.body(x)))


def _fashion_resnet(mean: float, std: float, p: float, classes: int = 10) -> nn.Module:
    """ResNet-8 style for 28x28: stem conv 16 + max-pool (14x14), blocks at 16 (14x14), 32 (7x7), 64 (4x4), fc.

    9 convolutions (2 of them 1x1 shortcuts) with BatchNorm and a linear head: 10 layers to convert.
    """
    return nn.Sequential(
        Standardize(mean, std),
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        _Block(16, p), _DownBlock(16, 32, p), _DownBlock(32, 64, p),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes),
    )  # fmt: skip


def head_name(net: nn.Module) -> str:
    """The qualified name of the network's head: its last linear layer (converted layers keep their names)."""
    names = [name for name, m in net.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(f"{type(net).__name__} has no linear layer to serve as its head.")
    return names[-1]


def _mlp(features: int, outputs: int, p: float) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, 64), nn.ReLU(), _drop(p), nn.Linear(64, 64), nn.ReLU(), _drop(p), nn.Linear(64, outputs)
    )


# ---- splits --------------------------------------------------------------------------------------


def _carve(x: Tensor, y: Tensor, stratify: bool, fraction: float | int = 0.2) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Split a training set into (train, val) with a fixed seed."""
    from sklearn.model_selection import train_test_split

    idx_train, idx_val = train_test_split(
        torch.arange(len(y)).numpy(), test_size=fraction, random_state=0, stratify=y.numpy() if stratify else None
    )
    idx_train, idx_val = torch.as_tensor(idx_train), torch.as_tensor(idx_val)
    return x[idx_train], y[idx_train], x[idx_val], y[idx_val]


def _subset(x: Tensor, y: Tensor, limit: int | None) -> tuple[Tensor, Tensor]:
    return (x, y) if limit is None or limit >= len(y) else (x[:limit], y[:limit])


@dataclass(frozen=True)
class Scale:
    """What ``--quick`` shrinks: epochs, set sizes and the image corruptions used; and where data is."""

    epochs: float = 1.0
    max_train: int | None = None
    max_test: int | None = None
    image_corruptions: tuple[str, ...] | None = None
    max_shifts: int | None = None
    cache_dir: Path | None = None
    data_dir: Path | None = None  # Fashion-MNIST and MNIST in torchvision's layout (make data)
    fixed_epochs: int | None = None  # --epochs: the Fashion-MNIST tasks' epochs (before ``epochs`` scales them)
    max_pretrain: int | None = None  # --max-pretrain: the image fine-tuning tasks pre-train on the first N
    pretrain_epochs: int | None = None  # --pretrain-epochs: their pre-training epochs (default 10)
    shift_examples: int | None = None  # --shift-examples: shifted sets from the first N test examples
    max_ood: int | None = None  # --max-ood: the first N MNIST test images as the OOD set


@functools.lru_cache(maxsize=None)
def _bundle(name: str) -> object:
    from bayesify.zoo.data import load_data

    return load_data(name)  # MNIST-1D is generated (seconds): once per process


def _digits_like(name: str, scale: Scale, finetune: bool, deep: bool = False) -> Task:
    bundle = _bundle("digits")
    x_tr, y_tr, x_val, y_val = _carve(bundle.train.inputs, bundle.train.labels, stratify=True)
    mean, std = float(x_tr.mean()), float(x_tr.std())
    x_tr, y_tr = _subset(x_tr, y_tr, scale.max_train)
    x_te, y_te = _subset(bundle.test.inputs, bundle.test.labels, scale.max_test)
    kwargs = {} if scale.image_corruptions is None else {"corruptions": scale.image_corruptions}
    shifts = lambda x: image_shifts(x, cache_dir=scale.cache_dir, **kwargs)  # noqa: E731
    epochs = max(1, round(30 * scale.epochs))
    task = Task(
        name, CLASSIFICATION, lambda p: (_digits_resnet if deep else _digits_cnn)(mean, std, p), x_tr, y_tr, x_val, y_val, x_te, y_te, shifts,
        epochs=epochs, batch_size=64, lr_grid=(5e-4, 1e-3, 2e-3, 4e-3),
        description="sklearn digits 8x8, small CNN, 15 ImageNet-C corruptions x 5 severities",
    )  # fmt: skip
    if finetune:
        # pre-train on one half of the training split, fine-tune on the other (same val / test)
        half = len(y_tr) // 2
        task.x_pretrain, task.y_pretrain = x_tr[:half], y_tr[:half]
        task.x_train, task.y_train = x_tr[half:], y_tr[half:]
        task.pretrain_epochs, task.epochs = epochs, max(1, epochs // 2)
        task.lr_grid = (1e-4, 3e-4, 1e-3, 3e-3)
        task.description = (
            "digits CNN pre-trained deterministically on half of the training split, then fine-tuned on the other half"
        )
    return task


def _mnist1d(name: str, scale: Scale, recurrent: bool) -> Task:
    bundle = _bundle("mnist1d")
    x_tr, y_tr, x_val, y_val = _carve(bundle.train.inputs, bundle.train.labels, stratify=True)
    train_sd = float(x_tr.std())
    x_tr, y_tr = _subset(x_tr, y_tr, scale.max_train)
    x_te, y_te = _subset(bundle.test.inputs, bundle.test.labels, scale.max_test)
    net = (lambda p: SignalGRU(p)) if recurrent else _signal_cnn
    return Task(
        name, CLASSIFICATION, net, x_tr, y_tr, x_val, y_val, x_te, y_te, lambda x: signal_shifts(x, train_sd),
        epochs=max(1, round(30 * scale.epochs)), batch_size=64, lr_grid=(5e-4, 1e-3, 2e-3, 4e-3),
        description="MNIST-1D, " + ("Conv1d stem + GRU 32" if recurrent else "Conv1d net") + ", 5 signal corruptions x 5",
    )  # fmt: skip


def _table(name: str, scale: Scale, regression: bool) -> Task:
    from sklearn.datasets import load_breast_cancer, load_diabetes
    from sklearn.model_selection import train_test_split

    table = load_diabetes() if regression else load_breast_cancer()
    x = torch.tensor(table.data, dtype=torch.float32)
    y = torch.tensor(table.target, dtype=torch.float32 if regression else torch.long)
    i_tr, i_te = train_test_split(
        torch.arange(len(y)).numpy(), test_size=0.3, random_state=0, stratify=None if regression else y.numpy()
    )
    x_tr, y_tr, x_val, y_val = _carve(x[i_tr], y[i_tr], stratify=not regression)
    x_te, y_te = x[i_te], y[i_te]
    mean, std = x_tr.mean(0), x_tr.std(0).clamp_min(1e-6)
    x_tr, x_val, x_te = ((v - mean) / std for v in (x_tr, x_val, x_te))
    y_std = 1.0
    if regression:
        y_mean, y_std = float(y_tr.mean()), float(y_tr.std())
        y_tr, y_val, y_te = ((v - y_mean) / y_std for v in (y_tr, y_val, y_te))
    x_tr, y_tr = _subset(x_tr, y_tr, scale.max_train)
    x_te, y_te = _subset(x_te, y_te, scale.max_test)
    outputs = 2  # two logits, or (mean, log variance)
    return Task(
        name, REGRESSION if regression else CLASSIFICATION, lambda p: _mlp(x.shape[1], outputs, p),
        x_tr, y_tr, x_val, y_val, x_te, y_te, table_shifts,
        epochs=max(1, round(100 * scale.epochs)), batch_size=32, lr_grid=(5e-4, 1e-3, 2e-3, 4e-3),
        description=("sklearn diabetes regression, MLP with a Gaussian head" if regression
                     else "sklearn breast cancer (binary), MLP") + ", 3 feature corruptions x 5",
        y_std=y_std,
    )  # fmt: skip


# the methods for the Fashion-MNIST tasks (the variants of the sampling study stay on the small tasks)
FASHION_METHODS = (
    "deterministic", "temperature", "mc-dropout", "batchensemble", "rank1", "rank1-sampled", "rank1-tiled",
    "rank1-cauchy", "deep-ensemble", "bayesian-torch",
)  # fmt: skip
FASHION_VAL = 5000  # examples carved from the 60000 for validation (tuning, temperature)
FASHION_EPOCHS = 10


@functools.lru_cache(maxsize=None)
def _torchvision_set(name: str, data_dir: str) -> object:
    from bayesify.zoo.data import load_data

    return load_data(name, data_dir)


def _fashion(name: str, scale: Scale, resnet: bool, plain: bool) -> Task:
    if scale.data_dir is None:
        raise ValueError(f"task {name!r} needs --data-dir (Fashion-MNIST and MNIST; `make data` puts them in ./data)")
    fashion = _torchvision_set("fashion-mnist", str(scale.data_dir))
    mnist = _torchvision_set("mnist", str(scale.data_dir))
    x_all, y_all = fashion.train.inputs, fashion.train.labels
    x_tr, y_tr, x_val, y_val = _carve(x_all, y_all, stratify=True, fraction=min(FASHION_VAL, len(y_all) // 5))
    mean, std = float(x_tr.mean()), float(x_tr.std())
    # --max-train: the first N of the carved training split (train_test_split shuffles: a random subset)
    x_tr, y_tr = _subset(x_tr, y_tr, scale.max_train)
    x_te, y_te = _subset(fashion.test.inputs, fashion.test.labels, scale.max_test)
    x_ood, _ = _subset(mnist.test.inputs, mnist.test.labels, scale.max_ood or scale.max_test)
    kwargs = {} if scale.image_corruptions is None else {"corruptions": scale.image_corruptions}
    shifts = lambda x: image_shifts(x, cache_dir=scale.cache_dir, **kwargs)  # noqa: E731
    epochs = max(1, round((scale.fixed_epochs or FASHION_EPOCHS) * scale.epochs))
    make = _fashion_resnet if resnet else _fashion_cnn
    corruptions = len(scale.image_corruptions) if scale.image_corruptions is not None else 15
    task = Task(
        name, CLASSIFICATION, lambda p: make(mean, std, p), x_tr, y_tr, x_val, y_val, x_te, y_te, shifts,
        epochs=epochs, batch_size=128, lr_grid=(5e-4, 1e-3, 2e-3, 4e-3),
        description=(
            "Fashion-MNIST 28x28, " + ("ResNet-8 style (BatchNorm)" if resnet else "small CNN")
            + f", {corruptions} ImageNet-C corruptions x 5 severities"
            + (f" on the first {scale.shift_examples} test images" if scale.shift_examples else "")
            + "; OOD: MNIST test vs Fashion-MNIST test"
            + ("; plain loop (Adam 1e-3 constant, no tuning, bayesify.kl_loss warm-up)" if plain else "")
        ),
        loop="plain" if plain else "tuned", methods=FASHION_METHODS, x_ood=x_ood, ood_name="mnist",
        shift_examples=scale.shift_examples,
    )  # fmt: skip
    return task


# the methods of the image fine-tuning tasks (a new head: the pre-trained net itself predicts nothing there)
FINETUNE_TASK_METHODS = (
    "ft-deterministic", "ft-temperature", "ft-laplace", "ft-laplace-all", "ft-mc-dropout", "ft-batchensemble",
    "ft-ensemble", "ft-rank1", "ft-rank1-sampled", "ft-rank1-factors", "ft-rank1-factors-x10",
)  # fmt: skip
FINETUNE_LABELS = 2000  # labelled fine-tuning examples (--max-train); a quarter of that again is carved for validation
FINETUNE_EPOCHS = 10  # fine-tuning epochs (--epochs)
PRETRAIN_EPOCHS = 10  # pre-training epochs (--pretrain-epochs)


def _shuffled(x: Tensor, y: Tensor, limit: int | None, seed: int = 0) -> tuple[Tensor, Tensor]:
    """The first ``limit`` of a fixed shuffle (the idx files come in no guaranteed class order)."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    order = order if limit is None else order[:limit]
    return x[order], y[order]


def _finetune_images(name: str, scale: Scale, transfer: bool, plain: bool) -> Task:
    """Pre-train the ResNet-8 on one image task, fine-tune it with a new head on another (see the module doc)."""
    if scale.data_dir is None:
        raise ValueError(f"task {name!r} needs --data-dir (Fashion-MNIST and MNIST; `make data` puts them in ./data)")
    fashion = _torchvision_set("fashion-mnist", str(scale.data_dir))
    mnist = _torchvision_set("mnist", str(scale.data_dir))
    if transfer:  # digits -> clothes, every class
        x_pre, y_pre = mnist.train.inputs, mnist.train.labels
        x_pool, y_pool = fashion.train.inputs, fashion.train.labels
        x_te, y_te = fashion.test.inputs, fashion.test.labels
        classes_pre = classes = 10
    else:  # Fashion-MNIST classes 0-4 -> 5-9 (relabelled 0-4)
        first, test_first = fashion.train.labels < 5, fashion.test.labels < 5
        x_pre, y_pre = fashion.train.inputs[first], fashion.train.labels[first]
        x_pool, y_pool = fashion.train.inputs[~first], fashion.train.labels[~first] - 5
        x_te, y_te = fashion.test.inputs[~test_first], fashion.test.labels[~test_first] - 5
        classes_pre = classes = 5
    x_pre, y_pre = _shuffled(x_pre, y_pre, scale.max_pretrain)
    labels = scale.max_train or FINETUNE_LABELS
    x_lab, y_lab = _shuffled(x_pool, y_pool, labels + labels // 4, seed=1)
    x_tr, y_tr, x_val, y_val = _carve(x_lab, y_lab, stratify=True, fraction=len(y_lab) // 5)
    mean, std = float(x_pre.mean()), float(x_pre.std())  # the pre-trained net's own input normalisation
    x_te, y_te = _subset(x_te, y_te, scale.max_test)
    x_ood, _ = _subset(mnist.test.inputs, mnist.test.labels, scale.max_ood or scale.max_test)
    kwargs = {} if scale.image_corruptions is None else {"corruptions": scale.image_corruptions}
    shifts = lambda x: image_shifts(x, cache_dir=scale.cache_dir, **kwargs)  # noqa: E731
    corruptions = len(scale.image_corruptions) if scale.image_corruptions is not None else 15
    pretrain_epochs = max(1, round((scale.pretrain_epochs or PRETRAIN_EPOCHS) * scale.epochs))
    source = "MNIST" if transfer else "Fashion-MNIST classes 0-4"
    return Task(
        name, CLASSIFICATION, lambda p: _fashion_resnet(mean, std, p, classes), x_tr, y_tr, x_val, y_val, x_te, y_te,
        shifts, epochs=max(1, round((scale.fixed_epochs or FINETUNE_EPOCHS) * scale.epochs)), batch_size=64,
        lr_grid=(1e-4, 3e-4, 1e-3, 3e-3),
        description=(
            f"ResNet-8 pre-trained on {source} ({len(y_pre)} images, {pretrain_epochs} epochs), fine-tuned with a new "
            f"{classes}-class head on {len(y_tr)} labels of " + ("Fashion-MNIST" if transfer else "Fashion-MNIST classes 5-9")
            + f"; {corruptions} ImageNet-C corruptions x 5 severities"
            + (f" on the first {scale.shift_examples} test images" if scale.shift_examples else "")
            + "; OOD: MNIST test vs the target's test images"
            + ("; plain loop (Adam 1e-3 constant, no tuning, bayesify.kl_loss warm-up)" if plain else "")
        ),
        x_pretrain=x_pre, y_pretrain=y_pre, pretrain_epochs=pretrain_epochs, pretrain_batch_size=128,
        make_pretrain_net=lambda p: _fashion_resnet(mean, std, p, classes_pre), new_head=True,
        pretrain_key=f"{'mnist' if transfer else 'fashion-0-4'}/resnet8",
        loop="plain" if plain else "tuned", methods=FINETUNE_TASK_METHODS, x_ood=x_ood, ood_name="mnist",
        shift_examples=scale.shift_examples,
    )  # fmt: skip


TASKS: dict[str, Callable[[Scale], Task]] = {
    "digits": lambda s: _digits_like("digits", s, finetune=False),
    "mnist1d-conv": lambda s: _mnist1d("mnist1d-conv", s, recurrent=False),
    "mnist1d-gru": lambda s: _mnist1d("mnist1d-gru", s, recurrent=True),
    "breast-cancer": lambda s: _table("breast-cancer", s, regression=False),
    "diabetes": lambda s: _table("diabetes", s, regression=True),
    "digits-finetune": lambda s: _digits_like("digits-finetune", s, finetune=True),
    # not in quality.py's default list: the depth check of the defaults study (14 rank-1 layers)
    "digits-resnet": lambda s: _digits_like("digits-resnet", s, finetune=False, deep=True),
    # need the files (make data; --data-dir): not in the default list
    "fashion-mnist": lambda s: _fashion("fashion-mnist", s, resnet=False, plain=False),
    "fashion-mnist-resnet": lambda s: _fashion("fashion-mnist-resnet", s, resnet=True, plain=False),
    "fashion-mnist-plain": lambda s: _fashion("fashion-mnist-plain", s, resnet=False, plain=True),
    "fashion-mnist-resnet-plain": lambda s: _fashion("fashion-mnist-resnet-plain", s, resnet=True, plain=True),
    # a pre-trained net, a new head, few labels (make data; --data-dir): not in the default list
    "fashion-split-finetune": lambda s: _finetune_images("fashion-split-finetune", s, transfer=False, plain=False),
    "fashion-split-finetune-plain": lambda s: _finetune_images("fashion-split-finetune-plain", s, transfer=False, plain=True),
    "mnist-to-fashion-finetune": lambda s: _finetune_images("mnist-to-fashion-finetune", s, transfer=True, plain=False),
    "mnist-to-fashion-finetune-plain": lambda s: _finetune_images(
        "mnist-to-fashion-finetune-plain", s, transfer=True, plain=True
    ),
}
GROUPS = {
    "fashion-mnist-all": ("fashion-mnist", "fashion-mnist-plain", "fashion-mnist-resnet", "fashion-mnist-resnet-plain"),
    "finetune-all": (
        "fashion-split-finetune", "fashion-split-finetune-plain", "mnist-to-fashion-finetune",
        "mnist-to-fashion-finetune-plain",
    ),
}  # fmt: skip
DEFAULT_TASKS = ("digits", "mnist1d-conv", "mnist1d-gru", "breast-cancer", "diabetes", "digits-finetune")


def validation_view(task: Task) -> Task:
    """The task with its validation split in the place of the test set (and shifted copies of it).

    For studies that choose settings: they never see the test set.
    """
    described = task.description + "; evaluated on the VALIDATION split (its test set is not used)"
    return dataclasses.replace(task, x_test=task.x_val, y_test=task.y_val, _shifts=None, description=described)


def build_task(name: str, scale: Scale) -> Task:
    if name not in TASKS:
        raise ValueError(f"task={name!r} is unknown; choose from: {', '.join(TASKS)}.")
    task = TASKS[name](scale)
    task.max_shifts = scale.max_shifts
    return task


def task_names(group: str) -> list[str]:
    """``fashion-mnist-all``: the four Fashion-MNIST tasks; ``finetune-all``: the four image fine-tuning tasks;
    any other name: itself."""
    return list(GROUPS.get(group, (group,)))
