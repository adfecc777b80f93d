"""Fine-tuning a pretrained network into a rank-1 BNN: full fine-tuning vs a Bayesian adapter, side by side.

    python examples/finetune.py            # about 45 s on one CPU thread
    python examples/finetune.py --smoke    # a few seconds (tests/test_example_finetune.py runs this)

A small CNN is pretrained (deterministically) on clean sklearn digits (no download), then
fine-tuned on 300 digits of a shifted domain (lower contrast, brighter, noisier) and tested on
500 more of them, three ways, each from the same pretrained weights with the same batches and
number of steps:

* ``deterministic``: the network as it is, all parameters trained (the baseline);
* ``rank-1, full``: ``bayesify.convert(net, init="preserve")``, which keeps the pretrained
  function at the start (every factor's mean is 1), then all parameters trained with the KL term;
* ``rank-1 adapter``: the same conversion plus ``bayesify.freeze_base(net)``: the pretrained
  weights stay fixed, only the rank-1 parameters (factors and per-component bias offsets) train.

Printed for each: test NLL / accuracy / ECE (``bayesify.evaluation.evaluate``; the rank-1 models as
the mixture of their K members at their posterior means, the library's default, and again with
``--samples`` posterior samples per member), the trainable parameters and the fine-tuning time.
The optimiser gets its parameters from ``bayesify.training.param_groups`` (trainable ones only, no
weight decay on rank-1 ones); the weights train at ``--lr`` (1e-3), the rank-1 factors at
``--factor-lr`` (1e-2: they are O(1) scales), and the adapter, a small set, all at 1e-2.

Seed 0, one CPU thread::

                                          NLL  accuracy     ECE   trainable parameters       time
    pretrained, not fine-tuned         2.6805    0.4140  0.4161   -                             -
    deterministic                      0.4868    0.8780  0.0590   71,754 (100.0%)            1.3s
    rank-1, full                       0.4678    0.8800  0.0734   79,242 (110.4%)            3.7s
    rank-1, full, 4 samples            0.4318    0.8720  0.0448   (the same model)
    rank-1 adapter                     0.4266    0.8660  0.0625   7,488 (10.4%)              2.9s
    rank-1 adapter, 4 samples          0.4982    0.8600  0.1074   (the same model)

Over seeds 0, 1, 2 against the deterministic fine-tune: the full rank-1 fine-tune, sampled, has a
lower NLL on every seed (by 0.04-0.07) and a lower ECE (0.035-0.045 against 0.059-0.072); at its
means its NLL is lower by 0.01-0.02 and its ECE on 1 of 3. The adapter is best at its means (the
default): NLL lower by 0.06-0.07 on every seed, ECE lower on 2 of 3 (seed 0: 0.063 against 0.059);
sampled, it is worse: its
weights are frozen, so they never learned to absorb the factors' noise. Accuracy is within 3
points either way. So: evaluate an adapter at its means; after a full fine-tune, also try
``bayesify.predict(model, x, samples=4)``.

The costs: a rank-1 step costs ~3x a deterministic one on this tiny network (K=4 factor tables
per layer; the adapter saves the weights' gradients, not the forward pass); the adapter's
parameter share is 10% here because the network is tiny, 0.7% on a ResNet-18 (printed at the
end). The network has no batch norm; with one, note that ``freeze_base`` freezes parameters, not
the running statistics (see ``bayesify.freeze_base``).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import bayesify
from bayesify.evaluation import evaluate
from bayesify.training import param_groups

# the target domain (fine-tuning and test images): lower contrast, brighter, noisier (in units of the pixel std)
CONTRAST, BRIGHTNESS, NOISE = 0.4, 0.8, 0.3


@dataclass
class Split:
    pretrain: TensorDataset
    finetune: TensorDataset
    test: TensorDataset


def make_data(finetune_size: int, test_size: int, seed: int) -> Split:
    """sklearn digits (1797 8x8 images), standardised, split at random: pretrain / fine-tune / test."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, finetune, pretrain = order[:test_size], order[test_size:][:finetune_size], order[test_size + finetune_size :]
    mean, std = x[pretrain].mean(), x[pretrain].std()
    x = (x - mean) / std
    target = torch.cat([finetune, test])
    noise = torch.randn(x[target].shape, generator=torch.Generator().manual_seed(seed + 1))
    x[target] = CONTRAST * x[target] + BRIGHTNESS + NOISE * noise
    return Split(*(TensorDataset(x[i], y[i]) for i in (pretrain, finetune, test)))


