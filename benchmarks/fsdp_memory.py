"""Bytes per rank of a 7B-class causal LM trained with FSDP2, converted (K=4) against deterministic.

    python benchmarks/fsdp_memory.py                       # Llama-2-7B shapes, N = 1, 8, 64 ranks
    python benchmarks/fsdp_memory.py --ranks 1 8 64 512 --tokens 4096 --components 4

Nothing is allocated: the model is built on the meta device (``transformers.LlamaConfig``, the real shapes),
converted there, and every number is read from its Parameters' shapes and from the autograd graph of a
forward pass on the meta device. Per rank, with ``fully_shard`` on each decoder layer and the root (as
``bayesify.training.shard`` does; FSDP2 shards each Parameter by rows, padded to a multiple of N):

* weights, gradients: fp32, sharded; Adam: two fp32 moments, sharded;
* gathered: the largest working set of whole weights while a layer runs (the root's unit, which holds the
  embeddings and the head with its factors, plus two decoder layers, each with its own factors: the one running
  and the one prefetched), fp32;
* activations: the tensors autograd saves for the backward pass of one micro-batch of ``--tokens`` tokens
  (fp32; bf16 halves it), measured per layer from a 1- and a 2-layer model, times the number of layers. The
  count is an upper bound for the converted model: it holds the per-row path's scaled input ``x o s``, which
  bayesify recomputes in the backward pass instead (that recomputation stands aside under the counting hooks).
"""

from __future__ import annotations

import argparse
import math

import torch

import bayesify

GiB = 2**30


def build(layers: int, convert: bool, components: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(  # Llama-2-7B
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if convert:
        bayesify.convert(model, components=components)
    return model


def sharded_numel(shape: torch.Size, ranks: int) -> int:
    """Elements one rank holds of a Parameter sharded by rows over ``ranks`` (padded, as FSDP2 does)."""
    rows = shape[0] if len(shape) else 1
    return math.ceil(rows / ranks) * (math.prod(shape[1:]) if len(shape) > 1 else 1)


def units(model) -> list[list[torch.nn.Parameter]]:
    """The Parameters of each FSDP unit: one per decoder layer, then the root's (everything else)."""
    blocks = [list(layer.parameters()) for layer in model.model.layers]
    inside = {id(p) for block in blocks for p in block}
    return [*blocks, [p for p in model.parameters() if id(p) not in inside]]


def activation_bytes(components: int, convert: bool, tokens: int, layers: int) -> int:
    """Bytes autograd saves for one micro-batch, extrapolated from 1 and 2 layers to ``layers``."""

    def saved(n: int) -> int:
        model = build(n, convert, components).train()
        params = {id(p) for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(base) not in params:  # weights are counted as weights
                kept[id(base)] = max(kept.get(id(base), 0), t.numel() * t.element_size())
            return t

        x = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).logits.sum()
        return sum(kept.values())

    one, two = saved(1), saved(2)
    return one + (layers - 1) * (two - one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--components", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank per micro-batch")
    args = parser.parse_args()
    layers = 32
    models = {"deterministic": build(layers, False, args.components), f"rank-1, K={args.components}": build(layers, True, args.components)}
    acts = {name: activation_bytes(args.components, name != "deterministic", args.tokens, layers) for name in models}

    base_total = sum(p.numel() for p in models["deterministic"].parameters())
    converted = models[f"rank-1, K={args.components}"]
    rank1 = {id(p) for p in bayesify.rank1_parameters(converted)}
    factor_total = sum(p.numel() for p in converted.parameters() if id(p) in rank1)
    print(f"Llama-2-7B shapes on the meta device: {base_total / 1e9:.3f} B base parameters; rank-1 factors and bias "
          f"offsets at K={args.components}: {factor_total / 1e6:.2f} M ({100 * factor_total / base_total:.2f}%)")  # fmt: skip
    print(f"activations: {args.tokens} tokens per rank per micro-batch, fp32, no activation checkpointing\n")
    header = "| model | N ranks | weights | of which factors | gradients | Adam (fp32 m, v) | gathered (root + 2 layers) | activations | total |"
    print(header)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ranks in args.ranks:
        for name, model in models.items():
            ids = {id(p) for p in bayesify.rank1_parameters(model)} if name != "deterministic" else set()
            weights = sum(sharded_numel(p.shape, ranks) * 4 for p in model.parameters())
            factors = sum(sharded_numel(p.shape, ranks) * 4 for p in model.parameters() if id(p) in ids)
            grads, adam = weights, 2 * weights
            sizes = [sum(p.numel() * 4 for p in unit) for unit in units(model)]
            gathered = 0 if ranks == 1 else sizes[-1] + 2 * max(sizes[:-1])
            total = weights + grads + adam + gathered + acts[name]
            cells = [weights, factors, grads, adam, gathered, acts[name], total]
            print(f"| {name} | {ranks} | " + " | ".join(f"{c / GiB:.2f} GiB" if c >= 0.01 * GiB else f"{c / 2**20:.1f} MiB" for c in cells) + " |")
    # the factors: each layer's own [K, F] tables, sharded by rows with their block's unit (as above), or replicated
    # on every rank (ignored_params)
    tables = [p for p in converted.parameters() if id(p) in rank1]
    print("\nthe factors and bias offsets per rank, weights + gradients + Adam (16 bytes an entry):")
    for ranks in args.ranks:
        sharded = sum(sharded_numel(p.shape, ranks) for p in tables) * 16
        replicated = sum(p.numel() for p in tables) * 16
        print(f"  N={ranks}: sharded with their blocks {sharded / 2**20:.1f} MiB, replicated {replicated / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
