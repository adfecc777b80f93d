"""Start weights from a local file (``bayesify train --weights FILE``): no network needed.

The file holds the ``state_dict`` of the *unconverted* network, as written by
``torch.save(model.state_dict(), FILE)`` or by ``safetensors.torch.save_file`` (a ``.safetensors``
file). Training checkpoints that keep it under ``"state_dict"`` or ``"model"`` (timm, Lightning)
are read too, and a ``module.`` prefix on every key (a DDP model saved whole) is dropped. The keys
and shapes must be the model's own: anything else is refused with the keys that differ, never
loaded in part; only a timm model's classifier of another number of classes is left as the model made it, as
timm's own pretrained loading leaves it (weights published for 1000 classes start a 10-class model).

Example:
    >>> torch.save(timm.create_model("resnet18", pretrained=True).state_dict(), "resnet18.pt")  # online
    >>> model = load_weights(timm.create_model("resnet18"), "resnet18.pt")                     # offline
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

__all__ = ["first_line", "load_start_weights", "load_weights", "read_state_dict"]

_NESTED = ("state_dict", "model")  # where training checkpoints keep the weights
_SHOWN = 3  # keys named per kind of mismatch


def read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The ``{name: tensor}`` weights in ``path`` (see the module doc for the formats).

    Raises:
        ValueError: no such file, a file that is not a weights file, or a converted model's weights.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--weights {path}: no such file.")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError(
                f"--weights {path}: reading .safetensors needs the safetensors package (pip install safetensors)."
            ) from None
        try:
            loaded: Any = load_file(str(path))
        except Exception as error:  # safetensors raises its own SafetensorError on a damaged header
            raise ValueError(f"--weights {path}: not a readable safetensors file ({first_line(error)}).") from None
    else:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # UnpicklingError (a whole pickled model), a truncated or foreign file, ...
            raise ValueError(
                f"--weights {path}: not a state_dict that torch.load(..., weights_only=True) can read "
                f"({first_line(error)}); save the weights with torch.save(model.state_dict(), FILE)."
            ) from None
    state = _unnest(loaded)
    if state is None:
        raise ValueError(
            f"--weights {path}: holds a {type(loaded).__name__}, not a state_dict of tensors "
            "(save it with torch.save(model.state_dict(), FILE))."
        )
    rank1 = [key for key in state if key.startswith("rank1_") or ".rank1_" in key]
    if rank1:
        raise ValueError(
            f"--weights {path}: holds rank-1 parameters ({rank1[0]}, ...), i.e. a converted model's weights; --weights "
            "takes the network before conversion (to continue a bayesify run, pass its --out with --resume)."
        )
    return state


def load_weights(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load the weights in ``path`` into ``model`` (unconverted), strictly; returns ``model``. A timm model's
    classifier of another number of classes than the file's is left as the model made it (see
    :func:`load_start_weights`).

    Raises:
        ValueError: see :func:`read_state_dict`; or keys / shapes that are not the model's, named.
    """
    load_start_weights(model, path)
    return model


def load_start_weights(model: nn.Module, path: str | os.PathLike) -> nn.Module | None:
    """:func:`load_weights`, returning the classifier left new: as timm's own pretrained loading does, a timm model
    whose classifier (``pretrained_cfg["classifier"]``) has another width than the file's keeps its own, random
    one (weights published for 1000 classes, a model for 10), which must then train; None where every key loaded."""
    state = read_state_dict(path)
    holder = _holder(model, state)
    expected = holder.state_dict()
    head, head_keys = _other_width_head(holder, state, expected)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [
        f"{k} {list(state[k].shape)} in the file, {list(expected[k].shape)} in the model"
        for k in expected
        if k in state and state[k].shape != expected[k].shape and k not in head_keys
    ]
    problems = [
        f"{len(keys)} {kind} ({', '.join(keys[:_SHOWN])}{', ...' if len(keys) > _SHOWN else ''})"
        for kind, keys in (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes))
        if keys
    ]
    if problems:
        raise ValueError(
            f"--weights {path} does not fit {type(holder).__name__}: keys {'; '.join(problems)}; the file must hold "
            "this model's state_dict (the same architecture and input channels, and the number of classes but for a "
            "timm classifier's)."
        )
    holder.load_state_dict({k: v for k, v in state.items() if k not in head_keys}, strict=not head_keys)
    return head


def _other_width_head(
    model: nn.Module, state: Mapping[str, Tensor], expected: Mapping[str, Tensor]
) -> tuple[nn.Module | None, set[str]]:
    """A timm model's classifier and its keys where the file has them all at other shapes (another number of
    classes), else ``(None, set())``."""
    cfg = getattr(model, "pretrained_cfg", None)
    names = cfg.get("classifier") if isinstance(cfg, Mapping) else None
    for name in (names,) if isinstance(names, str) else names or ():
        keys = {k for k in expected if k.startswith(f"{name}.")}
        if keys and all(k in state and state[k].shape != expected[k].shape for k in keys):
            return model.get_submodule(name), keys
    return None, set()


def _holder(model: nn.Module, state: Mapping[str, Tensor]) -> nn.Module:
    """The module of ``model`` whose own keys the file's are: ``model``, or the one child that holds all its state
    where the file is that child's (a torchvision net behind :class:`~bayesify.zoo.models.RepeatChannels` for gray
    images: its keys are ``1.``-prefixed, a torchvision ``state_dict``'s are not)."""
    keys = model.state_dict().keys()
    if set(state) == set(keys):
        return model
    for name, child in model.named_children():
        if set(state) == set(child.state_dict()) and all(key.startswith(f"{name}.") for key in keys):
            return child
    return model


def _unnest(loaded: Any) -> dict[str, Tensor] | None:
    """The ``{str: Tensor}`` mapping in ``loaded`` (itself, or under a checkpoint key), without a DDP prefix."""
    if isinstance(loaded, Mapping) and not _is_state(loaded):
        loaded = next((loaded[key] for key in _NESTED if isinstance(loaded.get(key), Mapping)), None)
    if not isinstance(loaded, Mapping) or not _is_state(loaded) or not loaded:
        return None
    state = dict(loaded)
    if all(key.startswith("module.") for key in state):
        state = {key[len("module.") :]: value for key, value in state.items()}
    return state


def _is_state(mapping: Mapping) -> bool:
    return all(isinstance(k, str) and isinstance(v, Tensor) for k, v in mapping.items())


def first_line(error: BaseException, limit: int = 120) -> str:
    """``"Type: first line of the message"``, without terminal colour codes, cut at ``limit`` characters."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    return f"{type(error).__name__}: {text}"
