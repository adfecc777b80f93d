"""A model's output structure reduced by its task: which task each leaf has, and the mixture of its members.

The router tiles a batch for the members and hands the tiled output here with the batch axis of
each leaf; this module decides, leaf by leaf, what the members reduce to (the leaf's task, see
:meth:`~bayesify.predictive.tasks.Task.for_output`), reduces packed sequences per sequence, and
lets a task finish the structure (a Hugging Face ``loss`` recomputed from the mixture's logits).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten_with_path, tree_unflatten

from bayesify.mixture import split_members
from bayesify.predictive.libraries import PAIRWISE_OUTPUTS, huggingface_model, infer_task
from bayesify.predictive.tasks import (
    Auto,
    Binary,
    Classification,
    CustomTask,
    Gaussian,
    Members,
    Task,
    TaskMap,
    refuse_probabilities,
    refuse_sigmoid_outputs,
)  # fmt: skip

__all__ = [
    "check_leaf", "check_rows", "described", "is_packed", "leaf_task", "output_key", "primary_leaf", "primary_output", "reduce_output",
    "rows_axis", "selected_output",
]  # fmt: skip


def is_packed(value: object) -> bool:
    return isinstance(value, PackedSequence)


def members_own_pairs(key: Any, t: object, members: int, batch: int) -> object:
    """A pairwise output of a tiled pass (``key`` in :data:`~bayesify.predictive.libraries.PAIRWISE_OUTPUTS`,
    ``[M*B, M*B]``, whose blocks off the diagonal pair one member's examples with another's) as each member's own
    pairs, the diagonal blocks stacked on the rows, ``[M*B, B]``; any other leaf as it is. (Reduced on its rows
    alone, it came back ``[B, M*B]``: the similarity of the mixture's images with every member's texts.)"""
    rows = members * batch
    if key in PAIRWISE_OUTPUTS and isinstance(t, Tensor) and t.dim() == 2 and t.shape[0] == t.shape[1] == rows and batch:
        return torch.cat([t[k * batch : (k + 1) * batch, k * batch : (k + 1) * batch] for k in range(members)])
    return t


def output_key(path: tuple) -> Any:
    """The top-level key, attribute or index of an output leaf's path (None for a bare tensor)."""
    if not path:
        return None
    entry = path[0]
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return None


def leaf_task(task: Task, key: Any, model: nn.Module, leaf: object = None, members: int | None = None) -> Task:
    """The task of the output leaf at top-level ``key`` (None: the output itself); ``model`` and ``leaf`` name
    what the one-line error is about when nobody said what the leaf means."""
    if isinstance(task, Auto):
        size = leaf.shape if isinstance(leaf, Tensor) else leaf if isinstance(leaf, torch.Size) else None
        shape = "" if size is None else f" of shape {tuple(size)}"
        reduce = f", so it cannot reduce its {members} members to one prediction" if members else ""
        raise ValueError(
            f"bayesify does not know what the output{shape} of {type(model).__name__} means{reduce}; say it with "
            "bayesify.convert(model, task=...) or bayesify.mode(model, task=...): 'classification' (softmax), 'binary' "
            "or 'multilabel' (sigmoids), 'regression' (mean), 'gaussian' (mean, log-variance), or 'members' (no "
            "reduction)."
        )
    found = task.for_output(key)
    if found is None:
        raise ValueError(
            f"task={task} names no task for the output {key!r} of {type(model).__name__}; add {key!r} to the task "
            "mapping."
        )
    return found


