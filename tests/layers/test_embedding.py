"""Gaussian variational embeddings (convert(..., embeddings=True)): off by default, torch's semantics at the mean."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bayesify

DT = torch.float64


class Bag(nn.Module):
    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(12, 4, **kwargs)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor | None = None, weights: torch.Tensor | None = None):
        return self.bag(x, offsets, per_sample_weights=weights)


def test_off_by_default_and_reported() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    bayesify.convert(model)
    assert type(model[0]) is nn.Embedding
    reason = bayesify.summary(model).skipped["0"]
    assert "embeddings=True" in reason


@pytest.mark.parametrize(
    "kwargs", [{}, {"padding_idx": 0}, {"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}]
)
def test_embedding_mean_is_torchs(kwargs: dict) -> None:
    reference = nn.Embedding(12, 4, **kwargs).to(DT)
    layer = bayesify.convert(copy.deepcopy(reference), embeddings=True)
    x = torch.randint(0, 12, (3, 5))
    with bayesify.mode(layer, noise=False):
        torch.testing.assert_close(layer(x), reference(x))
    layer.train()
    out = layer(x)
    assert out.shape == (3, 5, 4)
    out.square().sum().backward()
    assert layer.weight.grad is not None and layer.rank1_rho.grad is not None
    if kwargs.get("sparse"):  # the lookup's gradients stay sparse (the KL term's are dense: every row)
        assert layer.weight.grad.is_sparse and layer.rank1_rho.grad.is_sparse
        return
    bayesify.kl_divergence(layer).backward()
    if "padding_idx" in kwargs:
        torch.testing.assert_close(out[x == 0], reference.weight[0].expand_as(out[x == 0]))  # no noise on padding
        assert layer.weight.grad[0].abs().sum() == 0 and layer.rank1_rho.grad[0].abs().sum() == 0


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("layout", ["2d", "2d-weights", "padding"])
def test_embedding_bag_mean_is_torchs(mode: str, layout: str) -> None:
    if layout == "2d-weights" and mode != "sum":
        pytest.skip("per_sample_weights needs mode='sum' (torch)")
    kwargs = {"mode": mode, **({"padding_idx": 1} if layout == "padding" else {})}
    reference = Bag(**kwargs).to(DT)
    model = bayesify.convert(copy.deepcopy(reference), embeddings=True)
    args: tuple = (torch.randint(0, 12, (3, 4)),)
    if layout == "2d-weights":
        args = (*args, None, torch.rand(3, 4, dtype=DT))
    expected = reference(*args)
    with bayesify.mode(model, noise=False):
        torch.testing.assert_close(model(*args), expected)
    model.train()
    assert model(*args).shape == expected.shape


class _Recommender(nn.Module):
    """A dense input (the batch) and a bag of tokens per example in the flat form (1-D tokens and offsets)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag, self.dense, self.top = nn.EmbeddingBag(50, 8, mode="mean"), nn.Linear(4, 8), nn.Linear(16, 2)

    def forward(self, dense: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.top(torch.cat([self.dense(dense), self.bag(tokens, offsets)], 1))


@pytest.mark.parametrize("embeddings", [False, True])
def test_embedding_bags_of_flat_tokens_with_offsets_are_each_members_in_evaluation(embeddings: bool) -> None:
    # the pass tiled the offsets (one per example) and not the tokens: every member looked up the first member's
    # tokens at offsets out of order, a mixture 0.4 off, silently; a sampled predictive of Gaussian embeddings draws
    # a table per member for its own bags, which the flat form does not say: refused naming [B, L] tokens
    torch.manual_seed(0)
    model = bayesify.convert(_Recommender().to(DT), task="classification", embeddings=embeddings, init="normal",
                             init_mean_std=0.3)  # fmt: skip
    dense, tokens, offsets = torch.randn(3, 4, dtype=DT), torch.randint(1, 50, (6,)), torch.tensor([0, 2, 4])
    model.train()(dense, tokens, offsets).sum().backward()  # (the batch from the dense input: routed as any)
    model.eval()
    with torch.no_grad():
        out = model(dense, tokens, offsets)
        members = []
        for k in range(4):
            with bayesify.mode(model, component=k, noise=False):
                members.append(model(dense, tokens, offsets).softmax(-1))
    torch.testing.assert_close(out, torch.stack(members).mean(0).log())
    if embeddings:
        with pytest.raises(ValueError, match=r"got 1-D tokens with offsets in a sampled predictive .* \[B, L\] tokens"):
            bayesify.predict(model, dense, tokens, offsets, samples=2)


def test_one_table_sample_per_forward_with_the_posterior_std() -> None:
    layer = bayesify.convert(nn.Embedding(3, 2).to(DT), embeddings=True, init_std=0.5)
    x = torch.tensor([[0, 1, 0, 2, 0]])
    out = layer(x)
    torch.testing.assert_close(out[0, 0], out[0, 2])  # the same token, the same sample
    torch.testing.assert_close(out[0, 0], out[0, 4])
    draws = torch.stack([layer(torch.tensor([1]))[0] for _ in range(4000)])
    torch.testing.assert_close(draws.mean(0), layer.weight[1].detach(), atol=0.05, rtol=0)
    torch.testing.assert_close(draws.std(0), layer.rank1_std[1].detach(), atol=0.03, rtol=0)


def test_kl_is_the_normal_closed_form() -> None:
    layer = bayesify.convert(nn.Embedding(6, 3, padding_idx=2).to(DT), embeddings=True, embedding_prior_std=0.7)
    with torch.no_grad():
        layer.rank1_rho.normal_()
    mu, sigma, prior = layer.weight, layer.rank1_std, 0.7
    terms = torch.log(prior / sigma) + (sigma**2 + mu**2) / (2 * prior**2) - 0.5
    keep = torch.arange(6) != 2  # the padding row is deterministic: no KL
    torch.testing.assert_close(layer.kl_divergence(), terms[keep].sum())


def test_eval_mixture_and_revert() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 3))
    before = set(model.state_dict())
    bayesify.convert(model, embeddings=True, components=2, task="classification")
    x = torch.randint(0, 10, (5, 3))
    assert model.eval()(x).shape == (5, 3)
    assert "0.rank1_rho" in model.state_dict()
    bayesify.revert(model)
    assert set(model.state_dict()) == before and type(model[0]) is nn.Embedding


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_bad_prior_std(bad: float) -> None:
    with pytest.raises(ValueError, match="embedding_prior_std"):
        bayesify.convert(nn.Embedding(4, 2), embeddings=True, embedding_prior_std=bad)
    with pytest.raises(TypeError, match="embeddings"):
        bayesify.convert(nn.Linear(4, 2), embeddings="yes")  # type: ignore[arg-type]