def make_net(width: int) -> nn.Module:
    """A small CNN for 1x8x8 images (conv, conv, pool, two linear layers)."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def train(
    net: nn.Module,
    data: TensorDataset,
    *,
    epochs: int,
    lr: float,
    batch: int,
    seed: int,
    factor_lr_multiplier: float = 1.0,
) -> float:
    """Adam on cross-entropy (+ the annealed KL / N for a converted net); returns the seconds it took."""
    torch.manual_seed(seed)  # the same batches (and noise) for every variant
    # trainable parameters only (the adapter's rank-1 ones), no weight decay on rank-1 parameters
    optimizer = torch.optim.Adam(param_groups(net, lr=lr, fast_weight_lr_multiplier=factor_lr_multiplier))
    x, y = data.tensors
    steps = epochs * math.ceil(len(y) / batch)
    bayesian = bayesify.is_converted(net)
    net.train()
    start, step = time.perf_counter(), 0
    for _ in range(epochs):
        for rows in torch.randperm(len(y)).split(batch):
            loss = F.cross_entropy(net(x[rows]), y[rows])
            if bayesian:  # the KL per example, its weight rising to 1 over the first half of the steps
                loss = loss + bayesify.kl_loss(net, len(y), step=step, warmup_steps=max(1, steps // 2))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
    return time.perf_counter() - start


def trainable(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


def resnet18_adapter_share() -> str:
    """For scale: the adapter's share of a ResNet-18's parameters (counted, not trained)."""
    try:
        import timm
    except ImportError:
        return ""
    net = bayesify.convert(timm.create_model("resnet18", num_classes=10), task="classification")
    share = trainable(bayesify.freeze_base(net)) / sum(p.numel() for p in net.parameters())
    return f"(for scale: on a ResNet-18 the adapter trains {share:.1%} of the parameters)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-epochs", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=40, help="fine-tuning epochs")
    parser.add_argument("--finetune-size", type=int, default=300, help="target-domain examples to fine-tune on")
    parser.add_argument("--test-size", type=int, default=500)
    parser.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    parser.add_argument("--components", type=int, default=4, help="K, mixture components of the rank-1 models")
    parser.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate (Adam) of the weights")
    parser.add_argument("--factor-lr", type=float, default=1e-2, help="of the rank-1 factors, and of the adapter")
    parser.add_argument("--samples", type=int, default=4, help="posterior samples per component of the sampled rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (a network this small is fastest on one)")
    parser.add_argument("--smoke", action="store_true", help="one epoch of everything, tiny (a test, not a result)")
    args = parser.parse_args()
    if args.smoke:
        args.pretrain_epochs, args.epochs, args.width, args.samples = 1, 1, 4, 2

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = make_data(args.finetune_size, args.test_size, args.seed)
    pretrained = make_net(args.width)
    seconds = train(pretrained, data.pretrain, epochs=args.pretrain_epochs, lr=1e-3, batch=64, seed=args.seed)
    shift = f"contrast x{CONTRAST}, +{BRIGHTNESS}, noise {NOISE}"
    sizes = f"fine-tuning on {len(data.finetune)} and testing on {len(data.test)} shifted ones ({shift})"
    print(f"pretrained on {len(data.pretrain)} clean digits ({seconds:.1f} s); {sizes}\n")

    def rank1(adapter: bool) -> nn.Module:
        net = copy.deepcopy(pretrained)
        net = bayesify.convert(net, components=args.components, init="preserve", task="classification")
        return bayesify.freeze_base(net) if adapter else net

    full_lr = {"lr": args.lr, "factor_lr_multiplier": args.factor_lr / args.lr}
    variants = {  # name: (model, learning rates; None: not fine-tuned)
        "pretrained, not fine-tuned": (copy.deepcopy(pretrained), None),
        "deterministic": (copy.deepcopy(pretrained), full_lr),
        "rank-1, full": (rank1(adapter=False), full_lr),
        "rank-1 adapter": (rank1(adapter=True), {"lr": args.factor_lr}),  # a small set: one higher rate
    }
    total = sum(p.numel() for p in pretrained.parameters())
    print(f"{'':33s} {'NLL':>7s} {'accuracy':>9s} {'ECE':>7s}   {'trainable parameters':<24s} {'time':>6s}")

    def row(name: str, metrics: dict, cost: str = "", seconds: str = "") -> None:
        print(f"{name:33s} {metrics['nll']:7.4f} {metrics['accuracy']:9.4f} {metrics['ece']:7.4f}   "
              f"{cost:<24s} {seconds:>6s}")  # fmt: skip

    for name, (net, rates) in variants.items():
        if rates is None:
            row(name, evaluate(net, data.test, task="classification"), "-", "-")
            continue
        seconds = train(net, data.finetune, epochs=args.epochs, batch=32, seed=args.seed + 1, **rates)
        cost = f"{trainable(net):,} ({trainable(net) / total:.1%})"
        # the library's default evaluation: the mixture of the K members at their posterior means
        row(name, evaluate(net, data.test, task="classification"), cost, f"{seconds:.1f}s")
        if bayesify.is_converted(net) and args.samples > 1:  # the same model, M posterior samples per member
            row(f"{name}, {args.samples} samples", evaluate(net, data.test, samples=args.samples), "(the same model)")
    print(f"\nparameters of the network: {total:,}; the rank-1 models are K={args.components} mixtures, "
          f"at their posterior means and with {args.samples} samples per member. {resnet18_adapter_share()}")  # fmt: skip


if __name__ == "__main__":
    main()
