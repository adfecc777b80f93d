"""Gaussian variational embeddings for ``nn.Embedding`` and ``nn.EmbeddingBag`` (opt-in).

A converted layer but not a rank-1 one: as the paper's MIMIC-III model, every embedding vector gets a Normal
posterior ``N(w_i, diag(sigma_i^2))`` whose mean is the original (shared) weight row and whose
std ``sigma_i = softplus(rho_i) + 1e-7`` is learned (``rank1_rho``, one per entry), with a KL
to a ``Normal(0, embedding_prior_std)`` prior. Enabled by ``convert(model, embeddings=True)``;
by default embeddings stay deterministic.

Sampling: one sample of the embedding table per forward pass, drawn only for the rows the
batch looks up (edward2's ``EmbeddingReparameterization`` samples the whole table once per
call: the same distribution of outputs; so does this layer under ``torch.compile``, where the
data-dependent size of the rows used would break the graph). Every occurrence of a token in the
batch sees the same vector. The mixture components are not involved (a single Gaussian, shared by all members).
A sampled predictive (a tiled pass of K x M members in evaluation mode: ``uncertainty()``, ``predict()``,
OOD scores) draws a table per member, so the members' disagreement carries the embeddings' posterior too
(one table shared by the members gave a model whose only Bayesian layer is an embedding a mutual
information of exactly 0). ``mode(model, noise=False)`` uses the means, i.e. the original embedding.

``padding_idx`` rows stay deterministic (no noise, no KL, no gradient, as torch's);
``max_norm``, ``scale_grad_by_freq``, ``sparse`` (sparse gradients for weight and rho),
``mode`` / ``per_sample_weights`` / ``offsets`` / ``include_last_offset`` of EmbeddingBag are
torch's own (the KL term covers every row, so its gradient is dense even with ``sparse=True``).

References:
    Dusenberry et al., ICML 2020, Sec. 5.4 (MIMIC-III: "Gaussian variational embeddings");
    edward2 ``EmbeddingReparameterization``.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesify.config import LayerOptions
from bayesify.layers.base import ConvertedLayer
from bayesify.options import Posterior, Prior
from bayesify.variational import distributions
from bayesify.variational.divergence import KLTerm

__all__ = ["GaussianEmbedding"]


# nn.EmbeddingBag's flat form (1-D tokens, one offset per bag) in a sampled predictive: each member draws a table for
# its own bags, which the flat tokens do not say
_FLAT_BAGS = (
    "{name} got 1-D tokens with offsets in a sampled predictive (a table drawn per member, for its own bags): pass "
    "[B, L] tokens, padded with the layer's padding_idx, or evaluate at the posterior means (noise=False)."
)


class GaussianEmbedding(ConvertedLayer):
    """``nn.Embedding`` / ``nn.EmbeddingBag`` with a Normal over each embedding vector.

    Example:
        >>> model = bayesify.convert(model, embeddings=True, embedding_prior_std=1.0)
        >>> model.embed.rank1_std           # per-entry posterior std, [num_embeddings, dim]

    References:
        Dusenberry et al., ICML 2020, Sec. 5.4; edward2 ``EmbeddingReparameterization``.
    """

    def rank1_setup(self, options: LayerOptions) -> None:
        weight = self._parameters["weight"]
        self.rank1_rho = nn.Parameter(torch.full_like(weight, distributions.raw_scale(options.initial_std)))

    def rank1_reset(self) -> None:
        self.rank1_rho.fill_(distributions.raw_scale(self.rank1_state.options.initial_std))

    @property
    def rank1_std(self) -> Tensor:
        """Posterior std of every entry of the table, ``[num_embeddings, embedding_dim]``."""
        return distributions.scale(self.rank1_rho)

    def _rank1_noisy_rows(self) -> Tensor | None:
        padding = self.padding_idx
        if padding is None:
            return None
        keep = torch.ones(self.num_embeddings, dtype=torch.bool, device=self.rank1_rho.device)
        keep[padding] = False
        return keep

    def rank1_kl_terms(self) -> Iterator[KLTerm]:
        """KL(N(w, sigma^2) || N(0, prior_std^2)) of every entry (the padding row excluded)."""
        self.rank1_check()  # a table resized since conversion: rank1_rho is not of its shape
        weight, rho = self._parameters["weight"], self.rank1_rho
        keep = self._rank1_noisy_rows()
        if keep is not None:
            weight, rho = weight[keep], rho[keep]
        yield KLTerm(Posterior.NORMAL, Prior.NORMAL, 0.0, self.rank1_options.embedding_prior_std, weight, rho)

    def rank1_merge(self, component: int) -> dict[str, Tensor]:
        """Nothing changes: the posterior mean of every vector is the original weight (one Gaussian,
        shared by all components)."""
        return {}

    def forward(self, input: Tensor, *args: object, **kwargs: object) -> Tensor:
        self.rank1_check()  # (it asks for no draw, where the other families are checked)
        base = type(self).__rank1_base__
        router = self.rank1_state.model.router
        if not router.noise_for(self.training):
            return base.forward(self, input, *args, **kwargs)
        if isinstance(self, nn.EmbeddingBag) and input.dim() == 1 and router.tiles > 1:
            # (a table per member, each for its own bags: the flat form's tokens are not the members' rows)
            raise ValueError(_FLAT_BAGS.format(name=router.layer_name(self)))
        if torch.compiler.is_compiling() and not self.sparse:
            return self._rank1_lookup(input, self._rank1_sampled_table(input), self.padding_idx, args, kwargs)
        weight = self._parameters["weight"]
        # one sample of the rows this batch uses: gather them (torch's own renorm / padding / sparse
        # gradient rules), add noise, and look the batch up in that small sampled table
        unique, inverse = torch.unique(input, return_inverse=True)
        means = F.embedding(unique, weight, self.padding_idx, self.max_norm, self.norm_type, False, self.sparse)
        std = distributions.scale(F.embedding(unique, self.rank1_rho, sparse=self.sparse))
        padding = None
        if self.padding_idx is not None:
            is_pad = unique == self.padding_idx
            std = std * (~is_pad).unsqueeze(1).to(std.dtype)
            hit = torch.nonzero(is_pad)
            padding = int(hit[0, 0]) if hit.numel() else None
        members = self._rank1_members(input)
        if members is None:
            table = means + std * torch.randn_like(means)
            return self._rank1_lookup(inverse, table, padding, args, kwargs)
        # a table per member: member j's rows look up in its own block of the [m * U, D] sampled table
        count, used = self.rank1_state.model.router.state.members, means.shape[0]
        table = (means + std * torch.randn(count, *means.shape, dtype=means.dtype, device=means.device)).flatten(0, 1)
        index = inverse + members * used
        if padding is not None:  # (no noise there: every member's padding row is the first's, which the lookup names)
            index = torch.where(inverse == padding, inverse, index)
        return self._rank1_lookup(index, table, padding, args, kwargs)

    def _rank1_members(self, input: Tensor) -> Tensor | None:
        """In a sampled predictive (a tiled pass of several members, in evaluation mode), the member of every index
        of ``input`` (member-major: member j's are the batch's j-th run of examples), else None. (The layer's mode,
        not the grad mode: a reentrant checkpoint's forward runs without gradients, its recomputation with them.)"""
        router = self.rank1_state.model.router
        state = router.state
        if self.training or not router.live() or state is None or state.members <= 1 or state.axis is None:
            return None
        rows = state.members * state.batch
        axis = min(state.axis, input.dim() - 1)
        if input.dim() == 0 or input.shape[axis] != rows:  # (a flat EmbeddingBag input: its bags are not the rows)
            return None
        shape = [1] * input.dim()
        shape[axis] = rows
        member = torch.arange(rows, device=input.device) // state.batch
        return member.view(shape).expand_as(input)

    def _rank1_sampled_table(self, input: Tensor) -> Tensor:
        """One sample of the whole table: what ``forward`` draws under ``torch.compile``, where the rows
        the batch uses (``torch.unique``, of a data-dependent size) would break the graph. The same
        distribution of outputs, at the cost of noise for every row."""
        weight = self._parameters["weight"]
        if self.max_norm is not None:  # torch's in-place renorm of the rows the batch uses, as F.embedding does
            with torch.no_grad():
                torch.embedding_renorm_(weight, input, self.max_norm, self.norm_type)
        std = distributions.scale(self.rank1_rho)
        keep = self._rank1_noisy_rows()
        if keep is not None:
            std = std * keep.unsqueeze(1).to(std.dtype)
        return weight + std * torch.randn_like(weight)

    def _rank1_lookup(self, indices: Tensor, table: Tensor, padding: int | None, args: tuple, kwargs: dict) -> Tensor:
        """The layer's own lookup (and bag reduction) of ``indices`` in a sampled ``table``."""
        if isinstance(self, nn.EmbeddingBag):
            offsets = args[0] if args else kwargs.get("offsets")
            per_sample_weights = args[1] if len(args) > 1 else kwargs.get("per_sample_weights")
            return F.embedding_bag(
                indices, table, offsets, None, self.norm_type, self.scale_grad_by_freq, self.mode, False,
                per_sample_weights, self.include_last_offset, padding,
            )  # fmt: skip
        return F.embedding(indices, table, padding, None, self.norm_type, self.scale_grad_by_freq, False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gaussian (prior std {self.rank1_options.embedding_prior_std})"
