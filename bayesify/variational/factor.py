"""One rank-1 factor (r or s) of a layer: K mixture components of a vector posterior."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesify.mixture import block_rows, component_rows
from bayesify.options import Init, Posterior
from bayesify.variational import distributions
from bayesify.variational.divergence import KLTerm, kl_divergence
from bayesify.variational.store import TableGroup

if TYPE_CHECKING:
    from bayesify.config import LayerOptions

__all__ = ["Rank1Factor", "sample_factors"]


class Rank1Factor(nn.Module):
    """A ``[components, features]`` table of variational posteriors over one factor.

    Each component ``k`` has ``loc[k]`` and (unless the posterior is ``delta``) a scale
    ``softplus(rho[k]) + 1e-7``. :meth:`sample` draws one vector per row of a batch, each row
    from the component it is routed through.

    Args:
        features: length of the factor (input channels for s, output channels for r).
        components: K, the model's number of mixture components.
        options: its layer's options (posterior, prior, initialisation, clipping: ``Rank1Config.layer_options()``).

    Example:
        >>> factor = Rank1Factor(16, 4, Rank1Config().layer_options())
        >>> factor.sample(torch.tensor([0, 3, 3]), noise=True).shape
        torch.Size([3, 16])
    """

    def __init__(
        self,
        features: int,
        components: int,
        options: LayerOptions,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.features = features
        self.options = options
        self.rank1_slot: tuple[TableGroup, int] | None = None  # (group, slot) in its model's groups drawn together
        shape = (components, features)
        self.loc = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if options.posterior is Posterior.DELTA:
            self.register_parameter("rho", None)
        else:
            self.rho = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def packed(self) -> bool:
        """Whether it is in one of its model's groups of tables drawn together (:mod:`bayesify.variational.store`)."""
        return self.__dict__.get("rank1_slot") is not None

    def grad(self, name: str = "loc") -> Tensor | None:
        """The gradient of this factor's ``loc`` (or ``rho``): ``factor.loc.grad``; None before any."""
        table = self._parameters.get(name)
        return None if table is None else table.grad

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.options
        identity = cfg.identity
        if cfg.init is Init.PRESERVE:
            self.loc.fill_(identity)
        elif cfg.init is Init.RANDOM_SIGN:
            # reference random_sign_init(p): +1 with probability p, else -1 (around 0 for additive)
            signs = torch.where(torch.rand_like(self.loc) < cfg.init_sign_p, 1.0, -1.0)
            self.loc.copy_(signs if identity == 1.0 else signs * cfg.init_mean_std)
        else:
            self.loc.normal_(identity, cfg.init_mean_std)
        if self.rho is not None:
            self.rho.fill_(distributions.raw_scale(cfg.initial_std))
            if cfg.init_jitter > 0:
                self.rho.add_(nn.init.trunc_normal_(torch.empty_like(self.rho), std=cfg.init_jitter))

    @property
    def scale(self) -> Tensor | None:
        """Posterior scale per component and entry (None for a delta posterior)."""
        return None if self.rho is None else distributions.scale(self.rho)

    def sample(self, rows: Tensor, noise: bool) -> Tensor:
        """One factor vector per row: ``[len(rows), features]``.

        Args:
            rows: component index of each row (``LongTensor`` of shape ``[n]``).
            noise: draw from the posterior (True) or take its location (False).
        """
        return sample_factors((self,), rows, noise)[0]

    def kl_term(self) -> KLTerm | None:
        """This factor's piece of the model's KL (None for a delta posterior). A factor in a group also names
        its ``(group, slot)``, so a model's KL joins a whole group in one op."""
        cfg = self.options
        if cfg.posterior is Posterior.DELTA:
            return None
        group, slot = self.rank1_slot if self.packed else (None, None)
        return KLTerm(cfg.posterior, cfg.prior, cfg.prior_mean, cfg.prior_std, self.loc, self.rho, group, slot)

    def kl_divergence(self) -> Tensor:
        """KL to the prior, summed over components and entries (as the reference)."""
        cfg = self.options
        return kl_divergence(cfg.posterior, self.loc, self.scale, cfg.prior, cfg.prior_mean, cfg.prior_std)

    def extra_repr(self) -> str:
        cfg = self.options
        return f"components={self.loc.shape[0]}, features={self.features}, posterior={cfg.posterior}, prior={cfg.prior}"


def sample_factors(factors: Sequence[Rank1Factor], rows: Tensor, noise: bool, blocks: tuple | None = None) -> list[Tensor]:
    """One value of each factor per row, ``[len(rows), features]`` each, drawn together (with ``blocks``,
    contiguous runs of rows covering them, ``rows`` are the blocks' components: still a value per row).

    Factors of one posterior family and clipping share one gather and one noise draw (a layer's
    ``s`` and ``r``): fewer, larger ops than one set per factor. The scale is computed on the
    ``[K, F]`` tables before the gather, which is cheaper than per row when the batch exceeds K;
    the gathers are :func:`~bayesify.mixture.component_rows` (and :func:`~bayesify.mixture.block_rows`).
    """
    first = factors[0]
    if any(
        f.options.posterior is not first.options.posterior or f.options.clip != first.options.clip or f.loc.dtype != first.loc.dtype
        for f in factors
    ):
        return [sample_factors((f,), rows, noise, blocks)[0] for f in factors]

    def entries(table: Tensor) -> Tensor:
        value = component_rows(rows, table)
        return value if blocks is None else block_rows(value, blocks)

    sizes = [f.features for f in factors]
    loc = entries(torch.cat([f.loc for f in factors], 1) if len(factors) > 1 else first.loc)
    if not noise or first.rho is None:
        return list(loc.split(sizes, 1))
    raw = torch.cat([f.rho for f in factors], 1) if len(factors) > 1 else first.rho
    value = distributions.rsample(first.options.posterior, loc, entries(distributions.scale(raw)))
    if first.options.clip is not None:
        # reference: heavy tails clipped to [-10, 10]. hardtanh is that clamp with a one-op backward (clamp's
        # takes six); they differ only at exactly +-clip, where hardtanh passes no gradient
        value = F.hardtanh(value, -first.options.clip, first.options.clip)
    return list(value.split(sizes, 1))