def reduce_output(
    model: nn.Module,
    output: object,
    task: Task,
    *,
    members: int,
    batch: int,
    axis: int | None,
    axes: list[int | None],
    inputs: dict,
    look: bool = False,
) -> object:
    """The mixture predictive of a tiled ``output`` (``members * batch`` rows at each leaf's batch axis ``axes``;
    ``axis`` None: one unbatched example, the members along the leaf's axis); ``inputs``: the call's keyword
    arguments (a task may read them, e.g. a Hugging Face model's ``labels``). ``look``: a model's first mixture
    pass, whose class outputs are looked at for probabilities (:func:`~bayesify.predictive.tasks.refuse_probabilities`)."""
    leaves, tree = tree_flatten_with_path(output, is_leaf=is_packed)
    primary = primary_leaf(output)

    def reduce(path: tuple, t: object, dim: int | None) -> object:
        key = output_key(path)
        if axis is not None:
            t = members_own_pairs(key, t, members, batch)
            dim = rows_axis(t, dim, members * batch)
        if isinstance(t, PackedSequence):
            return _reduce_packed(t, members, batch, leaf_task(task, key, model, t, members))
        if task.recomputes(key):
            return t
        floating = isinstance(t, Tensor) and t.is_floating_point() and dim is not None
        if floating and axis is not None and not (t.dim() > dim and t.shape[dim] == members * batch):
            # no member rows: what the task must reduce (the primary output, an output the task names) is refused;
            # anything else passes as it is (a scalar auxiliary loss, a leaf with the rows folded with other axes)
            if batch and (t is primary or isinstance(task, TaskMap) and task.get(key) is not None):
                _refuse_rows(model, t, members, batch, axis)
            if t.dim() == 0:
                _warn_scalar(model, key, members)
            return t
        if isinstance(t, Tensor) and not floating and dim is not None and axis is not None and t.dim() > dim and (
            t.shape[dim] == members * batch
        ):
            said = task.get(key) if isinstance(task, TaskMap) else task
            if not isinstance(said, (Members, CustomTask)):
                _refuse_discrete(model, key, t, members)
            return said.reduce(split_members(t, members, dim))
        if not floating or t.dim() <= dim:
            return t
        stacked = t.movedim(dim, 0) if axis is None else split_members(t, members, dim)
        found = leaf_task(task, key, model, stacked.shape[1:], members)  # (a shape: no op to take one)
        check_leaf(found, key, model, stacked.shape[1:], None if axis is None else dim)
        if axis is not None:
            _warn_two_row_axes(model, t, dim, members * batch, found, stacked.shape[1:])
        if found is task and isinstance(task, (Classification, Binary, Gaussian)):
            as_logits.append((key, tuple(stacked.shape[1:])))  # (a member's shape: what the user's model returns)
            if isinstance(task, Gaussian) and len(as_logits) > 1:  # a (mean, log_var) tuple: two heads of D / 2 each
                raise ValueError(
                    f"task='gaussian' takes one tensor of means and variances, but {type(model).__name__} returned "
                    f"several (shapes {_shapes(as_logits)}), each of which would be reduced as a head of its own; "
                    f"return torch.cat([mean, log_var], -1), or name each output's task with a dict (e.g. "
                    f"task={_example_tasks(as_logits, 'gaussian')})."
                )
        if look and isinstance(found, Classification):
            refuse_probabilities(stacked, found.axis(stacked.shape[1:]) + 1)
        elif look and isinstance(found, Binary):
            refuse_sigmoid_outputs(stacked, model)
        return found.reduce(stacked)

    as_logits: list[tuple[int, ...]] = []  # the leaves one task of logits reduced
    reduced = [(output_key(path), reduce(path, t, d)) for (path, t), d in zip(leaves, axes)]
    if len(as_logits) > 1:
        warnings.warn(
            f"task={task.name!r} reduced each of the {len(as_logits)} tensors of {type(model).__name__}'s output "
            f"(shapes {_shapes(as_logits)}) as logits; if some are not (features, a hidden state), say each "
            f"output's task with a dict, e.g. task={_example_tasks(as_logits, task.name)}.",
            stacklevel=2,
        )
    return tree_unflatten(task.finish(model, reduced, inputs), tree)


def _shapes(leaves: list[tuple[Any, tuple[int, ...]]]) -> str:
    return ", ".join(str(shape) for _, shape in leaves)


def _example_tasks(leaves: list[tuple[Any, tuple[int, ...]]], first: str) -> str:
    """A ``task=`` mapping for an error message, keyed as the model's outputs are (a dict's keys, a tuple's indices)."""
    (a, _), (b, _) = leaves[0], leaves[1]
    return f"{{{a!r}: {first!r}, {b!r}: 'regression'}}"


