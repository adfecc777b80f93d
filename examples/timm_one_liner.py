"""A timm model made Bayesian with one line, trained, and compared with the same net deterministic.

    python examples/timm_one_liner.py                    # resnet10t, 4 epochs: a few minutes on a 2-core CPU
    python examples/timm_one_liner.py --model resnet18   # any timm classifier
    python examples/timm_one_liner.py --smoke            # a few seconds (tests/test_example_timm_one_liner.py)

The data are scikit-learn's 8x8 handwritten digits (no download), upsampled to 16x16. The same
timm network (``num_classes=10, in_chans=1``) is trained twice from the same initialisation by the
same loop: once as it is, once after the one line

    bayesify.convert(model)

with the defaults, the same for a net trained from scratch as for a pretrained one. A timm model
states what its output is (class logits), so ``convert`` needs no ``task=``: the summary's
``output:`` line shows what bayesify read from the model.

After training, ``model.eval()`` makes the converted net return the K-component mixture
predictive in the shape the deterministic net returns (log mean softmax, usable as logits);
``bayesify.uncertainty(model, x)`` splits its predictive entropy into the members' expected entropy
and the mutual information (epistemic: the components' disagreement), shown here on the test
digits and on uniform-noise images the nets never saw.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import timm
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import bayesify
from bayesify.evaluation import evaluate


def load(size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Digits upsampled to ``size`` x ``size``, standardised with the training statistics (70/30 split),
    and as many uniform-noise images as test digits, standardised alike."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16  # [1797, 1, 8, 8] in [0, 1]
    labels = torch.tensor(digits.target)
    train, test = train_test_split(range(len(labels)), test_size=0.3, stratify=digits.target, random_state=0)
    noise = torch.rand(len(test), 1, 8, 8, generator=torch.Generator().manual_seed(0))
    images, noise = (F.interpolate(t, size=size, mode="bilinear", align_corners=False) for t in (images, noise))
    mean, std = images[train].mean(), images[train].std()
    images, noise = (images - mean) / std, (noise - mean) / std
    return images[train], labels[train], images[test], labels[test], noise


def train(
    model: nn.Module, x: Tensor, y: Tensor, *, epochs: int, batch: int, lr: float, max_steps: int | None
) -> float:
    """A plain loop (AdamW, one-cycle schedule); the converted net adds the KL term. Returns seconds."""
    torch.manual_seed(0)  # the same batches for both nets
    total = epochs * math.ceil(len(x) / batch)
    total = min(total, max_steps) if max_steps else total
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total)
    model.train()
    start, step = time.perf_counter(), 0
    while step < total:
        order = torch.randperm(len(x))
        for i in range(0, len(x), batch):
            idx = order[i : i + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            if bayesify.is_converted(model):
                loss = loss + bayesify.kl_loss(model, len(x), step=step, warmup_steps=total // 2)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            if step == total:
                break
    return time.perf_counter() - start


@torch.no_grad()
def entropies(model: nn.Module, x: Tensor, samples: int) -> tuple[float, float]:
    """Mean predictive entropy and mean mutual information (nats); a plain net has no MI (nan)."""
    model.eval()
    if not bayesify.is_converted(model):
        log_p = model(x).log_softmax(-1)
        return float(-(log_p.exp() * log_p).sum(-1).mean()), math.nan
    u = bayesify.uncertainty(model, x, samples=samples)  # K x samples members in one batched pass
    return float(u.predictive_entropy.mean()), float(u.mutual_information.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet10t", help="any timm classifier name")
    parser.add_argument("--size", type=int, default=16, help="image side after upsampling")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--components", type=int, default=4)
    parser.add_argument("--samples", type=int, default=1, help="posterior samples per component at evaluation (1: the means)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="3 steps and 64 test images: checks that it runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    max_steps = 3 if args.smoke else None

    x_train, y_train, x_test, y_test, noise = load(args.size)
    if args.smoke:
        x_test, y_test, noise = x_test[:64], y_test[:64], noise[:64]
    torch.manual_seed(0)
    deterministic = timm.create_model(args.model, num_classes=10, in_chans=1)
    model = copy.deepcopy(deterministic)  # the same initial weights for both

    model = bayesify.convert(model, components=args.components)  # the one line
    print(bayesify.summary(model, x_test[:2]))
    print()

    rows = {}
    for name, net in (("deterministic", deterministic), ("rank-1 BNN", model)):
        seconds = train(net, x_train, y_train, epochs=args.epochs, batch=args.batch, lr=args.lr, max_steps=max_steps)
        net.eval()
        with torch.no_grad():
            logits = net(x_test)  # converted: the mixture predictive, shaped as the plain net's logits
        assert logits.shape == (len(x_test), 10)
        metrics = evaluate(net, TensorDataset(x_test, y_test), samples=args.samples)
        rows[name] = (
            metrics["nll"], metrics["accuracy"], metrics["ece"],
            *entropies(net, x_test, args.samples), *entropies(net, noise, args.samples), seconds,
        )  # fmt: skip

    length = "3 steps" if args.smoke else f"{args.epochs} epochs"
    print(
        f"{args.model} on sklearn digits ({len(x_train)} train / {len(x_test)} test, {args.size}x{args.size}), "
        f"{length}, "
        f"K={args.components} components x {args.samples} samples; predictive entropy H and mutual information MI "
        "(nats) on the test digits and on uniform noise; seconds of training"
    )
    header = ("NLL", "accuracy", "ECE", "H(digits)", "MI(digits)", "H(noise)", "MI(noise)", "seconds")
    print(f"{'model':<16}" + "".join(f"{h:>11}" for h in header))
    for name, values in rows.items():
        cells = ["-" if math.isnan(v) else f"{v:.4f}" for v in values[:-1]] + [f"{values[-1]:.1f}"]
        print(f"{name:<16}" + "".join(f"{c:>11}" for c in cells))


if __name__ == "__main__":
    main()
