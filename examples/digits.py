"""The bayesify demo: deterministic vs rank-1 BNN on sklearn's handwritten digits (no download).

    make demo                    # or: python examples/digits.py [--epochs 30] [--components 4]

Trains a small CNN twice from the same initialisation, once as it is and once converted with
``bayesify.convert``, and prints test NLL / accuracy / ECE of both.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import bayesify


def make_data(seed: int) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)
    return x_tr, y_tr, x_te, y_te


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10),
    )  # fmt: skip


def ece(probs: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> float:
    conf, pred = probs.max(-1)
    edges = torch.linspace(0, 1, bins + 1)
    total = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (conf > lo) & (conf <= hi)
        if inside.any():
            total += inside.float().mean() * (conf[inside].mean() - (pred[inside] == labels[inside]).float().mean()).abs()
    return float(total)


def train(net: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, bayesian: bool) -> None:
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    steps_per_epoch = math.ceil(len(x) / 64)
    total_steps = epochs * steps_per_epoch
    step = 0
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(x))
        for i in range(0, len(x), 64):
            idx = order[i : i + 64]
            loss = F.cross_entropy(net(x[idx]), y[idx])
            if bayesian:  # ELBO: KL per training example, linearly annealed over 2/3 of training
                kl_scale = min(1.0, (step + 1) / (2 / 3 * total_steps))
                loss = loss + kl_scale * bayesify.kl_divergence(net) / len(x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1


@torch.no_grad()
def evaluate(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    log_probs = net.eval()(x).log_softmax(-1)  # a converted net returns the mixture predictive here
    return {
        "nll": float(F.nll_loss(log_probs, y)),
        "accuracy": float((log_probs.argmax(-1) == y).float().mean()),
        "ece": ece(log_probs.exp(), y),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--components", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = make_data(args.seed)
    deterministic = make_net()
    rank1 = make_net()
    rank1.load_state_dict(deterministic.state_dict())  # same starting point for both
    bayesify.convert(rank1, components=args.components, init="random_sign", init_sign_p=0.75, prior_std=0.1)
    print(bayesify.summary(rank1, x_te[:2]))
    print()

    results = {}
    for name, net, bayesian in (("deterministic", deterministic, False), ("rank-1 BNN", rank1, True)):
        torch.manual_seed(args.seed)
        train(net, x_tr, y_tr, args.epochs, bayesian)
        results[name] = evaluate(net, x_te, y_te)

    print(f"sklearn digits, {len(x_tr)} train / {len(x_te)} test, {args.epochs} epochs, K={args.components}")
    print(f"{'model':<16}{'NLL':>8}{'accuracy':>10}{'ECE':>8}")
    for name, m in results.items():
        print(f"{name:<16}{m['nll']:>8.4f}{m['accuracy']:>10.4f}{m['ece']:>8.4f}")


if __name__ == "__main__":
    main()
