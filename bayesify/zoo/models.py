"""Models by name, adapted to a data set's input channels and number of classes.

Names are tried in this order:

1. built-ins for the small embedded data sets: ``mlp`` (any input, flattened), ``cnn`` (a
   small 2-d CNN, the demo's network) and ``cnn1d`` (a small 1-d CNN for signals);
2. ``module:factory``: ``factory(num_classes=..., in_channels=...)`` imported from ``module``
   (only the keyword arguments the factory accepts are passed: ``num_classes``,
   ``in_channels`` / ``in_chans``, ``input_shape``);
3. any timm architecture (``timm.list_models()``), created with ``num_classes`` and
   ``in_chans``: timm builds its stem for the data's channels (and adapts pretrained stems);
4. any torchvision classifier (``torchvision.models.list_models()``), created with
   ``num_classes``. torchvision stems are fixed at 3 channels, so for 1-channel data the
   model is prefixed by :class:`RepeatChannels` (gray repeated to RGB: no new parameters,
   pretrained stems keep working).

Prefix a name with ``timm:`` or ``torchvision:`` to pick one library when both have it
(``resnet18`` is timm's unless written ``torchvision:resnet18``).

``pretrained=True`` asks timm / torchvision for their published weights (from their cache, else
the network). Without them (offline, no cache) it ends in one ValueError naming the way out: a
local weights file (:func:`bayesify.zoo.weights.load_weights`, ``bayesify train --weights FILE``).

Example:
    >>> net = create_model("resnet18", in_channels=1, num_classes=10)
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
from collections.abc import Mapping
from typing import Callable, Iterator

from torch import Tensor, nn

from bayesify.zoo.data import DataKind
from bayesify.zoo.weights import first_line

__all__ = ["RepeatChannels", "builtin_models", "create_model", "new_classifier"]


class RepeatChannels(nn.Module):
    """Repeat a 1-channel image to ``channels`` channels (gray to RGB for a 3-channel stem)."""

    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.channels = channels

    def forward(self, x: Tensor) -> Tensor:
        return x.expand(x.shape[0], self.channels, *x.shape[2:])

    def extra_repr(self) -> str:
        return f"channels={self.channels}"


def _mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(input_shape), 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, num_classes),
    )  # fmt: skip


def _cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 3:
        raise ValueError(
            f"model 'cnn' takes [C, H, W] images, not inputs of shape {input_shape}; use 'cnn1d' or 'mlp'."
        )
    return nn.Sequential(
        nn.Conv2d(input_shape[0], 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, num_classes),
    )  # fmt: skip


def _cnn1d(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 2:
        raise ValueError(f"model 'cnn1d' takes [C, L] signals, not inputs of shape {input_shape}; use 'cnn' or 'mlp'.")
    return nn.Sequential(
        nn.Conv1d(input_shape[0], 32, 5, padding=2), nn.ReLU(),
        nn.Conv1d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2), nn.AdaptiveAvgPool1d(8),
        nn.Flatten(), nn.Linear(64 * 8, 128), nn.ReLU(), nn.Linear(128, num_classes),
    )  # fmt: skip


_BUILTINS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {"mlp": _mlp, "cnn": _cnn, "cnn1d": _cnn1d}


def builtin_models() -> list[str]:
    """Names of the built-in models."""
    return sorted(_BUILTINS)


def create_model(
    name: str,
    *,
    in_channels: int,
    num_classes: int,
    input_shape: tuple[int, ...] | None = None,
    kind: DataKind | str = DataKind.IMAGE,
    pretrained: bool = False,
) -> nn.Module:
    """Create a model by name for inputs with ``in_channels`` channels and ``num_classes`` outputs.

    Args:
        name: a built-in, ``module:factory``, a timm or a torchvision model name (see module doc).
        in_channels: channels of the inputs (features for tabular data).
        num_classes: outputs of the classifier.
        input_shape: one example's shape; default ``(in_channels, 32, 32)``.
        kind: ``image``, ``signal`` or ``tabular``; timm / torchvision models need images.
        pretrained: load the library's pretrained weights (needs them cached or network access).

    Raises:
        ValueError: an unknown name (with the fix), a model that cannot take this kind of data, or
            pretrained weights that do not exist (built-ins) or cannot be fetched (offline).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"model={name!r} must be a non-empty string such as 'resnet18', 'cnn' or 'pkg.mod:factory'.")
    kind = DataKind(kind)
    shape = tuple(input_shape) if input_shape is not None else (in_channels, 32, 32)
    library, _, bare = name.partition(":") if name.startswith(("timm:", "torchvision:")) else ("", "", name)
    if name in _BUILTINS or ":" in bare:
        if pretrained:
            raise ValueError(
                f"model={name!r} has no published pretrained weights (only timm and torchvision models do); "
                "start from your own with --weights FILE."
            )
        if name in _BUILTINS:
            return _BUILTINS[name](shape, num_classes)
        return _from_factory(bare, in_channels=in_channels, num_classes=num_classes, input_shape=shape)

    if library in ("", "timm") and _is_timm(bare):
        _need_images(name, kind)
        import timm

        # (the published head: one of other classes is left new at loading, as timm leaves it, and trains)
        saved = f"timm.create_model({bare!r}, pretrained=True, in_chans={in_channels})"
        with _offline_hint(name, pretrained, saved):
            return timm.create_model(bare, pretrained=pretrained, num_classes=num_classes, in_chans=in_channels)
    if library in ("", "torchvision") and _is_torchvision(bare):
        _need_images(name, kind)
        from torchvision import models

        if pretrained:
            published = len(models.get_model_weights(bare).DEFAULT.meta["categories"])
            if num_classes != published:
                raise ValueError(
                    f"torchvision's pretrained {bare!r} has {published} classes, the data {num_classes}; use the timm "
                    f"model (--model timm:{bare}), whose pretrained weights get a new classifier, or --weights FILE."
                )
        with _offline_hint(name, pretrained, f"torchvision.models.get_model({bare!r}, weights='DEFAULT')"):
            net = models.get_model(bare, weights="DEFAULT" if pretrained else None, num_classes=num_classes)
        if in_channels == 1:
            return nn.Sequential(RepeatChannels(3), net)
        if in_channels != 3:
            raise ValueError(
                f"torchvision model {bare!r} takes 3-channel images, the data has {in_channels}; "
                f"use the timm model (--model timm:{bare}), which builds its stem with in_chans={in_channels}."
            )
        return net
    raise ValueError(
        f"model={name!r} is not a built-in ({', '.join(builtin_models())}), a timm or a torchvision model name; "
        "check the spelling (timm.list_models('*pattern*') lists timm's), or pass your own as 'package.module:factory'."
    )


