"""The base of every rank-1 layer, and how a module becomes one in place.

A rank-1 layer is the *same module object* with its class swapped for a generated subclass
``Rank1<Original>`` of both the wrapper (e.g. :class:`~bayesify.wrappers.linear.Rank1Linear`)
and the module's own class (e.g. timm's ``StdConv2d``), the way
``torch.nn.utils.parametrize`` does it. Hence:

* the original Parameters stay where they were (same objects, same ``state_dict`` keys), so an
  optimizer built before conversion and a pretrained checkpoint still apply;
* ``isinstance(layer, nn.Conv2d)`` and the original class's own ``forward`` (weight
  standardisation, same padding) still hold; hooks, device, dtype and ``training`` are kept;
* new state is only added: ``rank1_s.*``, ``rank1_r.*`` and ``rank1_bias``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from bayesify._routing import Rank1Context
from bayesify.config import Rank1Config
from bayesify.wrappers._intercept import intercept
from bayesify.wrappers.factor import Rank1Factor

__all__ = ["Rank1Layer", "rank1_class"]

_GENERATED: dict[tuple[type, type], type] = {}


def rank1_class(wrapper: type["Rank1Layer"], base: type[nn.Module]) -> type:
    """The generated subclass of ``wrapper`` and ``base`` (cached, so one class per pair)."""
    key = (wrapper, base)
    if key not in _GENERATED:
        name = f"Rank1{base.__name__}"
        cls = type(name, (wrapper, base), {"__rank1_wrapper__": wrapper, "__rank1_base__": base})
        cls.__qualname__ = name
        cls.__module__ = wrapper.__module__
        _GENERATED[key] = cls
    return _GENERATED[key]


def _rebuild(wrapper: type["Rank1Layer"], base: type[nn.Module]) -> nn.Module:
    """Unpickling: an empty instance of the generated class (its state is set right after)."""
    cls = rank1_class(wrapper, base)
    return cls.__new__(cls)


class Rank1Layer(nn.Module):
    """Mixin base of all rank-1 layers; found by ``isinstance`` by every model-level helper.

    Subclasses set :attr:`source_types` (what they convert), implement :meth:`_rank1_setup`
    (create factors) and ``forward``. They are never instantiated directly: use
    :meth:`from_module` (what :func:`bayesify.convert` calls).
    """

    source_types: tuple[type[nn.Module], ...] = ()
    # attributes that code outside the layer may use in its own maths (see _intercept.py)
    _rank1_intercepted: tuple[str, ...] = ()
    __rank1_wrapper__: type["Rank1Layer"]
    __rank1_base__: type[nn.Module]

    @classmethod
    def from_module(cls, module: nn.Module, config: Rank1Config, context: Rank1Context) -> nn.Module:
        """Make ``module`` a rank-1 layer in place (same object, same Parameters) and return it."""
        if isinstance(module, Rank1Layer):
            raise ValueError(f"{type(module).__name__} is already a rank-1 layer; convert each layer once.")
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(recurse=False)):
            raise ValueError(
                f"{type(module).__name__} has uninitialized (lazy) parameters, so its shape is unknown; run one "
                "forward pass on an example batch before bayesify.convert()."
            )
        module.__class__ = rank1_class(cls, type(module))
        module._rank1_context = context
        module.rank1_config = config
        try:
            module._rank1_setup(config)
        except Exception:
            module.revert()
            raise
        return module

    def _rank1_setup(self, config: Rank1Config) -> None:
        raise NotImplementedError

    def _rank1_new_factor(self, features: int, config: Rank1Config) -> Rank1Factor:
        like = next(self.parameters(recurse=False), None)
        kwargs: dict[str, Any] = {}
        if like is not None:
            kwargs = {"device": like.device, "dtype": like.dtype if like.is_floating_point() else None}
        return Rank1Factor(features, config, **kwargs)

    # ---- model-level protocol ---------------------------------------------------------------

    def rank1_factors(self) -> Iterator[tuple[str, Rank1Factor]]:
        """The ``(name, factor)`` pairs of this layer."""
        for name, child in self.named_children():
            if isinstance(child, Rank1Factor):
                yield name, child

    def rank1_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters bayesify added to this layer (factors and per-component biases)."""
        for _, factor in self.rank1_factors():
            yield from factor.parameters()
        for name, p in self.named_parameters(recurse=False):
            if name.startswith("rank1_"):
                yield p

    def kl_divergence(self) -> Tensor:
        """KL of this layer's posteriors to their priors, summed over components and entries."""
        terms = [factor.kl_divergence() for _, factor in self.rank1_factors()]
        return torch.stack(terms).sum() if terms else torch.zeros(())

    def revert(self) -> nn.Module:
        """Undo the conversion in place: the original class, with only its original state."""
        for name, _ in list(self.rank1_factors()):
            delattr(self, name)
        for name in [n for n in self._parameters if n.startswith("rank1_")]:
            del self._parameters[name]
        for attr in ("_rank1_context", "rank1_config", "_rank1_bypassed_by", "_rank1_busy"):
            self.__dict__.pop(attr, None)
        self.__class__ = type(self).__rank1_base__
        return self

    # ---- routing helpers for subclasses -----------------------------------------------------

    def _rank1_rows(self, n: int, device: torch.device) -> tuple[Tensor, bool]:
        """Component index of each of ``n`` rows and whether to sample (noise) this call."""
        ctx: Rank1Context = self._rank1_context
        rows = ctx.rows_for(n, device)
        return rows, (ctx.noise if ctx.live() else True)

    def _rank1_functional_handlers(self) -> dict[Callable, Callable]:
        """``{torch function: handler(args, kwargs)}`` for calls on an intercepted weight."""
        return {}

    # ---- plumbing ---------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if name in type(self)._rank1_intercepted:
            state = self.__dict__
            ctx = state.get("_rank1_context")
            if ctx is not None and ctx.live() and not state.get("_rank1_busy", False):
                return intercept(value, self)
        return value

    def __reduce_ex__(self, protocol: int) -> tuple:
        # the generated class is not importable by name: rebuild it from (wrapper, base)
        cls = type(self)
        return (_rebuild, (cls.__rank1_wrapper__, cls.__rank1_base__), self.__getstate__())
