"""Rank-1 ``nn.Bilinear``: ``y = r o ((x1 o s1)^T W (x2 o s2)) + b + delta_k``.

The weight ``W [out, in1, in2]`` is a 3-way tensor; its rank-1 perturbation
``W' = W o (r (x) s1 (x) s2)`` scales each of its three axes, the direct analogue of
``W o (r s^T)`` for a matrix, and it is exact per example by scaling both inputs and the
output. Additive variant: ``((x1 + s1)^T W (x2 + s2)) + r + b``.

References:
    Dusenberry et al., ICML 2020, Eq. 1 (rank-1 factors on every weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from bayesify.config import Rank1Config
from bayesify.options import Perturbation
from bayesify.wrappers.base import Rank1Layer

__all__ = ["Rank1Bilinear"]


class Rank1Bilinear(Rank1Layer):
    """Rank-1 ``nn.Bilinear``: factors ``rank1_s1`` (in1), ``rank1_s2`` (in2), ``rank1_r`` (out).

    The batch axis is the conversion's ``batch_dim`` capped at ``x1.dim() - 2``, as for Linear;
    1-d inputs are one unbatched example.

    References:
        Dusenberry et al., ICML 2020.
    """

    source_types = (nn.Bilinear,)
    _rank1_intercepted = ("weight",)

    def _rank1_setup(self, config: Rank1Config) -> None:
        self.rank1_s1 = self._rank1_new_factor(self.in1_features, config)
        self.rank1_s2 = self._rank1_new_factor(self.in2_features, config)
        self.rank1_r = self._rank1_new_factor(self.out_features, config)
        bias = self._parameters.get("bias")
        if bias is not None:
            self.rank1_bias = nn.Parameter(torch.zeros(config.components, self.out_features, dtype=bias.dtype, device=bias.device))
        else:
            self.register_parameter("rank1_bias", None)

    def _rank1_batch_axis(self, x1: Tensor) -> int | None:
        return None if x1.dim() < 2 else min(self._rank1_context.batch_dim, x1.dim() - 2)

    def _rank1_input_axes(self, args: tuple, kwargs: dict) -> list[int | None]:
        # used as the model: both inputs carry the batch (an unbatched pair gets its members at axis 0)
        x1 = args[0] if args else kwargs["input1"]
        axis = self._rank1_batch_axis(x1)
        return [0 if axis is None else axis] * len(tree_flatten((args, kwargs))[0])

    def forward(self, input1: Tensor, input2: Tensor) -> Tensor:
        axis = self._rank1_batch_axis(input1)
        n = 1 if axis is None else input1.shape[axis]
        rows, noise = self._rank1_rows(n, input1.device)

        def shaped(v: Tensor, like: Tensor) -> Tensor:  # [n, F] -> broadcastable against like [..., F]
            if axis is None:
                return v[0].to(like.dtype)
            shape = [1] * like.dim()
            shape[axis], shape[-1] = v.shape[0], v.shape[1]
            return v.to(like.dtype).reshape(shape)

        additive = self.rank1_config.perturbation is Perturbation.ADDITIVE
        s1, s2 = shaped(self.rank1_s1.sample(rows, noise), input1), shaped(self.rank1_s2.sample(rows, noise), input2)
        x1, x2 = (input1 + s1, input2 + s2) if additive else (input1 * s1, input2 * s2)
        out = F.bilinear(x1, x2, self._parameters["weight"])
        r = shaped(self.rank1_r.sample(rows, noise), out)
        out = out + r if additive else out * r
        bias = self._parameters.get("bias")
        if bias is not None:
            out = out + bias.to(out.dtype) + shaped(self.rank1_bias[rows], out)
        return out