def new_classifier(model: nn.Module) -> nn.Module | None:
    """The classifier ``create_model(..., pretrained=True)`` made anew for the data: timm builds a random head where
    its published weights are of another number of classes (``pretrained_cfg``); None where the head is the
    weights' (torchvision's pretrained classifiers keep their own: other classes are refused) or there is none."""
    cfg = getattr(model, "pretrained_cfg", None)
    get_classifier = getattr(model, "get_classifier", None)
    if not isinstance(cfg, Mapping) or not callable(get_classifier):
        return None
    published = cfg.get("num_classes")
    head = get_classifier()
    if published is None or published == getattr(model, "num_classes", published) or not isinstance(head, nn.Module):
        return None
    return head


@contextlib.contextmanager
def _offline_hint(name: str, pretrained: bool, saved: str) -> Iterator[None]:
    """Turn a failed download of pretrained weights into one line naming ``--weights FILE`` and what to save in it
    (``saved``: the call that makes the model as the run builds it, the data's classes and channels included)."""
    try:
        yield
    except OSError as error:  # huggingface_hub's LocalEntryNotFoundError, urllib's URLError: both OSErrors
        if not pretrained:
            raise
        raise ValueError(
            f"model={name!r}: could not get its pretrained weights ({first_line(error)}); offline, pass --weights FILE "
            f"instead, saved where the network is reachable: torch.save({saved}.state_dict(), FILE)."
        ) from None


def _need_images(name: str, kind: DataKind) -> None:
    if kind is not DataKind.IMAGE:
        raise ValueError(
            f"model={name!r} is a 2-d image model but the data is {kind} data; "
            "use --model cnn1d (signals), mlp (tables or signals), or your own as 'package.module:factory'."
        )


def _is_timm(name: str) -> bool:
    try:
        import timm
    except ImportError:
        return False
    return timm.is_model(name)


def _is_torchvision(name: str) -> bool:
    try:
        from torchvision import models
    except ImportError:
        return False
    return name in models.list_models(module=models)


def _from_factory(spec: str, **available: object) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"model='{spec}': cannot import module {module_name!r} ({error}); "
            "'module:factory' needs the module on the Python path (e.g. run from its folder)."
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model='{spec}': module {module_name!r} has no callable {attr!r}.")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {
        "num_classes": available["num_classes"],
        "in_channels": available["in_channels"],
        "in_chans": available["in_channels"],
        "input_shape": available["input_shape"],
    }
    kwargs = {k: v for k, v in kwargs.items() if takes_any and k in ("num_classes", "in_channels") or k in params}
    P = inspect.Parameter
    named = (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
    required = [n for n, p in params.items() if p.default is P.empty and p.kind in named and n not in kwargs]
    if required:  # (it would end in the factory's own TypeError, a traceback)
        raise ValueError(
            f"model='{spec}': the factory requires {', '.join(map(repr, required))}, which bayesify cannot give it; a "
            f"factory is offered {', '.join(f'{k}={v!r}' for k, v in kwargs.items()) or 'nothing it names'} "
            "(num_classes, in_channels / in_chans, input_shape, by name): give the others defaults."
        )
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model='{spec}': the factory returned {type(model).__name__}, not a torch.nn.Module.")
    return model
