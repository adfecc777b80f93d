"""A rank-1 BNN inside a Lightning ``LightningModule``: the KL term in ``training_step``, the mixture's metrics in
``validation_step``.

    python examples/lightning_digits.py            # a small CNN on sklearn digits, 20 epochs: ~1 min on a 2-core CPU
    python examples/lightning_digits.py --smoke    # a few seconds (what tests/test_example_lightning.py runs)

The LightningModule holds a network; for the rank-1 BNN that network is converted first, with
``bayesify.convert(net, task="classification")`` (a plain ``nn.Sequential`` does not say what its
output means, so bayesify asks). ``training_step`` adds the KL of the rank-1 factors per training
example, its weight warmed up linearly; ``validation_step`` runs in ``eval()``, where the converted
net returns the K-component mixture predictive (log mean softmax), and logs its NLL, accuracy
and ECE (15 bins). The same module without conversion is the deterministic baseline; both
are trained by ``L.Trainer(max_epochs=..., accelerator="cpu", logger=False,
enable_checkpointing=False)`` from the same initial weights, and ``trainer.validate`` gives the
table.

(The file is not called ``lightning.py``: Python puts a script's own directory first on
``sys.path``, so ``import lightning`` inside ``examples/lightning.py`` would import the script
itself.)
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassCalibrationError

import bayesify


def load() -> tuple[TensorDataset, TensorDataset]:
    """sklearn digits ``[N, 1, 8, 8]``, split 70/30 stratified, standardised with the training statistics."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target)
    train, test = train_test_split(range(len(labels)), test_size=0.3, stratify=digits.target, random_state=0)
    images = (images - images[train].mean()) / images[train].std()
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


class Classifier(L.LightningModule):
    """Trains ``net`` (plain or converted) with cross-entropy (+ the KL term when converted).

    Convert the inner network, not this LightningModule: bayesify routes every example through
    one mixture component for the whole forward pass with hooks on the module that was converted
    (its root). Converted as a whole, the root would be this module, but Lightning calls
    ``training_step`` / ``validation_step``, not its forward, so ``self.net(x)`` would run outside
    the root's forward: each layer would pick its own random component per row and eval would
    return no mixture, silently.
    """

    def __init__(self, net: nn.Module, train_size: int, lr: float) -> None:
        super().__init__()
        self.net, self.train_size, self.lr = net, train_size, lr
        self.val_ece = MulticlassCalibrationError(num_classes=10, n_bins=15, norm="l1")

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        nll = F.cross_entropy(self.net(x), y)  # training: one component per example, ~1x the cost
        loss = nll
        if bayesify.is_converted(self.net):
            kl = bayesify.kl_loss(self.net, self.train_size, step=self.global_step, warmup_steps=self.trainer.estimated_stepping_batches // 2)
            loss = nll + kl
            self.log("kl", kl, batch_size=len(y))
        self.log("train_nll", nll, batch_size=len(y))
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        # eval: a converted net returns the mixture's log mean softmax (a plain one its logits);
        # cross-entropy and softmax read both alike, since log-probabilities are logits that are normalised
        out = self.net(x)
        self.val_ece.update(out.softmax(-1), y)
        self.log("val_nll", F.cross_entropy(out, y), batch_size=len(y))
        self.log("val_accuracy", (out.argmax(-1) == y).float().mean(), batch_size=len(y))
        self.log("val_ece", self.val_ece, batch_size=len(y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--components", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="3 steps, 2 validation batches: checks it runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # in-memory tensors need none
    warnings.filterwarnings("ignore", ".*treespec, LeafSpec.*is deprecated.*")  # Lightning's, under torch 2.14
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available: False" lines

    train_set, val_set = load()
    train_loader = DataLoader(train_set, batch_size=args.batch, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=256)
    torch.manual_seed(0)
    deterministic = make_net()
    rank1 = bayesify.convert(copy.deepcopy(deterministic), components=args.components, task="classification")
    print(bayesify.summary(rank1, val_set.tensors[0][:2]))
    print()

    rows = {}
    for name, net in (("deterministic", deterministic), ("rank-1 BNN", rank1)):
        L.seed_everything(0, verbose=False)  # the same batches for both
        module = Classifier(net, len(train_set), args.lr)
        trainer = L.Trainer(
            max_epochs=1 if args.smoke else args.epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            limit_train_batches=3 if args.smoke else None, limit_val_batches=2 if args.smoke else None,
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(module, train_loader, val_loader)
        seconds = time.perf_counter() - start
        (metrics,) = trainer.validate(module, val_loader, verbose=False)
        rows[name] = (metrics["val_nll"], metrics["val_accuracy"], metrics["val_ece"], seconds)

    evaluated = min(len(val_set), 2 * 256) if args.smoke else len(val_set)
    length = "3 steps" if args.smoke else f"{args.epochs} epochs"
    print(
        f"sklearn digits ({len(train_set)} train / {evaluated} validation), CNN, {length}, "
        f"K={args.components} (rank-1: the mixture of its components, one sample each)"
    )
    print(f"{'model':<16}" + "".join(f"{h:>10}" for h in ("NLL", "accuracy", "ECE", "seconds")))
    for name, values in rows.items():
        print(f"{name:<16}" + "".join(f"{v:>10.4f}" for v in values[:-1]) + f"{values[-1]:>10.1f}")


if __name__ == "__main__":
    main()
