"""Rank-1 layers computing ``W x + b`` with input and output channels: the base of Linear and Conv.

Per row e, routed through component k(e): ``y = ((x o s_e) W^T) o r_e + b + delta_k`` (see
:func:`~bayesify.layers.rank1_op.rank1_affine`). A subclass whose class overrides ``forward``
(timm's ``StdConv2d`` weight standardisation, ``Conv2dSame`` padding, ...) keeps running its own
forward on the perturbed input; the bias it adds is accounted for.
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from bayesify.config import LayerOptions
from bayesify.layers._intercept import split_call
from bayesify.layers.base import Draw, Rank1Layer, computed, layer_bias
from bayesify.layers.folded import fold_weight, fold_weights, rank1_folded, run_blocks
from bayesify.layers.rank1_op import KnownMap, rank1_affine, with_bias
from bayesify.options import Perturbation, Sampling
from bayesify.predictive.libraries import WEIGHT_AS_IS

__all__ = ["Fold", "Rank1Affine"]


def _concrete(size: int) -> bool:
    """Whether ``size`` is a number where it is traced, not a symbol of a dynamic shape. (Dynamo answers a type
    check of a symbolic size as of an int; a symbol's parity is not known, whatever range it is given.)"""
    return statically_known_true(size % 2 == 0) or statically_known_true(size % 2 == 1)


def _members_fixed(draw: Draw) -> bool:
    # the posterior means of members the route fixes, outside a traced graph (whose weights are symbolic)
    return (
        not draw.noise
        and draw.fixed_components is not None
        and draw.blocks is not None
        and not torch.compiler.is_compiling()
        and not isinstance(draw.rows, torch._subclasses.FakeTensor)
    )


def _left_out(offset: Tensor | None, used: bool) -> Tensor | None:
    """``offset``, or where the call leaves the bias offsets out, zero times it: in the graph still, so that every
    parameter takes a gradient (DistributedDataParallel waits for each), a zero one."""
    return offset if used or offset is None else offset * 0


def _pick(table: Tensor, components: tuple[int, ...]) -> Tensor:
    """Rows ``components`` of a per-component table: a view when they are consecutive (the usual 0..K-1,
    or one fixed component), else a gathered copy."""
    first = components[0]
    if list(components) == list(range(first, first + len(components))):
        return table if len(components) == table.shape[0] else table.narrow(0, first, len(components))
    return table[list(components)]


class Fold(NamedTuple):
    """How a layer runs with a given weight: ``apply(x, weight, bias)``, its groups and weight layout. (A named
    tuple: one is made every call, and Dynamo traces a named tuple's constructor in a few lines.)"""

    weight: Tensor
    apply: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    groups: int = 1
    transposed: bool = False  # weight stored [in, out] (Hugging Face Conv1D)
    dense: bool = False  # apply is the plain dense map on the last axis: blocks run as one batched matmul


class Rank1Affine(Rank1Layer):
    """Base of layers computing ``W x + b`` with input channels and output channels.

    A family implements :meth:`rank1_features`, :meth:`rank1_axes` and :meth:`rank1_core`.
    """

    rank1_intercepted = ("weight",)
    # a stem (a layer whose input takes no gradient: the network's first) folds whenever its rows run in blocks
    # and its input factor s trains (sampling="auto"): the per-row path would take a gradient of the input, for s's,
    # that the original never takes, which for a convolution is a second convolution as costly as the forward (CPU, ViT-tiny's stride-16
    # patch embedding, B=32, 32 px: 12.4 ms a step per row against 7.6 ms folded, the original 2.3; at 224 px 224
    # against 70 and 47). A stem has few input channels, so its K folded weights are small.
    rank1_stem_folds: bool = False
    # the base forwards whose maths we know, so the bias can be left out instead of subtracted
    rank1_known_forwards: tuple[Callable, ...] = ()

    def rank1_features(self) -> tuple[int, int]:
        """``(input channels, output channels)``."""
        raise NotImplementedError

    def rank1_axes(self, x: Tensor) -> tuple[int | None, int]:
        """``(batch axis or None if unbatched, channel axis)`` of an input of this layer."""
        raise NotImplementedError

    def rank1_output_numel(self, x: Tensor) -> int:
        """How many values this layer's output holds for input ``x`` (what the per-row path scales): the input's
        positions times the output channels; a family whose maps change the positions (a strided convolution)
        says so."""
        fan_in, fan_out = self.rank1_features()
        return x.numel() // max(fan_in, 1) * fan_out

    def rank1_core(self, x: Tensor) -> Tensor:
        """``W x`` without bias, for a base class whose forward is in :attr:`rank1_known_forwards`."""
        raise NotImplementedError

    def rank1_known_map(self, x: Tensor) -> KnownMap | None:
        """:meth:`rank1_core` for input ``x`` with its backward written out (see
        :class:`~bayesify.layers.rank1_op.KnownMap`), or None (the default: autograd differentiates the core)."""
        return None

    def rank1_batch_axis(self, x: Tensor) -> int | None:
        return self.rank1_axes(x)[0]

    def rank1_merged_weight(self, weight: Tensor, r: Tensor, s: Tensor) -> Tensor:
        """``W o (r s^T)`` in this layer's weight layout (default: torch's ``[out, in / groups, ...]``)."""
        return fold_weight(weight, r, s, groups=self._rank1_groups())

    def rank1_constant_response(self, weight: Tensor, s: Tensor) -> Tensor:
        """``core(s)`` per output channel for the input equal to ``s`` everywhere, when that is one
        constant per output channel (so an additive ``core(x + s) = core(x) + core(s)`` is a bias);
        else raise ValueError saying why."""
        raise ValueError(
            f"an additive perturbation of its input is not a bias of {type(self).__rank1_base__.__name__} "
            "(not known to be a constant shift of its output)"
        )

    def rank1_merge(self, component: int) -> dict[str, Tensor]:
        """``W' = W o (r_k s_k^T)``, ``b' = b + delta_k``; additive: ``b' = b + core(s_k) + r_k + delta_k``.

        Exact only where the layer's map is known to be the plain map of its weight (the torch
        forwards of :attr:`rank1_merge_forwards`): a subclass's own forward may transform the weight
        (timm's ``StdConv2d`` standardises it), so its member is not ``W o (r s^T)``.
        """
        base = type(self).__rank1_base__
        for name in ("weight", "bias"):
            if computed(self, name) or name == "weight" and "weight" not in self._parameters:
                if isinstance(base.__dict__.get(name), property):  # parametrized before conversion: torch's class inside
                    # (torch's remove_parametrizations cannot take it out of bayesify's subclass around it)
                    fix = (f"remove it from the network before convert (torch.nn.utils.parametrize.remove_parametrizations("
                           f"layer, {name!r}) on the unconverted layer)")  # fmt: skip
                elif hasattr(self, "parametrizations"):  # parametrized after conversion: torch's class outside
                    fix = f"remove it first (torch.nn.utils.parametrize.remove_parametrizations(layer, {name!r}))"
                else:
                    fix = f"remove it first (torch.nn.utils.prune.remove(layer, {name!r}))"
                raise ValueError(
                    f"{base.__name__}'s {name} is computed (a parametrization, such as weight norm, or pruning): "
                    f"there is no raw {name} to fold the factors into. {fix[0].upper() + fix[1:]}, or "
                    "convert(..., exclude=[...]) this layer"
                )
        forward = base.forward
        if forward not in self.rank1_merge_forwards and (forward.__module__, forward.__qualname__) not in WEIGHT_AS_IS:
            raise ValueError(
                f"{base.__name__} has a forward of its own ({base.__module__}.{base.__qualname__}.forward), which may "
                "transform its weight (as weight standardisation does), so W o (r s^T) in its weight is not known to "
                "be the member; keep the converted model under bayesify.mode(model, component=k, noise=False), or "
                "convert(..., exclude=...) this layer"
            )
        weight, bias = self._parameters["weight"], self._parameters.get("bias")
        s, r = self.rank1_location("rank1_s", component), self.rank1_location("rank1_r", component)
        # (the code that uses its weight gives a bias of its own: the offsets are left out of every member)
        delta = None if self.rank1_state.other_bias else self.rank1_location("rank1_bias", component)
        if self.rank1_options.perturbation is Perturbation.ADDITIVE:
            shift = self.rank1_constant_response(weight, s) + r
            if bias is None:
                raise ValueError(
                    f"the additive perturbation shifts the output of {base.__name__} by core(s) + r, and it has no "
                    "bias (bias=False) to hold the shift"
                )
            return {"bias": (bias + shift + (0 if delta is None else delta)).to(bias.dtype)}
        merged = {"weight": self.rank1_merged_weight(weight, r, s)}
        if bias is not None and delta is not None:
            merged["bias"] = (bias + delta).to(bias.dtype)  # (fp32 offsets of a bf16 layer: the layer's dtype)
        return merged

    @property
    def rank1_merge_forwards(self) -> tuple[Callable, ...]:
        """The base-class forwards that apply the weight as it is (so a folded weight is the member)."""
        return self.rank1_known_forwards

    def rank1_fold(self) -> Fold | None:
        """How this layer runs with a given weight (for :func:`~bayesify.layers.folded.rank1_folded`),
        or None when it cannot (a subclass's own forward, e.g. weight standardisation)."""
        return None

    def rank1_setup(self, options: LayerOptions) -> None:
        fan_in, fan_out = self.rank1_features()
        self.rank1_s = self.rank1_factor(fan_in)
        self.rank1_r = self.rank1_factor(fan_out)
        self.rank1_bias_offset("rank1_bias", fan_out, "bias")

    def forward(self, input: Tensor, *args: object, **kwargs: object) -> Tensor:
        base = type(self).__rank1_base__
        # a plain torch layer whose weight is a Parameter (not a parametrization / pruning mask)
        if base.forward in self.rank1_known_forwards and not args and not kwargs and "weight" in self._parameters:
            return self._rank1_apply(
                input, self.rank1_core, layer_bias(self), core_adds_bias=False, fold=self.rank1_fold(),
                # (a traced graph takes the plain ops: rank1_affine's one autograd node is eager's)
                known=None if torch.compiler.is_compiling() else self.rank1_known_map(input),
            )  # fmt: skip

        # a subclass with its own forward (weight standardisation, same padding, ...): run it as is
        # on the perturbed input; it adds the original bias, which the op accounts for
        state = self.rank1_state

        def core(x: Tensor) -> Tensor:
            state.busy = True
            try:
                return base.forward(self, x, *args, **kwargs)
            finally:
                state.busy = False

        return self._rank1_apply(input, core, layer_bias(self), core_adds_bias=True)

    def _rank1_apply(
        self,
        x: Tensor,
        core: Callable[[Tensor], Tensor],
        bias: Tensor | None,
        *,
        core_adds_bias: bool,
        fold: Fold | None = None,
        known: KnownMap | None = None,
        offsets: bool = True,
    ) -> Tensor:
        batch_axis, channel_axis = self.rank1_axes(x)
        # (the factors by their dict: every attribute read of a converted layer goes through its __getattr__, which
        # Dynamo traces in every call of every layer)
        s_factor, r_factor = self._modules["rank1_s"], self._modules["rank1_r"]
        if x.dim() == 0 or x.shape[channel_axis] != s_factor.features:
            self.rank1_check()  # a weight of another shape since conversion, whose new width the input has
            if batch_axis is None:  # one unbatched example, whose own dimension the pass may have tiled as the batch
                self.rank1_state.model.router.check_unbatched(x, channel_axis, self)
            core(x)  # a wrong input shape: let the layer's own computation raise torch's usual error
            raise ValueError(
                f"{type(self).__name__} expects {s_factor.features} input channels at dimension "
                f"{channel_axis}, got an input of shape {tuple(x.shape)}."
            )
        draw = self.rank1_draw(1 if batch_axis is None else x.shape[batch_axis], x.device)
        if draw.first_only and batch_axis is not None and not torch.compiler.is_compiling():
            self._rank1_check_batch_axis(x, batch_axis, channel_axis)
        additive = self.rank1_options.perturbation is Perturbation.ADDITIVE
        folds = fold is not None and not additive and batch_axis is not None and self._rank1_folds(draw, x, fold.weight)
        if folds and not torch.is_grad_enabled() and _members_fixed(draw):
            # evaluation at the posterior means: K folded weights, no pass over the activations. Only where
            # folding pays by the byte count: elsewhere K convolutions of B rows each run slower than the
            # per-row path's one of K*B rows (measured on the CPU: ResNet-18 at 32 px 1.37x vs 1.12x det)
            return self._rank1_members_folded(x, draw, fold, bias, batch_axis, channel_axis, offsets)
        if folds:
            offset = _left_out(draw.gather_blocks("rank1_bias"), offsets)
            if bias is not None:  # one row per block (a bias given by the caller, e.g. SwinV2's q/k/v biases)
                offset = bias.expand(len(draw.blocks), -1) if offset is None else offset + bias
            s, r = draw.sample_blocks(s_factor, r_factor)
            return rank1_folded(
                x, draw.blocks, fold.weight, fold.apply, s, r, offset, batch_axis=batch_axis, channel_axis=channel_axis,
                groups=fold.groups, transposed=fold.transposed, dense=fold.dense,
            )  # fmt: skip
        # the per-row values in the shape that broadcasts against the activations, where the draw ahead has them so
        like = None if batch_axis is None or additive or core_adds_bias else (x.dim(), batch_axis, channel_axis)
        offset = _left_out(draw.gather("rank1_bias", like), offsets)
        if known is None or additive or core_adds_bias:
            offset = with_bias(offset, None if core_adds_bias else bias, channel_axis)
            bias = bias if core_adds_bias else None
        s, r = draw.sample(s_factor, r_factor, like=like)
        return rank1_affine(
            x,
            core,
            s,
            r,
            offset,
            additive=additive,
            batch_axis=batch_axis,
            channel_axis=channel_axis,
            core_bias=bias if core_adds_bias else None,
            known=known,
            bias=None if core_adds_bias else bias,
        )

    def _rank1_check_batch_axis(self, x: Tensor, batch_axis: int, channel_axis: int) -> None:
        """A call whose rows are not the pass's runs one member for all of them (a batch-independent input: a
        table through an MLP). Where another dimension of ``x`` has exactly the pass's rows, the batch more likely
        lies there (a time-major layer inside a batch-first model), and the members would mix: say so."""
        router = self.rank1_state.model.router
        state = router.state
        rows = None if state is None else state.rows.shape[0]
        ignored = (batch_axis % x.dim(), channel_axis % x.dim())
        elsewhere = [i for i, size in enumerate(x.shape) if size == rows and i not in ignored]
        if not elsewhere:
            # a batch-independent input (a learnt table, a positional encoding): every member's rows take the first
            # row's component here, so member k's output is not quite member k's (its own factors on the table), and
            # the mixture is not the members' mixture. It cannot be done per member (the output is broadcast
            # against the batch), so say so, once, where the pass mixes several components
            self.rank1_state.batch_independent = True
            self.rank1_state.batch_dim_hint = router.batch_dim_hint(x.shape[batch_axis])
            warned = self.rank1_state.model.warned
            if state is not None and (state.blocks is None or len(state.blocks) > 1) and "batch-independent" not in warned:
                warned.add("batch-independent")  # once per model (SwinV2 has two such layers a block)
                warnings.warn(
                    f"{router.layer_name(self)} ran on an input of shape {tuple(x.shape)} that does not depend on the "
                    f"batch ({rows} rows): it runs one component's factors for every member's rows, so the members "
                    "share this layer's draw and the predictive is not their exact mixture. Leave it deterministic "
                    "with convert(..., exclude=[its name]); bayesify.summary(model, x) lists every such layer. (A "
                    "model whose first input holds no batch, nn.EmbeddingBag's 1-D tokens with offsets, needs [B, L] "
                    "tokens: bayesify took the tokens as the batch.)"
                    + self.rank1_state.batch_dim_hint,
                    stacklevel=2,
                )
            return
        if elsewhere:
            warnings.warn(
                f"{router.layer_name(self)} got an input of shape {tuple(x.shape)}, whose dimension {batch_axis} "
                f"(convert's batch_dim) is not the pass's {rows} rows but dimension {elsewhere[0]} is: if the batch "
                "lies there, this layer runs one member for every row and mixes the members. Make it see the batch "
                f"at dimension {batch_axis} (e.g. batch_first=True for torch's transformer layers) or leave it out "
                "with convert(..., exclude=...); an input that does not depend on the batch is fine.",
                stacklevel=2,
            )

    def _rank1_members_folded(
        self, x: Tensor, draw: Draw, fold: Fold, bias: Tensor | None, batch_axis: int, channel_axis: int, offsets: bool
    ) -> Tensor:
        """Evaluation at the posterior means (no noise, no gradients, the route fixes each block's component):
        every member is the original map with its own folded weight, the K weights folded in one op per call.
        Nothing is kept between calls: a weight or factor changed in any way PyTorch allows (``.data``, a cast,
        ``load_state_dict(assign=True)``) is what the next call folds."""
        weights = fold_weights(fold.weight, self.rank1_r.loc, self.rank1_s.loc, groups=fold.groups, transposed=fold.transposed)
        each = weights.unbind(0)
        added = _left_out(self.rank1_bias, offsets)  # [K, out] per component: the bias offset, plus the bias given
        if bias is not None:
            added = bias.expand(len(weights), -1) if added is None else added + bias
        components = draw.fixed_components
        picked = each if list(components) == list(range(len(each))) and not fold.dense else _pick(weights, components)
        return run_blocks(x, draw.blocks, picked, None if added is None else _pick(added, components),
                          fold.apply, batch_axis=batch_axis, channel_axis=channel_axis, transposed=fold.transposed,
                          dense=fold.dense)  # fmt: skip

    def _rank1_folds(self, draw: Draw, x: Tensor, weight: Tensor) -> bool:
        """Whether this call runs folded: blocked rows, and (``sampling='auto'``) the folded path moves
        fewer bytes than the per-row one.

        The per-row path makes ~3 activation-sized passes on each side of the layer (scale, and in the
        backward the scaled gradient and the factor's reduction); the folded one ~8 weight-sized passes
        per block (fold, and in the backward the chain rule to W, r and s). Memory follows the same
        count: the per-row path keeps the scaled input and the unscaled output for the backward pass. A
        convolution whose input takes no gradient folds when gradients are taken (``rank1_stem_folds``); a
        sampled pass in evaluation mode (a sampled predictive) never folds: each example draws its own.
        """
        sampling = self.rank1_state.model.options.sampling  # model-wide: the model's one copy
        if draw.blocks is None or sampling is Sampling.EXAMPLE:
            return False
        for size in x.shape if torch.compiler.is_compiling() else ():  # (eagerly every size is a number; a loop:
            if not _concrete(size):  # Dynamo traces this for every layer)
                # a symbolic shape (torch.compile(dynamic=True), or a dimension made dynamic by a second size;
                # torch.export): the per-row path, one function for every size without a guard on it, and with
                # sampling='component' still one draw per block (Draw.sample). (Folded, inductor failed to lower a
                # training step's K convolutions of symbolic blocks: "cannot determine truth value of Relational")
                return False
        if sampling is Sampling.COMPONENT:
            return True
        if draw.noise and not self.training:
            # a sampled predictive (uncertainty(), OOD scores, eval_noise=True): each example its own draw, as its
            # scores assume. Folded, one draw per member is shared by the whole batch: copies of one example scored
            # alike (64 copies: one mutual information), and an OOD set scored in batches apart from the test set
            # ranked by two draws (`bayesify evaluate --ood`'s AUROC moved with --batch-size). (The layer's mode,
            # not the grad mode: a reentrant checkpoint runs its forward without gradients and its recomputation
            # with them, and both must take one path)
            return False
        if torch.compiler.is_compiling() and not torch.is_grad_enabled():
            # a compiled evaluation fuses the per-row scalings into the neighbouring ops (a norm, an activation):
            # one convolution of K*B rows then beats K folded weights and K convolutions of B rows (ResNet-18,
            # 32 px, CPU: 1.06x the compiled original at K*B against 1.21x folded where the byte count says so)
            return False
        if self.rank1_stem_folds and torch.is_grad_enabled() and not x.requires_grad and self.rank1_s.loc.requires_grad:
            return True  # (a frozen s needs no input gradient on the per-row path either: the byte count decides)
        activations = x.numel() + self.rank1_output_numel(x)
        # (a shape can still be symbolic where this is reached, a derived one say: no guard on it for this choice)
        return statically_known_true(8 * len(draw.blocks) * weight.numel() < 3 * activations)

    def _rank1_groups(self) -> int:
        return getattr(self, "groups", 1)

    def _rank1_external(self, func: Callable) -> Callable:
        """Handler for ``func(input, weight, bias, ...)`` called on this layer's intercepted weight."""
        import torch

        def handle(args: tuple, kwargs: dict) -> Tensor:
            x, weight, bias, rest, rest_kwargs = split_call(args, kwargs)
            if getattr(weight, "_rank1_layer", None) is not self:
                return NotImplemented
            w = self._parameters["weight"]
            self.rank1_state.intercepted_by = getattr(func, "__name__", "function")
            dense = func is F.linear and not rest and not rest_kwargs
            fold = Fold(w, lambda v, weight, b: func(v, weight, b, *rest, **rest_kwargs), self._rank1_groups(), dense=dense)
            # the bias offsets are the layer's own bias's: where the caller gives another (torchvision's SwinV2 zeroes
            # the key third of a copy of it; or none), they are left out, so that a member is the original code run
            # on W o (r s^T) and the bias as given, which merge folds exactly (the offsets take a zero gradient and
            # stay where they are: 0)
            offsets = bias is self._parameters.get("bias")
            self.rank1_state.other_bias = not offsets
            with torch._C.DisableTorchFunctionSubclass():
                return self._rank1_apply(
                    x, lambda v: func(v, w, None, *rest, **rest_kwargs), bias, core_adds_bias=False, fold=fold,
                    offsets=offsets,
                )  # fmt: skip

        return handle
