"""One side of tests/training/test_sharded_checkpoint.py: ``python _dcp_worker.py PHASE DIR``.

* ``save`` (torchrun, 2 ranks): a converted ViT sharded, 2 Adam steps, a distributed checkpoint, then step 3;
  rank 0 writes step 3's loss and the weights after it to ``DIR/expected.pt``.
* ``resume`` (torchrun, 2 ranks): a fresh sharded model and optimizer load the checkpoint and take step 3.
* ``single`` (one plain process, no process group): an unsharded model loads it and takes step 3 on both
  halves of the batch (FSDP's gradient mean over the 2 ranks).

Step 3 must equal the uninterrupted run's. Exits non-zero on the first difference.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bayesify
from _fsdp_worker import build, full, logits_of
from bayesify.training import shard
from bayesify.training.sharded_checkpoint import load_sharded, save_sharded

HALVES = 2  # the saving run's ranks: each takes its half of the batch, with the draws of seed + rank


def make(sharded: bool):
    net, x, y, options = build("vit")
    bayesify.convert(net, **options)
    if sharded:
        shard(net)
    return net, torch.optim.Adam(net.parameters(), lr=1e-3), x, y


def step(net, optimizer, x, y, number: int, halves: list[int]) -> torch.Tensor:
    """One optimizer step on the given halves of the batch; returns their mean loss (on this process)."""
    half = len(x) // HALVES
    losses = []
    for r in halves:
        torch.manual_seed(1000 * number + r)
        out = logits_of(net(x[r * half : (r + 1) * half]))
        losses.append(F.cross_entropy(out, y[r * half : (r + 1) * half]))
    loss = sum(losses) / len(losses)
    (loss + bayesify.kl_loss(net, 50)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def compare(got_loss, got_weights, directory: Path, atol: float) -> None:
    expected = torch.load(directory / "expected.pt")
    assert torch.allclose(got_loss, expected["loss"], atol=atol, rtol=0), (got_loss.item(), expected["loss"].item())
    assert got_weights.keys() == expected["weights"].keys()
    for name, value in expected["weights"].items():
        assert torch.allclose(got_weights[name], value, atol=atol, rtol=0), (name, (got_weights[name] - value).abs().max())


def main(phase: str, directory: Path) -> None:
    checkpoint = directory / "checkpoint.dcp"
    if phase == "single":
        net, optimizer, x, y = make(sharded=False)
        load_sharded(checkpoint, net, optimizer)
        loss = step(net, optimizer, x, y, 2, list(range(HALVES)))
        compare(loss, {n: p.detach() for n, p in net.named_parameters()}, directory, atol=1e-9)
        print("dcp-worker single: ok")
        return
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net, optimizer, x, y = make(sharded=True)
    if phase == "save":
        for number in range(2):
            step(net, optimizer, x, y, number, [rank])
        save_sharded(checkpoint, net, optimizer)
    else:
        load_sharded(checkpoint, net, optimizer)
    loss = mean_over_ranks(step(net, optimizer, x, y, 2, [rank]))
    weights = {n: full(p).detach() for n, p in net.named_parameters()}
    if rank == 0 and phase == "save":
        torch.save({"loss": loss, "weights": weights}, directory / "expected.pt")
    dist.barrier()
    if phase == "resume":
        compare(loss, weights, directory, atol=0.0)  # the same ops on the same values: bitwise
    dist.destroy_process_group()
    print(f"dcp-worker {phase} rank {rank}: ok", flush=True)
    # the rank's checks are done and said: leave without the interpreter's teardown, in which gloo's threads have
    # aborted a rank under load ("terminate called without an active exception", exit -6), failing a passed run
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
