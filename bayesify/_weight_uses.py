"""Which unconverted weights act as linear maps: watched during ``summary(model, x)``'s forward pass.

Statically, a module with a 2-d+ parameter and no wrapper *may* hold a linear map (a third-party
``Dense``), or may hold a position embedding, a relative-position table or a layer scale, which
are not linear maps. Running the example forward pass under a ``TorchFunctionMode`` tells them
apart: a parameter (or a view of it: ``.t()``, ``.view``, ``[i]``, ...) that is an operand of
``F.linear`` / ``F.convNd`` / ``matmul`` / ``einsum`` / ... is a linear map left deterministic,
and :func:`bayesify.summary` names it with the one-line way to convert it; a parameter used only
by other maths (added, indexed, concatenated) is not a linear map, and is not reported.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["WeightUses"]

# functions whose tensor operands are multiplied as matrices / kernels
_LINEAR_MAPS: set[Callable] = {
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    F.multi_head_attention_forward, torch.matmul, torch.mm, torch.bmm, torch.einsum, torch.addmm, torch.baddbmm,
    torch.addbmm, torch.addmv, torch.mv, torch.tensordot, torch.inner, torch.outer, torch.kron, torch.chain_matmul,
    Tensor.__matmul__, Tensor.__rmatmul__, Tensor.matmul, Tensor.mm, Tensor.bmm, Tensor.addmm, Tensor.mv,
}  # fmt: skip
# functions whose result is (a view of) the same weight: follow it
_SAME_WEIGHT: set[Callable] = {
    Tensor.t, Tensor.transpose, torch.transpose, torch.t, Tensor.view, Tensor.reshape, torch.reshape, Tensor.permute,
    torch.permute, Tensor.unsqueeze, Tensor.squeeze, Tensor.expand, Tensor.expand_as, Tensor.contiguous, Tensor.to,
    Tensor.type_as, Tensor.float, Tensor.half, Tensor.bfloat16, Tensor.double, Tensor.__getitem__, Tensor.chunk,
    torch.chunk, Tensor.split, torch.split, Tensor.unbind, torch.unbind, Tensor.flatten, torch.flatten,
    Tensor.unflatten, Tensor.movedim, Tensor.narrow, Tensor.clone, Tensor.detach, Tensor.T.__get__,
    Tensor.mT.__get__, Tensor.data.__get__,
}  # fmt: skip


def _pretty(func: Callable) -> str:
    name = getattr(func, "__name__", repr(func))
    module = getattr(func, "__module__", None) or ""
    if module.startswith(("torch.nn.functional", "torch._C._nn")):
        return f"F.{name}"
    qualname = getattr(func, "__qualname__", "")
    if qualname.startswith(("TensorBase.", "Tensor.")) or "_TensorBase" in qualname:
        return f"Tensor.{name}"
    return f"torch.{name}"


class WeightUses(TorchFunctionMode):
    """Records, for each watched parameter, the torch functions it (or a view of it) is passed to.

    Args:
        watched: ``{id(parameter): (module name, parameter name)}``.
    """

    def __init__(self, watched: dict[int, tuple[str, str]]) -> None:
        super().__init__()
        self.alias: dict[int, tuple[str, str]] = dict(watched)
        self.keep: list[Tensor] = []  # views stay alive during the pass, so their ids stay theirs
        self.uses: dict[tuple[str, str], set[str]] = {}
        self.linear: dict[tuple[str, str], set[str]] = {}

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        hits = {self.alias[id(t)] for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and id(t) in self.alias}
        if not hits:
            return out
        name = _pretty(func)
        if func in _SAME_WEIGHT:
            for o in tree_flatten(out)[0]:
                if isinstance(o, Tensor):
                    self.alias[id(o)] = next(iter(hits))
                    self.keep.append(o)
            return out
        for hit in hits:
            self.uses.setdefault(hit, set()).add(name)
            if func in _LINEAR_MAPS:
                self.linear.setdefault(hit, set()).add(name)
        return out

    def verdicts(self, modules: dict[str, nn.Module]) -> tuple[dict[str, str], set[str]]:
        """``({module: why it is a deterministic linear map}, {modules whose weights are not linear maps})``."""
        linear: dict[str, str] = {}
        used_modules: dict[str, set[str]] = {}
        for (module, param), funcs in self.uses.items():
            used_modules.setdefault(module, set()).add(param)
        for (module, param), funcs in sorted(self.linear.items()):
            kind = type(modules[module]).__name__
            linear.setdefault(
                module,
                f"{kind}.{param} is a linear map (used by {', '.join(sorted(funcs))} in the forward pass) left "
                f"deterministic; pass mapping={{**bayesify.default_mapping(), {kind}: <your Rank1Layer subclass>}}",
            )
        not_linear = {m for m in used_modules if m not in linear}
        return linear, not_linear


def watched_parameters(model: nn.Module, converted: dict[str, nn.Module]) -> dict[int, tuple[str, str]]:
    """2-d+ parameters of modules that are neither converted nor inside a converted layer."""
    from bayesify.inspection import inside

    own = {id(p) for layer in converted.values() for p in layer.parameters()}
    watched: dict[int, tuple[str, str]] = {}
    for name, module in model.named_modules():
        if name in converted or inside(name, converted):
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() >= 2 and id(p) not in own:
                watched.setdefault(id(p), (name, pname))
    return watched
