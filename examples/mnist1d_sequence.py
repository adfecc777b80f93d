"""A recurrent classifier on MNIST-1D, deterministic vs rank-1 BNN (no download: mnist1d generates it).

    python examples/mnist1d_sequence.py                       # GRU, 60 epochs, K=4, seed 0
    python examples/mnist1d_sequence.py --seeds 0 1 2         # three seeds
    python examples/mnist1d_sequence.py --cell lstm
    python examples/mnist1d_sequence.py --smoke               # seconds: 1 epoch, hidden 16 (the test runs this)

Each MNIST-1D signal (40 samples) is read as a sequence of 40 steps of 1 feature by a
bidirectional recurrent layer followed by a linear head. The same network is trained twice from
the same initialisation, with the same optimiser, steps and batches: once as it is, once
converted with ``bayesify.convert`` and its defaults (rank-1 factors on the recurrent input /
hidden kernels and the head, samples held across the sequence). Test NLL / accuracy / ECE of both
are printed; the rank-1 model is evaluated as the mixture of its K members (its default in ``eval()``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import bayesify
from bayesify.evaluation.metrics import compute_metrics, member_log_probs_from_logits


def make_data(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = seed
    data = make_dataset(args)
    x, x_test = torch.tensor(data["x"], dtype=torch.float32), torch.tensor(data["x_test"], dtype=torch.float32)
    mean, std = x.mean(), x.std()
    x, x_test = (x - mean) / std, (x_test - mean) / std
    return x.unsqueeze(-1), torch.tensor(data["y"]), x_test.unsqueeze(-1), torch.tensor(data["y_test"])


class SequenceClassifier(nn.Module):
    """``[B, 40, 1]`` signals -> bidirectional GRU / LSTM -> last states of both directions -> 10 logits."""

    def __init__(self, cell: str, hidden: int) -> None:
        super().__init__()
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = rnn(1, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, 10)

    def forward(self, x: Tensor) -> Tensor:
        _, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state  # [2, B, hidden]
        return self.head(torch.cat([h[0], h[1]], -1))


def train(net: nn.Module, x: Tensor, y: Tensor, epochs: int, batch: int, lr: float, bayesian: bool, seed: int) -> None:
    torch.manual_seed(seed)  # the same batches for both models
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    total = epochs * math.ceil(len(x) / batch)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total)
    step = 0
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(x))
        for i in range(0, len(x), batch):
            idx = order[i : i + batch]
            loss = F.cross_entropy(net(x[idx]), y[idx])
            if bayesian:  # ELBO: KL per training example, linearly annealed over 2/3 of training (reference)
                loss = loss + bayesify.kl_loss(net, len(x), step=step, warmup_steps=2 * total // 3)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            optimizer.step()
            schedule.step()
            step += 1


@torch.no_grad()
def evaluate(net: nn.Module, x: Tensor, y: Tensor) -> dict[str, float]:
    net.eval()
    if bayesify.is_converted(net):
        members = bayesify.predict(net, x)  # [K, N, 10]: every component at its posterior means
        components = members.shape[0]
    else:
        members, components = net(x).unsqueeze(0), 1
    metrics = compute_metrics(member_log_probs_from_logits(members), y, components=components, members=False)
    return {k: float(v) for k, v in metrics.items() if k in ("nll", "accuracy", "ece")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", choices=["gru", "lstm"], default="gru")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--components", type=int, default=4)
    parser.add_argument("--prior-std", type=float, default=None, help="default: convert()'s (scaled to the depth)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="1 epoch of a 16-unit network: checks that it runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.epochs, args.hidden = 1, 16

    rows: dict[str, list[dict[str, float]]] = {"deterministic": [], "rank-1 BNN": []}
    start = time.time()
    for seed in args.seeds:
        x_tr, y_tr, x_te, y_te = make_data(seed)
        torch.manual_seed(seed)
        deterministic = SequenceClassifier(args.cell, args.hidden)
        rank1 = SequenceClassifier(args.cell, args.hidden)
        rank1.load_state_dict(deterministic.state_dict())  # the same starting point for both
        bayesify.convert(rank1, components=args.components, prior_std=args.prior_std)  # otherwise the defaults
        if seed == args.seeds[0]:
            print(bayesify.summary(rank1, x_te[:2]))
            print()
        for name, net, bayesian in (("deterministic", deterministic, False), ("rank-1 BNN", rank1, True)):
            train(net, x_tr, y_tr, args.epochs, args.batch, args.lr, bayesian, seed)
            rows[name].append(evaluate(net, x_te, y_te))
            print(f"seed {seed} {name:<14} " + "  ".join(f"{k} {v:.4f}" for k, v in rows[name][-1].items()), flush=True)

    print()
    print(
        f"MNIST-1D ({len(x_tr)} train / {len(x_te)} test), bidirectional {args.cell.upper()} hidden {args.hidden}, "
        f"{args.epochs} epochs, batch {args.batch}, K={args.components}, seeds {args.seeds} "
        f"({time.time() - start:.0f} s)"
    )
    print(f"{'model':<16}{'NLL':>16}{'accuracy':>18}{'ECE':>18}")
    for name, results in rows.items():
        cells = []
        for key in ("nll", "accuracy", "ece"):
            values = [r[key] for r in results]
            spread = f" +- {statistics.stdev(values):.4f}" if len(values) > 1 else ""
            cells.append(f"{statistics.mean(values):.4f}{spread}")
        print(f"{name:<16}" + "".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
