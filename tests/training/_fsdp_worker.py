"""One side of tests/training/test_fsdp.py, run by ``torchrun --nproc-per-node 2`` (gloo, CPU).

A converted model sharded with ``bayesify.training.shard`` against an unsharded copy of it, on every rank:
rank r trains on its own half of each batch with the draws of seed ``s + r``; the copy computes both halves
with the same seeds and averages their losses, which is what FSDP's gradient mean stands for. Loss, KL and
every gradient (gathered) must match, on the sampled and tiled routes, then the mixture evaluation,
``bayesify.uncertainty``, the gathered plain model and its merge. Exits non-zero on the first mismatch.
"""

import contextlib
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import bayesify
from bayesify.training import gather, shard


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, dict]:
    """The network (unconverted), a batch and its targets, and the options to convert it with."""
    torch.manual_seed(0)
    options = {"components": 4}
    if name == "vit":
        from timm.models.vision_transformer import VisionTransformer

        net = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
        x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    elif name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, tie_word_embeddings=False)
        net = GPT2LMHeadModel(config)
        options["class_axis"] = -1  # per-token logits [B, T, V]
        x = torch.randint(0, 64, (4, 8))
        y = torch.roll(x, -1, 1)
    elif name == "resnet":
        from torchvision.models import resnet18

        net = resnet18(num_classes=5)
        x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    else:
        raise SystemExit(f"unknown model {name}")
    # float64: after a few steps through a batch norm of 2 examples float32 drifts ~1e-3 apart by summation order
    return net.double(), (x.double() if x.is_floating_point() else x), y, options


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def check(what: str, a: torch.Tensor, b: torch.Tensor, atol: float = 1e-8) -> None:
    a, b = full(a).detach(), full(b).detach()
    if a.shape != b.shape or not torch.allclose(a, b, atol=atol, rtol=1e-6):
        diff = (a - b).abs().max().item() if a.shape == b.shape else f"shapes {a.shape} {b.shape}"
        raise SystemExit(f"rank {dist.get_rank()}: {what} differs: {diff}")


ROUTES = ["sample", "tile", None]


