"""``summary()``: what was converted, what was not and why, and what it costs."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from bayesify._weight_uses import WeightUses, watched_parameters
from bayesify.convert import added_after_conversion, default_mapping
from bayesify.inspection import model_task, rank1_layers
from bayesify.mode import mode
from bayesify.model_state import Skip, find_root, hands_on_root_output, model_state

__all__ = ["Summary", "summary"]


@dataclass
class Summary:
    """The conversion report of a model. ``str(summary)`` renders it as a table."""

    model: str
    components: int
    task: str = "auto"  # what evaluation takes the output to mean (see bayesify.predictive)
    converted: list[tuple[str, str, int]] = field(default_factory=list)  # (name, type, params added)
    skipped: dict[str, str] = field(default_factory=dict)  # weight-bearing modules left as they were
    bypassed: dict[str, str] = field(default_factory=dict)  # converted, but not (fully) in the compute path
    shared: dict[str, str] = field(default_factory=dict)  # ran on a batch-independent input: one member for all rows
    changed: dict[str, str] = field(default_factory=dict)  # a parameter of another shape since convert: it raises
    misordered: dict[str, str] = field(default_factory=dict)  # called on m x B rows not in runs of one example's
    original_parameters: int = 0
    added_parameters: int = 0
    probed: bool = False
    # which skips are static guesses (a matrix without a layer class) that an example forward may overrule
    _guessed: set[str] = field(default_factory=set, repr=False)

    @property
    def overhead(self) -> float:
        """Added parameters as a fraction of the original ones."""
        return self.added_parameters / max(self.original_parameters, 1)

    def __str__(self) -> str:
        lines = [
            f"bayesify summary of {self.model}: {len(self.converted)} rank-1 layers, K={self.components}",
            f"parameters: {self.original_parameters:,} original + {self.added_parameters:,} rank-1 "
            f"({100 * self.overhead:.2f}% overhead)",
            f"output: {self.task}" if self.task != "auto" else "output: not stated: pass task= to convert() before "
            "evaluating (see bayesify.predictive)",
        ]
        if self.converted:
            width = max(len(n) for n, _, _ in self.converted) + 2
            lines.append("converted:")
            lines += [f"  {name or '<root>':<{width}}{kind:<28}+{added:,}" for name, kind, added in self.converted]
        if self.skipped:
            lines.append("not converted:")
            lines += [f"  {name or '<root>'}: {why}" for name, why in self.skipped.items()]
        if self.changed:
            lines.append("converted, then changed (its forward raises):")
            lines += [f"  {name or '<root>'}: {why}" for name, why in self.changed.items()]
        if self.bypassed:
            lines.append("converted but not in the compute path:")
            lines += [f"  {name or '<root>'}: {why}" for name, why in self.bypassed.items()]
        if self.shared:
            lines.append("converted, one component for every member's rows:")
            lines += [f"  {name or '<root>'}: {why}" for name, why in self.shared.items()]
        if self.misordered:
            lines.append("converted, the rows of several examples in one component's run (members mixed):")
            lines += [f"  {name or '<root>'}: {why}" for name, why in self.misordered.items()]
        if self.probed and not self.bypassed and not self.shared and not self.misordered:
            lines.append("every converted layer ran in the example forward pass")
        elif self.changed and not self.probed:
            lines.append("(no example forward pass: it would raise for the layers changed after conversion)")
        elif not self.probed and not self.bypassed:
            lines.append("(pass an example input to summary() to check that every converted layer is in the compute path)")
        return "\n".join(lines)


def summary(model: nn.Module, *example_args: Any, **example_kwargs: Any) -> Summary:
    """Report what :func:`bayesify.convert` did to ``model``.

    With an example input (``summary(model, x)``) it also runs one forward pass (no gradients,
    one component, no noise, in the model's own train / eval mode) and names every converted layer
    that did not take part: layers
    whose forward never ran and whose weight was not intercepted, and layers whose weight
    was used by other maths (see ``bayesify.layers._intercept``). It also watches the
    unconverted 2-d+ parameters: one used as a linear map (by ``F.linear``, ``matmul``, a
    convolution, ...) is reported with the one-line ``mapping=`` to convert it, and a module
    whose parameters were only used otherwise (position embeddings, bias tables, scales) is
    dropped from ``skipped`` (see ``bayesify._weight_uses``). The pass leaves the model as it was:
    its buffers (batch norms' running statistics), train / eval flags and the global random number
    generators (CPU and accelerators) are restored after it, and it makes no gradients.
    """
    state = model_state(model)
    task = str(model_task(model))
    if not hands_on_root_output(model):  # (a module of one's own around the converted part: its output may be another)
        task += f" (the output of its converted part, {type(find_root(model)).__name__}; uncertainty / evaluate ask task= where the model returns another)"
    report = Summary(model=type(model).__name__, components=state.components, task=task)
    added_ids = set()
    for name, layer in rank1_layers(model):
        added = list(layer.rank1_parameters())
        added_ids.update(id(p) for p in added)
        report.converted.append((name, type(layer).__rank1_base__.__name__, sum(p.numel() for p in added)))
    report.added_parameters = sum(p.numel() for p in model.parameters() if id(p) in added_ids)
    report.original_parameters = sum(p.numel() for p in model.parameters() if id(p) not in added_ids)

    skips: dict[str, Skip] = {**state.report.skipped, **added_after_conversion(model, state.report.skipped)}
    report.skipped = {name: skip.message for name, skip in skips.items()}
    report._guessed = {name for name, skip in skips.items() if skip.guessed}

    for name, layer in rank1_layers(model):
        used = layer.rank1_state.bypassed_by
        if used:
            report.bypassed[name] = f"weight used directly by {', '.join(sorted(used))} (not intercepted)"
        changed = layer.rank1_changed()  # the words of the error its call raises
        if changed is not None:
            report.changed[name] = changed
    if (example_args or example_kwargs) and not report.changed:
        report.probed = True
        _probe(model, report, example_args, example_kwargs)
        report.misordered = _row_order(model, example_args, example_kwargs)
    return report


def _row_order(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, str]:
    """The converted layers called on ``m x B`` rows (``m > 1``) that are not each example's ``m`` rows one after
    another, as bayesify routes them (row ``i`` through example ``i // m``'s component: windows, tokens flattened
    batch-first), but laid out otherwise: a ``torch.cat`` of two batches, a time-major ``[T, B]`` flattened. Shapes
    cannot tell these apart; moving example 0 of the inputs (its floating-point values, or its tokens: a grid of
    integers ``[B, T]`` or more, each taken to the next id in the batch's range) and seeing which rows of each call
    move can. Two passes in evaluation, one component, nothing left behind; {} where no input can be moved."""
    batch_dim = model_state(model).options.batch_dim
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > batch_dim]
    sizes = {t.shape[batch_dim] for t in tensors}

    def movable(t: torch.Tensor) -> bool:  # (not 1-D integers: lengths, which packing may need sorted)
        tokens = not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool and t.dim() >= 2
        return t.is_floating_point() or (tokens and t.numel() > 0 and int(t.max()) > 0)

    if len(sizes) != 1 or next(iter(sizes)) < 2 or not any(movable(t) for t in tensors):
        return {}
    batch = next(iter(sizes))

    def moved(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dim() <= batch_dim or not movable(t):
            return t
        t = t.clone()
        if t.is_floating_point():
            t.select(batch_dim, 0).add_(1.0)
        else:  # each of example 0's tokens the next id, within the ids the batch uses (no id outside a vocabulary)
            row = t.select(batch_dim, 0)
            row.copy_(((row.long() + 1) % (int(t.max()) + 1)).to(t.dtype))  # (in int64: uint8's 255 + 1 wraps)
        return t

    seen: list[dict[str, list[torch.Tensor]]] = [{}, {}]
    layers = dict(rank1_layers(model))
    for calls, (a, k) in zip(seen, ((args, kwargs), tree_map(moved, (args, kwargs)))):
        def keep(module: nn.Module, inputs: tuple, name: str = "", calls: dict = calls) -> None:
            x = inputs[0] if inputs else None
            if isinstance(x, torch.Tensor) and x.dim() > 1:
                axis = module.rank1_batch_axis(x)  # (the layer's own: an attention or RNN that is time-major says 1)
                if axis is not None:
                    calls.setdefault(name, []).append(x.detach().movedim(axis, 0).clone())

        handles = [layer.register_forward_pre_hook(partial(keep, name=name)) for name, layer in layers.items()]
        try:
            one = mode(model, "component", component=0, noise=False)
            with _untouched(model, a, k), torch.no_grad(), one, _unwarned(model):
                model.eval()  # (no batch statistics: only example 0's own rows move)
                model(*a, **k)
        finally:
            for handle in handles:
                handle.remove()
    found = {}
    for name, calls in seen[0].items():
        for before, after in zip(calls, seen[1].get(name, [])):
            rows = before.shape[0]
            if before.shape != after.shape:
                continue
            if rows % batch:
                if _batch_elsewhere(before, after, batch):  # (with another length each pass warns; now listed too)
                    found[name] = (
                        f"called on {rows} rows at its batch axis, while example 0's input moves only the first entry "
                        f"of another axis of size {batch}: its batch lies there (a time-major [T, B, C] input), so "
                        "each row is not one example and the members mix here. Make the layer batch-first "
                        "(batch_first=True), or say where its batch lies (convert(..., batch_dim=...))"
                    )
                    break
                continue
            m = rows // batch
            moved_rows = (before != after).flatten(1).any(1).nonzero().flatten()
            if not moved_rows.numel() or int(moved_rows.max()) < m:
                continue
            if m == 1:  # as many rows as examples, yet example 0's input moved others: the batch is on another axis
                found[name] = (
                    f"called on {rows} rows at its batch axis, example 0's input moving rows {moved_rows[:4].tolist()}: "
                    "its batch lies on another axis (a time-major [T, B, C] input whose T equals B), so each row is "
                    "not one example and the members mix here. Make the layer batch-first (batch_first=True), or "
                    "say where its batch lies (convert(..., batch_dim=...))"
                )
            else:
                found[name] = (
                    f"called on {m} x {batch} rows, example 0's at rows {moved_rows[:4].tolist()}, not rows 0-{m - 1}: "
                    f"bayesify gives row i the component of example i // {m}, so the members mix here (a torch.cat "
                    "of batches, or a time-major [T, B] flattened). Call the layer once per batch, or flatten "
                    "batch-first (x.transpose(0, 1).reshape(-1, ...))"
                )
            break
    return found


def _batch_elsewhere(before: torch.Tensor, after: torch.Tensor, batch: int) -> bool:
    """Whether moving example 0 changed ``after`` only at index 0 of an axis of ``batch`` entries (not the first:
    the call's batch axis, moved there)."""
    moved = before != after
    for axis in range(1, moved.dim()):
        if moved.shape[axis] == batch and moved.movedim(axis, 0).flatten(1).any(1).nonzero().flatten().tolist() == [0]:
            return True
    return False


def _probe(model: nn.Module, report: Summary, args: tuple, kwargs: dict) -> None:
    ran: set[str] = set()
    handles = []
    layers = dict(rank1_layers(model))
    for name, layer in layers.items():
        layer.rank1_state.bypassed_by = set()
        layer.rank1_state.intercepted_by = None
        layer.rank1_state.batch_independent, layer.rank1_state.batch_dim_hint = False, ""
        handles.append(layer.register_forward_pre_hook(lambda m, a, n=name: ran.add(n)))
    watcher = WeightUses(watched_parameters(model, layers))
    try:
        with _untouched(model, args, kwargs), torch.no_grad(), mode(model, "component", component=0, noise=False):
            with watcher, _unwarned(model):
                model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    modules = dict(model.named_modules())
    linear, not_linear = watcher.verdicts(modules)
    convertible = tuple(default_mapping())
    for name in linear:
        if isinstance(modules[name], convertible):  # a layer put in after the conversion (a new head)
            linear[name] = (f"{type(modules[name]).__name__} was not converted (added after bayesify.convert?); "
                            "call bayesify.convert(model) again to convert it")  # fmt: skip
    for name, why in linear.items():
        if name not in report.skipped or name in report._guessed:
            report.skipped[name] = why
    for name in not_linear:
        if name in report._guessed:
            del report.skipped[name]
    for name, layer in layers.items():
        used = layer.rank1_state.bypassed_by
        if used:
            report.bypassed[name] = f"weight used directly by {', '.join(sorted(used))} (not intercepted)"
        elif name not in ran and not layer.rank1_state.intercepted_by:
            report.bypassed[name] = "never ran in the example forward pass (unused, or its weight is read elsewhere)"
        elif layer.rank1_state.batch_independent:
            report.shared[name] = ("ran on an input that does not depend on the batch: one component's factors for "
                                     f"every member's rows (not their exact mixture); convert(..., exclude=[{name!r}]) "
                                     "keeps it deterministic" + _sentence(layer.rank1_state.batch_dim_hint))  # fmt: skip


def _sentence(hint: str) -> str:
    return f". {hint.strip()}" if hint else ""


@contextmanager
def _unwarned(model: nn.Module) -> Iterator[None]:
    """summary()'s own passes: what a pass warns of once (a weight used by other maths) is what summary reports, so
    it is not warned here, and a training pass still warns of it once afterwards."""
    state = model_state(model)
    before = set(state.warned)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*'s weight was used by .* outside the layer")
            yield
    finally:  # (only those unsaid here are forgotten: a warning the pass did show stays said)
        state.warned -= {key for key in state.warned - before if key.startswith("bypassed ")}


@contextmanager
def _untouched(model: nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
    """Run the example pass in the model's own mode (a layer that runs only in training is still seen in
    the compute path) yet leave nothing of it behind: an inspection must not shift a pretrained model's
    evaluation. A batch norm in training mode updates its running statistics from the example batch, and
    dropout draws from the global generators: every buffer (the tensor object and its values), every
    train / eval flag and the generators of the devices in use are put back as they were."""
    buffers = [
        (module, name, buffer, buffer.detach().clone())
        for module in model.modules() for name, buffer in module._buffers.items()
        if buffer is not None and not buffer.is_inference()  # (an inference tensor cannot change outside one)
    ]  # fmt: skip
    flags = [(module, module.training) for module in model.modules()]
    devices: dict[str, set[int]] = {}
    for tensor in [*model.parameters(), *model.buffers(), *tree_leaves((args, kwargs))]:
        if isinstance(tensor, torch.Tensor) and tensor.device.type not in ("cpu", "meta"):
            devices.setdefault(tensor.device.type, set()).add(tensor.device.index or 0)
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))  # the CPU generator
        for kind, indices in devices.items():
            backend = getattr(torch, kind, None)  # (one without a generator of torch's, XLA's, is not forked)
            if backend is not None and hasattr(backend, "get_rng_state"):
                if hasattr(backend, "current_device"):  # where a bare device="cuda" in the forward draws
                    indices.add(backend.current_device())
                stack.enter_context(torch.random.fork_rng(devices=sorted(indices), device_type=kind))
        try:
            yield
        finally:
            # every buffer copied back, not only those whose version counter moved: a batch norm's kernel updates
            # its running statistics without bumping theirs
            with torch.no_grad():
                for module, name, buffer, saved in buffers:
                    module._buffers[name] = buffer  # (a forward may have put a new tensor in its place)
                    buffer.copy_(saved)
            for module, training in flags:
                module.training = training
