"""bayesify in a training loop you already have: the diff is the convert line and the KL term.

    python examples/drop_in_loop.py            # a small CNN on sklearn digits, plain and rank-1, ~1 min on a CPU
    python examples/drop_in_loop.py --smoke    # a few seconds (the test runs this)

The same hand-written loop (Adam, cross-entropy, shuffled minibatches) trains the same network twice
from the same weights. The rank-1 run differs in exactly two places, marked ``# bayesify``:

1. ``bayesify.convert(net, task="classification")`` after building the network (a custom network
   says what its output is; timm / torchvision / Hugging Face models say it themselves);
2. ``+ bayesify.kl_loss(net, len(train_set), step=step, warmup_steps=...)`` in the loss: the KL of
   the rank-1 posteriors per training example, warmed up over the first 2/3 of training.

Evaluation is the loop's own ``net.eval()`` forward: the converted net returns the mixture's
log-probabilities in the shape the plain net's logits had, so the same cross-entropy and argmax
give the mixture's NLL and accuracy. Both nets get the same test-set NLL / accuracy / ECE.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

import bayesify
from bayesify.evaluation.metrics import expected_calibration_error
from bayesify.zoo.data import load_data


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


def train(net: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, bayesian: bool, seed: int) -> float:
    """The user's loop. Returns the training seconds."""
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(seed)  # the same data order for both runs
    steps_per_epoch = (len(x) + 63) // 64
    total = epochs * steps_per_epoch
    start, step = time.perf_counter(), 0
    for _ in range(epochs):
        net.train()
        for batch in torch.randperm(len(x), generator=generator).split(64):
            loss = F.cross_entropy(net(x[batch]), y[batch])
            if bayesian:  # the KL term per training example, warmed up over 2/3 of training
                loss = loss + bayesify.kl_loss(net, len(x), step=step, warmup_steps=2 * total // 3)  # bayesify
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
    return time.perf_counter() - start


@torch.no_grad()
def test_metrics(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The loop's own evaluation: one eval-mode forward (the mixture, for the converted net)."""
    torch.manual_seed(0)
    log_probs = net.eval()(x).log_softmax(-1)  # the mixture's log-probabilities are already normalised
    return {
        "nll": float(F.nll_loss(log_probs, y)),
        "accuracy": float((log_probs.argmax(-1) == y).float().mean()),
        "ece": float(expected_calibration_error(log_probs.exp(), y)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="2 epochs on part of the data: a quick check")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    epochs = 2 if args.smoke else args.epochs

    data = load_data("digits")
    x_train, y_train = data.normalize(data.train.inputs), data.train.labels
    x_test, y_test = data.normalize(data.test.inputs), data.test.labels
    if args.smoke:
        x_train, y_train = x_train[:256], y_train[:256]

    torch.manual_seed(args.seed)
    plain = make_net()
    rank1 = bayesify.convert(copy.deepcopy(plain), task="classification")  # bayesify: the one-line conversion

    rows = {}
    for name, net, bayesian in (("deterministic", plain, False), ("rank-1 BNN", rank1, True)):
        torch.manual_seed(args.seed + 1)
        seconds = train(net, x_train, y_train, epochs=epochs, bayesian=bayesian, seed=args.seed)
        rows[name] = {**test_metrics(net, x_test, y_test), "seconds": seconds}

    print(f"sklearn digits, {len(x_train)} train / {len(x_test)} test, {epochs} epochs, the same loop and data order")
    print(f"{'model':<16}{'NLL':>8}{'accuracy':>10}{'ECE':>8}{'seconds':>9}")
    for name, m in rows.items():
        print(f"{name:<16}{m['nll']:>8.4f}{m['accuracy']:>10.4f}{m['ece']:>8.4f}{m['seconds']:>9.1f}")


if __name__ == "__main__":
    main()