def main(name: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net, x, y, options = build(name)
    bayesify.convert(net, **options)
    with torch.no_grad():  # away from the prior, so the KL and its gradient are not ~0
        for pname, p in net.named_parameters():
            if "rank1" in pname:
                p.add_(0.3 * torch.randn_like(p))
    ref = copy.deepcopy(net)
    shard(net)
    assert any(isinstance(p, DTensor) for p in net.parameters()), "nothing was sharded"
    half = len(x) // world

    # the KL outside a forward pass: every table is sharded; counted once over the ranks, gradient included
    kl_ref, kl = bayesify.kl_divergence(ref), bayesify.kl_divergence(net)
    assert not isinstance(kl, DTensor), type(kl)
    check("KL before a forward pass", kl_ref, kl)
    kl_ref.backward()
    kl.backward()
    for (pname, p), (_, q) in zip(ref.named_parameters(), net.named_parameters()):
        if p.grad is not None or q.grad is not None:
            check(f"KL gradient of {pname}", p.grad, q.grad)
    ref.zero_grad(set_to_none=True)
    net.zero_grad(set_to_none=True)

    # SGD: a step linear in the gradient keeps float-level differences float-level (Adam's m / sqrt(v) turns the
    # sign of a ~1e-9 gradient into a step of lr, which a parity test cannot tell from a bug)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)

    def loss_of(model, xs, ys, seed, route):
        torch.manual_seed(seed)
        with bayesify.mode(model, route) if route else contextlib.nullcontext():
            out = logits_of(model(xs))
        targets = ys.repeat(out.shape[0] // len(ys), *([1] * (ys.dim() - 1)))
        return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, targets.flatten())

    for step, route in enumerate(ROUTES):
        seed = 100 + 10 * step
        nll_ref = sum(loss_of(ref, x[r * half : (r + 1) * half], y[r * half : (r + 1) * half], seed + r, route) for r in range(world)) / world
        total_ref = nll_ref + bayesify.kl_loss(ref, 50)
        total_ref.backward()
        nll = loss_of(net, x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half], seed + rank, route)
        total = nll + bayesify.kl_loss(net, 50)
        total.backward()
        mean_nll = nll.detach().clone()
        dist.all_reduce(mean_nll)
        check(f"step {step} ({route}) loss", nll_ref, mean_nll / world)
        check(f"step {step} ({route}) loss with KL", total_ref - nll_ref, total - nll)
        for (pname, p), (_, q) in zip(ref.named_parameters(), net.named_parameters()):
            assert (p.grad is None) == (q.grad is None), pname
            if p.grad is not None:
                check(f"step {step} ({route}) gradient of {pname}", p.grad, q.grad)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        with torch.no_grad():
            # every step starts the reference from the sharded model's own parameters: under FSDP a layer draws its
            # factors from its own (then unsharded) tables, the reference from the joined ones, the same ops on
            # other tensor sizes, equal to an ulp (vectorised vs scalar loops); batch norm over a few rows per
            # component amplifies an ulp ~1e5-fold a step, which a trajectory of steps cannot tell from a bug
            for p_ref, p in zip(ref.parameters(), net.parameters()):
                p_ref.copy_(full(p))

        with torch.no_grad():  # batch-norm statistics are per rank under FSDP (as under DDP): take the reference's
            for b_ref, b in zip(ref.buffers(), net.buffers()):
                b.copy_(b_ref)
        ref.eval()
        net.eval()
        with torch.no_grad():  # after every optimizer step: a cached folded weight must not outlive its weights
            check(f"step {step} mixture evaluation", logits_of(ref(x)), logits_of(net(x)))
        if step == 0:
            u_ref = bayesify.uncertainty(ref, x, noise=False)
            u = bayesify.uncertainty(net, x, noise=False)
            check("uncertainty: mutual information", u_ref.mutual_information, u.mutual_information)
            torch.manual_seed(7)
            u_ref = bayesify.uncertainty(ref, x, samples=2)
            torch.manual_seed(7)
            u = bayesify.uncertainty(net, x, samples=2)
            check("uncertainty with noise: predictive entropy", u_ref.predictive_entropy, u.predictive_entropy)
        ref.train()
        net.train()

    # a plain model back: gathered on rank 0, merged and compared with the reference's member
    try:
        bayesify.merge(net, component=1)
        raise SystemExit("merge of a sharded model did not refuse")
    except ValueError as error:
        assert "bayesify.training.gather" in str(error), error
    net.eval()
    with torch.no_grad(), bayesify.mode(net, component=1, noise=False):
        member_of_net = logits_of(net(x))  # what merge(component=1) must equal
    weights = {pname: full(p).detach().clone() for pname, p in net.named_parameters()}  # every rank gathers
    fresh = build(name)[0]
    plain = gather(net, lambda: bayesify.convert(fresh, **options))
    if rank == 0:
        got = dict(plain.named_parameters())
        assert got.keys() == weights.keys(), set(got) ^ set(weights)
        for pname, value in weights.items():
            assert torch.equal(got[pname], value), f"gathered {pname} is not the sharded model's"
        member = bayesify.merge(plain, component=1).eval()
        assert not bayesify.is_converted(member)
        with torch.no_grad():
            check("merged member of the gathered model", member_of_net, logits_of(member(x)))
    else:
        assert plain is None
    dist.barrier()
    dist.destroy_process_group()
    print(f"fsdp-worker {name} rank {rank}: ok", flush=True)
    # the rank's checks are done and said: leave without the interpreter's teardown, in which gloo's threads have
    # aborted a rank under load ("terminate called without an active exception", exit -6), failing a passed run
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