def check_leaf(
    task: Task, key: Any, model: nn.Module, shape: torch.Size, batch_axis: int | None, batch: int | None = None
) -> None:
    """Refuse in one line what ``task`` would make a silently wrong number of: one member's output leaf of ``shape``
    (at top-level ``key``; its batch at ``batch_axis``, None: one unbatched example) whose class axis is its batch
    axis (a softmax across the examples), or has another width than the number of classes the task was inferred
    with (the model's head replaced or removed after ``convert``: features, not logits), unless the model states
    that width now (timm's ``reset_classifier(n)``). Shapes only: nothing runs on the values.

    ``batch``, where known: the examples in the pass. ``batch_axis`` (where the *input* has them) then only says
    whether the pass was batched: an output may put its batch elsewhere (a time-major RNN's last step ``[B, C]``
    with ``batch_dim=1``), so the class axis is refused where it is the one axis of that size."""
    if not isinstance(task, Classification) or not shape:
        return
    axis = task.axis(shape)
    name = type(model).__name__
    if batch is not None:
        across_examples = batch_axis is not None and shape[axis] == batch and list(shape).count(batch) == 1
    else:
        across_examples = batch_axis is not None and axis == batch_axis % len(shape)
    if across_examples:
        raise ValueError(
            f"task='classification' takes a softmax over the class axis, but on the output of shape {tuple(shape)} "
            f"of {name} that axis (dimension {axis}) holds the batch: a softmax across the examples; use "
            "task='binary' for one logit per example, or return [B, C] logits (one per class)."
        )
    width = shape[axis]
    if task.classes is None or width == task.classes:
        return
    now = infer_task(model)
    stated = None if now is None else now.for_output(key)
    if isinstance(stated, Classification) and stated.classes == width:
        return  # a new head the model states (timm's reset_classifier(n)): its logits
    raise ValueError(
        f"the output of shape {tuple(shape)} of {name} has {width} entries on its class axis (dimension {axis}), not "
        f"the {task.classes} classes its task was inferred with at convert() (what the model stated): was its head "
        "replaced or removed? Say what the output is rather than have it softmaxed as logits: "
        "bayesify.mode(model, task='regression') for the members' mean (bayesify.predict(model, x): each member's), "
        "task='classification' for a new head's logits, or bayesify.convert(model, task=...) when converting."
    )


def check_rows(model: nn.Module, output: object, *, members: int, batch: int, axis: int | None) -> None:
    """Refuse in one line a tiled pass's ``output`` whose primary part (:func:`primary_output`) has no dimension of
    ``members * batch`` rows (the batch taken at dimension ``axis`` of the input; None: unbatched, nothing to
    check): its members could not be told apart (:func:`bayesify.predict`)."""
    leaf = primary_leaf(output)
    rows = members * batch
    if axis is not None and batch and isinstance(leaf, Tensor) and rows not in leaf.shape:
        _refuse_rows(model, leaf, members, batch, axis)


def _refuse_rows(model: nn.Module, t: Tensor, members: int, batch: int, axis: int) -> None:
    raise ValueError(
        f"the output of shape {tuple(t.shape)} of {type(model).__name__} has no dimension of {members * batch} rows "
        f"({members} members x the batch of {batch} that bayesify took at dimension {axis} of the input), so its "
        "members cannot be told apart; if the batch lies at another dimension of the input (a time-major "
        "[T, B] sequence), say so with bayesify.convert(model, batch_dim=...); if an input with one entry per "
        "example is a list (pack_padded_sequence's lengths), pass it as a tensor: only tensors are tiled; an input "
        "that holds no batch (nn.EmbeddingBag's 1-D tokens with offsets) cannot be told from: pass [B, L] tokens."
    )


