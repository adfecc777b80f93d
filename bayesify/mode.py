"""``mode()`` and ``predict()``: choose how a converted model routes examples through its components."""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from bayesify._router import RouteSpec
from bayesify.inspection import inside
from bayesify.model_state import ModelState, find_root, hands_on_root_output, is_root, model_state, split_output
from bayesify.options import Route, parse_option
from bayesify.predictive.libraries import said_of_model
from bayesify.predictive.outputs import check_rows
from bayesify.predictive.tasks import Task, check_class_axis, resolve_task

__all__ = ["mode", "predict"]


@contextlib.contextmanager
def mode(
    model: nn.Module,
    route: Route | str | None = None,
    *,
    noise: bool | None = None,
    samples: int = 1,
    task: Task | str | Any = None,
    class_axis: int | None = None,
    component: int | None = None,
) -> Iterator[None]:
    """Override how ``model`` routes examples, in training and evaluation alike, inside a ``with``.

    Args:
        model: a converted model (or a wrapper of one, such as DDP).
        route: ``"sample"`` (one random component per example; the training default),
            ``"tile"`` (every example through all K components, output ``[K*samples*B, ...]``
            member-major: row ``k*samples*B + m*B + b``), ``"mixture"`` (as tile, reduced to
            the mixture predictive; the evaluation default), ``"component"`` (all examples
            through ``component``), or None to keep the train/eval default.
        noise: sample r and s from the posterior (True) or use the posterior locations (False); default:
            always sampled in training, in evaluation as the conversion's ``eval_noise`` says (the
            posterior means unless it is True).
        samples: samples per component for ``tile`` / ``mixture`` (M in K x M).
        task: for ``mixture``: what the output means (see :mod:`bayesify.predictive.tasks`); default: the
            conversion's. ``class_axis`` goes with ``task="classification"``.
        component: the component for ``route="component"`` (implies it when route is None).

    Example:
        >>> with bayesify.mode(model, route="tile", noise=False):
        ...     members = model(x)            # [K*B, ...]: the K posterior-mean members
    """
    state = _one_model(model, "bayesify.mode")
    router = state.router
    if component is not None and route is None:
        route = Route.COMPONENT
    route = None if route is None else parse_option(route, Route, "route")
    if route is Route.COMPONENT:
        k = router.components
        if isinstance(component, bool) or not isinstance(component, int) or not 0 <= component < k:
            raise ValueError(f"component={component!r} must be an integer in [0, {k}) for route='component'.")
    elif component is not None:
        raise ValueError(f"component={component!r} only applies to route='component', not route={route!s}.")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples={samples!r} must be an integer >= 1 (samples per mixture component).")
    if noise is not None and not isinstance(noise, bool):
        raise TypeError(f"noise={noise!r} must be True, False or None (the model's default).")
    check_class_axis(task, class_axis)
    parsed = None if task is None and class_axis is None else resolve_task(task or "classification", class_axis=class_axis)
    if parsed is not None:  # said of a Hugging Face model as a whole: its logits' task, its loss still recomputed
        parsed = said_of_model(parsed, state.current_task())
    if not torch.compiler.is_compiling():
        router.claim("mode()")
    router.overrides.append(RouteSpec(route, noise, samples, parsed, component))
    router.override_threads.append(threading.get_ident())
    try:
        yield
    finally:
        router.overrides.pop()
        router.override_threads.pop()