class _Net(nn.Module):
    def __init__(self, bag: bool, padding_idx: int | None = None) -> None:
        super().__init__()
        make = nn.EmbeddingBag if bag else nn.Embedding
        self.embed = make(12, 4, padding_idx=padding_idx, **({"mode": "mean"} if bag else {}))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.embed, nn.EmbeddingBag):
            return self.head(self.embed(x, offsets))
        return self.head(self.embed(x).mean(1))


@pytest.mark.parametrize("layout", ["embedding", "bag-2d", "embedding-padding", "bag-padding"])
def test_a_sampled_predictive_draws_a_table_per_member(layout: str) -> None:
    """``uncertainty()`` / ``predict()`` run K x M members in one tiled pass: one table shared by them made the
    embeddings' posterior invisible in their disagreement (a model whose only Bayesian layer is an embedding:
    bit-identical members, a mutual information of exactly 0). Each member draws its own table; a token's vector
    is the same wherever it occurs in one member, and the padding row has no noise in any."""
    torch.manual_seed(0)
    padding = 1 if layout.endswith("padding") else None
    net = _Net(bag=layout.startswith("bag"), padding_idx=padding).to(DT)
    model = bayesify.convert(net, embeddings=True, init_std=0.3, include=["embed"], task="classification").eval()
    args = (torch.tensor([[0, 1, 2, 0], [3, 1, 4, 5], [6, 7, 1, 8]]),)
    members = bayesify.predict(model, *args, samples=3)  # [K * 3, B, classes]
    assert members.shape[0] == bayesify.num_components(model) * 3
    assert torch.unique(members, dim=0).shape[0] == members.shape[0]  # every member its own draw
    assert (bayesify.uncertainty(model, *args, samples=3).mutual_information > 0).all()
    if layout == "embedding-padding":
        seen = []
        handle = model.embed.register_forward_hook(lambda m, a, o: seen.append(o))
        bayesify.predict(model, *args, samples=3)
        handle.remove()
        out, x = seen[0], args[0].repeat(members.shape[0], 1)
        torch.testing.assert_close(out[x == padding], model.embed.weight[padding].expand_as(out[x == padding]))
        torch.testing.assert_close(out[0, 0], out[0, 3])  # token 0 twice in one member's row: one vector
        assert not torch.allclose(out[0, 0], out[3, 0])  # member 0's and member 1's first examples differ