def _warn_two_row_axes(model: nn.Module, t: Tensor, dim: int, rows: int, task: Task, member: torch.Size) -> None:
    """Say which axis an output with two axes of the member rows was reduced at: the input's, which is right for a
    batch-first output whose length is K x B by chance, and wrong for one that puts its batch elsewhere (a
    time-major [T, B, C] output of a batch-first model with T == K x B: its time steps averaged as members). A
    sequence output only (3 axes; a class axis is no batch), and not a Hugging Face model's (batch-first)."""
    if torch.compiler.is_compiling() or t.dim() not in (2, 3) or rows < 2 or list(t.shape).count(rows) < 2:
        return  # (not traced: the sizes' comparison would guard a compiled graph on them)
    if t.dim() == 2 and dim == 0:
        return  # (a batch-first [B, D] with D == K x B: its first axis is the batch)
    if huggingface_model(model) is not None:
        return
    if callable(getattr(model, "rank1_output_axes", None)):  # a converted layer as the model: it states its axes
        return
    classes = task.axis(member) if isinstance(task, Classification) else None
    # (a [T, B, C] / [B, T, C] layout: the batch at 0 or 1; the last axis holds features or classes, never the batch)
    others = [i for i in (0, 1) if t.shape[i] == rows and i not in (dim, classes)]
    if not others:
        return
    layout = "a time-major [T, B, C] output" if others[0] == 1 else "a batch-first [B, C] output of a time-major model"
    warnings.warn(
        f"the output of shape {tuple(t.shape)} of {type(model).__name__} has the pass's {rows} member rows at "
        f"dimensions {dim} and {others[0]}; bayesify took dimension {dim}, where the input holds its batch. If the "
        f"output holds its batch at dimension {others[0]} ({layout}), its mixture is wrong: return the batch at "
        f"dimension {dim}, or evaluate in batches of another size.",
        stacklevel=4,
    )


def _warn_scalar(model: nn.Module, key: Any, members: int) -> None:
    """A scalar output of the tiled pass (a loss the model computes itself) was made over every member's rows: the
    members' average, not the mixture's; said once per output (the warning's text names it)."""
    where = "output" if key is None else f"output {key!r}"
    warnings.warn(
        f"the {where} of {type(model).__name__} is a scalar the model computed over the rows of all {members} members "
        "(a loss: their average, not the mixture's, which the other outputs are); bayesify passes it on as it is. "
        "For the mixture's loss, compute it from the reduced outputs (call the model without its labels).",
        stacklevel=4,
    )


def _refuse_discrete(model: nn.Module, key: Any, t: Tensor, members: int) -> None:
    """An integer or boolean output (an argmax, a mask) has one value per member and no mean: refused in one line
    rather than handed back with the members' rows (a tensor of another length than the batch's)."""
    where = "output" if key is None else f"output {key!r}"
    said = "task='members'" if key is None else f"task={{..., {key!r}: 'members'}}"
    raise ValueError(
        f"the {where} of {type(model).__name__} is {t.dtype} (shape {tuple(t.shape)}: {members} members' rows), "
        "which bayesify cannot average into one prediction; compute it outside the model from the mixture's output "
        f"(e.g. the argmax of its probabilities), or name its reduction: {said} (the members stacked) or a function "
        "of the members stacked [S, B, ...]."
    )


def primary_leaf(output: object) -> object:
    """The primary output's tensor (see :func:`primary_output`), or None where the output has none."""
    try:
        return primary_output(output)[0]
    except ValueError:
        return None


def rows_axis(t: object, dim: int | None, rows: int) -> int | None:
    """The axis of a tiled leaf's ``rows`` (members x batch): where the input has its batch, else the one axis of
    that size (an output that puts the batch elsewhere, as a time-major RNN's last step ``[B, C]`` with
    ``batch_dim=1``); two or more such axes are refused: which one is the batch cannot be told. (Where the input's
    axis has the rows and another axis too, the input's is taken, and :func:`_warn_two_row_axes` says so.)"""
    if not isinstance(t, Tensor) or dim is None or t.dim() == 0 or (t.dim() > dim and t.shape[dim] == rows):
        return dim
    found = [i for i, size in enumerate(t.shape) if size == rows]
    if len(found) > 1:
        raise ValueError(
            f"bayesify cannot tell which dimension of an output of shape {tuple(t.shape)} holds the batch of its "
            f"{rows} member rows (not dimension {dim}, where the input has it); return the batch at dimension {dim}."
        )
    return found[0] if found else dim


def primary_output(output: object) -> tuple[Tensor, object]:
    """The output an uncertainty is about: the tensor, a Hugging Face ``logits``, a segmentation ``out``, or a
    tuple's first element; with its key."""
    if isinstance(output, Tensor):
        return output, None
    if isinstance(output, dict):
        for key in ("logits", "out"):
            if isinstance(output.get(key), Tensor):
                return output[key], key
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0], 0
    raise ValueError(
        f"bayesify.uncertainty cannot tell which part of an output of type {type(output).__name__} to decompose; "
        "call bayesify.predict and pass the members to classification_uncertainty / regression_uncertainty."
    )