def predict(model: nn.Module, *args: Any, samples: int = 1, noise: bool | None = None, **kwargs: Any) -> Any:
    """The K x ``samples`` member outputs for one batch, stacked on a new leading axis.

    Runs ``model(*args, **kwargs)`` once on the tiled batch without gradients, in the model's
    current train/eval state (call ``model.eval()`` first for evaluation). A model that takes a
    list of examples (torchvision detection), or a Hugging Face model whose towers are given
    batches of different sizes (CLIP's N images and M prompts), runs once per member instead, and
    its members come back as a list of S outputs.

    Args:
        samples: posterior samples per component (M).
        noise: sample the factors (True) or use the posterior means (False); default: what an
            enclosing ``mode(model, noise=...)`` says; else sampled when ``samples > 1`` (M samples of
            one mean would be M copies), else the model's default for its train / eval state.

    Returns:
        The model's output structure with a member axis in front of every batched tensor:
        ``[K * samples, B, ...]`` for a batch-first output (``[K * samples, T, B, ...]`` for a
        sequence-first one), component-major: member ``k * samples + m``. An output with no batch axis is
        the model's own over the tiled batch: a Hugging Face model's ``loss`` (labels given) is then the
        members' average loss, not the mixture's NLL (``model.eval()``'s forward gives that).

    Example:
        >>> members = bayesify.predict(model.eval(), x, samples=4)     # [K*4, B, classes]
        >>> probs = members.softmax(-1).mean(0)
    """
    state = _one_model(model, "bayesify.predict")
    router = state.router
    if _training(model) and "predict in training" not in state.warned and not torch.compiler.is_compiling():
        _warn_running_statistics(find_root(model), state)
    if noise is None:  # decided where every pass's is (what an enclosing mode() said, else the defaults)
        noise = router.default_noise(_training(model), samples)
    with torch.no_grad():
        # a list of examples (a detector), or towers given batches of different sizes (CLIP's N images, M prompts):
        # one tiled pass cannot hold the members, so each member runs once
        separate = router.takes_examples(args, router.resolve(_training(model)), state.task)
        if separate or router.separate_batches(model, args, kwargs):
            outputs = []
            for k in range(router.components):
                for _ in range(samples):
                    with mode(model, component=k, noise=noise):
                        outputs.append(model(*args, **kwargs))
            return outputs
        root = find_root(model)
        seen: list = []
        # a module of one's own around the converted model: does it return the root's output as it is? (what the
        # root's task says of it holds only then; the hook runs after the root's own.) Not watched on the root or a
        # known wrapper (DDP, torch.compile's), whose output is the root's: a hook would recompile a compiled model
        handle = None if hands_on_root_output(model) else root.register_forward_hook(lambda m, a, out: seen.append(out))
        try:
            with mode(model, Route.TILE, samples=samples, noise=noise):
                output = model(*args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
        state.handed_on = handle is None or any(out is output for out in seen)
    state = router.state  # (the pass's, kept after it)
    check_rows(model, output, members=state.members, batch=state.batch, axis=state.axis)
    return split_output(model, output)


def _one_model(model: nn.Module, caller: str) -> ModelState:
    """The state of the converted model ``model`` is or holds; a module holding several side by side is refused,
    naming them (a mode would reach the first only: its members and the others' would not line up)."""
    if is_root(model):  # the converted model itself (any other root inside it is a part of it)
        return model_state(model)
    roots = [(name, m) for name, m in model.named_modules() if is_root(m)]
    outer = [(name, m) for name, m in roots if not any(o is not m and inside(name, [n]) for n, o in roots)]
    if len(outer) > 1:
        names = ", ".join(repr(name) for name, _ in outer)
        raise ValueError(
            f"{type(model).__name__} holds {len(outer)} converted models ({names}); {caller} acts on one: call it on "
            f"each (e.g. {caller}(model.{outer[0][0]}, ...)), or convert the whole model once."
        )
    return model_state(model)


def _warn_running_statistics(root: nn.Module, state: ModelState) -> None:
    """Once per model: predict() (and uncertainty()) on a model left in training mode update its batch norms'
    running statistics from the batch, which nothing else would say (evaluate() switches to eval itself)."""
    norms = [
        name for name, m in root.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]  # fmt: skip
    if norms:
        state.warned.add("predict in training")
        warnings.warn(
            f"bayesify.predict ran {type(root).__name__} in training mode: its batch norms ({', '.join(norms[:3])}"
            f"{' ...' if len(norms) > 3 else ''}) updated their running statistics from this batch, and dropout is on. "
            "Call model.eval() first to evaluate (said once; training mode on purpose needs nothing).",
            stacklevel=3,
        )


def _training(model: nn.Module) -> bool:
    return find_root(model).training