def selected_output(value: object, output: object, name: str, caller: str) -> tuple[Tensor, object]:
    """The tensor of a model's output structure ``value`` that ``caller`` (evaluation, ``uncertainty``) is about, and
    its key: the part ``output`` names (a key, a tuple index or an attribute), else the primary one
    (:func:`primary_output`); ``name``: the model's, for an error message."""
    if isinstance(value, Tensor):
        if output is not None:
            raise ValueError(
                f"output={output!r} selects a part of a structured output, but {name} returns one tensor; leave "
                "output out."
            )
        return value, None
    if output is None:
        try:
            return primary_output(value)
        except ValueError:
            raise ValueError(
                f"{caller} cannot tell which part of {name}'s output ({described(value)}) it is about; say it with "
                f"output=, one of: {tensor_parts(value)}."
            ) from None
    if isinstance(value, Mapping):
        found = value.get(output)
    elif isinstance(value, (tuple, list)) and isinstance(output, int) and not isinstance(output, bool):
        found = value[output] if -len(value) <= output < len(value) else None
    else:
        found = getattr(value, output, None) if isinstance(output, str) else None
    if not isinstance(found, Tensor):
        what = "is not a part of" if found is None else f"is not a tensor of predictions ({type(found).__name__}) in"
        raise ValueError(
            f"output={output!r} {what} {name}'s output ({described(value)}); pass one of: {tensor_parts(value)}."
        )
    return found, output


def tensor_parts(value: object) -> str:
    """The parts of an output structure that ``output=`` can name: its tensors."""
    return ", ".join(repr(p) for p in _parts(value) if isinstance(_part(value, p), Tensor)) or "(none: no tensor)"


def _parts(value: object) -> list[object]:
    """The top-level keys (a dict), indices (a tuple or list) or fields (a dataclass) of an output structure."""
    if isinstance(value, Mapping):
        return list(value.keys())
    if isinstance(value, (tuple, list)):
        return list(range(len(value)))
    if dataclasses.is_dataclass(value):
        return [field.name for field in dataclasses.fields(value)]
    return []


def _part(value: object, key: object) -> object:
    return value[key] if isinstance(value, (Mapping, tuple, list)) else getattr(value, key)


def described(value: object) -> str:
    parts = _parts(value)
    kind = type(value).__name__
    if isinstance(value, Mapping):
        return f"a {kind} with keys {', '.join(map(repr, parts))}" if parts else f"an empty {kind}"
    if isinstance(value, (tuple, list)):
        return f"a {kind} of {len(parts)}"
    return f"a {kind}"


def _reduce_packed(packed: PackedSequence, tiles: int, batch: int, task: Task) -> object:
    """The mixture of a packed output of ``tiles * batch`` member-major sequences (any sorted order)."""
    data, batch_sizes, sorted_indices, unsorted_indices = packed
    if not data.is_floating_point() or int(batch_sizes[0]) != tiles * batch or bool((batch_sizes % tiles).any()):
        return packed
    steps, count = batch_sizes.numel(), tiles * batch
    device = data.device
    if sorted_indices is None:
        sorted_indices = unsorted_indices = torch.arange(count, device=device)
    # reduced order: the order of member 0's copies; row (t, q) gathers member k of sequence order[q]
    order = torch.argsort(unsorted_indices[:batch])
    sizes = batch_sizes // tiles
    offsets = (torch.cumsum(batch_sizes, 0) - batch_sizes).to(device)
    step = torch.repeat_interleave(torch.arange(steps, device=device), sizes.to(device))
    position = torch.arange(step.numel(), device=device) - (torch.cumsum(sizes, 0) - sizes).to(device)[step]
    members = torch.arange(tiles, device=device) * batch
    index = offsets[step].unsqueeze(0) + unsorted_indices[members.unsqueeze(1) + order[position].unsqueeze(0)]
    reduced = task.reduce(data[index])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(batch, device=device)
    return PackedSequence(reduced, sizes, order, inverse)
