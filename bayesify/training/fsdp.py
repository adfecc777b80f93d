"""FSDP2 for converted models: ``fully_shard`` on the blocks and the root, and gathering a sharded model back.

Run under ``torchrun --nproc-per-node N`` (``gloo`` on the CPU, ``nccl`` on GPUs), after ``convert`` and
before the optimizer is made::

    model = bayesify.convert(net, components=4)
    bayesify.training.shard(model)                         # fully_shard(block) for each block, then the root
    optimizer = torch.optim.AdamW(model.parameters())      # made after shard: it sees the sharded Parameters
    loss = F.cross_entropy(model(x), y) + bayesify.kl_loss(model, len(train_set))

**Where the factors live.** Every factor's ``loc`` / ``rho`` and every bias offset is a Parameter of its own
layer (``variational/store.py``), so it belongs to its block's FSDP unit and is sharded with the block's other
Parameters (by rows, FSDP2's ``Shard(0)``), gathered for the block's forward and reduce-scattered with its
gradients, like the layer's weight. The root's forward pre-hook, which draws every table of the model at once
when the tables can be joined, finds them sharded there: it draws only the random numbers for the pass (one
tensor per group, ``TableGroup.noise``), and each layer takes its values from its own gathered tables and its
columns of them in its forward (``TableGroup.draw_one``), so a sharded model draws what the unsharded one does.

**The KL.** ``kl_divergence`` of a sharded model is the KL of the whole model on every rank, counted once: the
tables a block holds sharded are summed per rank and added up over the ranks (``full_tensor``, an all-reduce
whose backward leaves each rank the gradient of its own rows), the ones the root holds gathered between its
forward and backward are summed whole. Each rank's loss then holds the full KL once, and FSDP's mean over ranks
of the gradients gives exactly the unsharded gradient.

**A plain model back.** :func:`gather` loads the full state dict of a sharded model into an unsharded converted
model built the same way (on the CPU, on rank 0 by default), for ``bayesify.merge``, export or a plain
``torch.save``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch.distributed as dist
from torch import nn

from bayesify import hf
__all__ = ["find_blocks", "gather", "shard"]

BlockSpec = Iterable["type[nn.Module] | str"]


def _class_names(spec: BlockSpec) -> tuple[set[type], set[str]]:
    types, names = set(), set()
    for item in spec:
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            types.add(item)
        else:
            raise TypeError(f"blocks= takes module classes or class names, got {item!r}.")
    return types, names


def _is_block(module: nn.Module, types: set[type], names: set[str]) -> bool:
    # a converted layer's class is a generated subclass of its original class: match either name
    return isinstance(module, tuple(types)) or any(c.__name__ in names for c in type(module).__mro__)


def find_blocks(model: nn.Module, blocks: BlockSpec | None = None) -> list[nn.Module]:
    """The modules to shard one by one before the root (each becomes one FSDP unit: gathered for its forward).

    ``blocks`` names them by class (or class name). Without it: a Hugging Face model's ``_no_split_modules``
    (its decoder layers), else the children of the outermost ``nn.Sequential`` / ``nn.ModuleList`` whose
    children are two or more modules of one class (a timm ViT's ``blocks``, a torchvision ResNet's stages'
    ``BasicBlock`` / ``Bottleneck``, most timm models' ``stages`` or ``blocks``).

    Raises:
        ValueError: no such module in ``model`` (pass ``blocks=`` with its block class).
    """
    if blocks is None:
        blocks = hf.block_class_names(model)
    if blocks is not None:
        types, names = _class_names(blocks)
        found = [m for m in model.modules() if m is not model and _is_block(m, types, names)]
        outermost = [m for m in found if not any(m is not o and m in set(o.modules()) for o in found)]
        if not outermost:
            wanted = sorted({t.__name__ for t in types} | names)
            raise ValueError(f"blocks={wanted} matches no module of {type(model).__name__}; pass blocks= with its block classes.")
        return outermost
    found: list[nn.Module] = []
    stack = [model]
    while stack:  # pre-order: a matched container's subtree is not searched again
        module = stack.pop()
        children = list(module.children())
        if (
            module is not model
            and isinstance(module, (nn.Sequential, nn.ModuleList))
            and len(children) >= 2
            and len({type(c) for c in children}) == 1
            and any(p.requires_grad for c in children for p in c.parameters())
        ):
            found.extend(children)
            continue
        stack.extend(reversed(children))
    return found  # none: the root is the one unit (gathered whole for each pass; still sharded at rest)


def _check_can_shard(model: nn.Module) -> None:
    from bayesify.inspection import is_converted

    if not is_converted(model):
        raise ValueError(f"{type(model).__name__} is not converted; call bayesify.convert(model) before shard(model).")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "bayesify.training.shard needs a process group: start with `torchrun --nproc-per-node N ...` and call "
            "torch.distributed.init_process_group (or bayesify.training.setup()) first."
        )
    device = next(model.parameters()).device
    if device.type == "xla":
        raise ValueError("FSDP2 (fully_shard) does not run on XLA devices; use torch-xla's own SPMD / FSDP, or --strategy ddp.")
    if device.type == "meta":
        raise ValueError("shard a model with real weights (to_empty + load first), not one on the meta device.")


def shard(
    model: nn.Module,
    *,
    blocks: BlockSpec | None = None,
    mesh: Any = None,
    reshard_after_forward: bool | None = None,
    mp_policy: Any = None,
) -> nn.Module:
    """``fully_shard`` each block of a converted ``model`` (see :func:`find_blocks`), then its root.

    The root's unit holds everything outside the blocks: the embeddings and the head (with its factors); each
    block's unit holds its layers' factors (the module doc says how they are drawn). Call it before making the
    optimizer.

    Args:
        model: a converted model (``bayesify.convert``), its weights on this rank's device.
        blocks: module classes (or class names) to shard one by one; default: found (:func:`find_blocks`).
        mesh, reshard_after_forward, mp_policy: passed to ``torch.distributed.fsdp.fully_shard``.

    Returns:
        ``model``, sharded in place.

    Raises:
        ValueError: ``model`` is not converted, there is no process group, or it is on XLA or the meta device.
    """
    from torch.distributed.fsdp import fully_shard

    _check_can_shard(model)
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for block in find_blocks(model, blocks):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def gather(model: nn.Module, into: nn.Module | Callable[[], nn.Module], *, rank0_only: bool = True) -> nn.Module | None:
    """The full weights of a sharded converted ``model`` in an unsharded one, ``into``.

    ``into`` is (or builds) the same network converted with the same options, unsharded, anywhere (the CPU;
    built on the meta device it is materialised on the CPU). Every rank must call this (it gathers); with
    ``rank0_only`` only rank 0 builds and returns ``into`` (the others get None). The result is a plain
    converted model: ``bayesify.merge(result, component=k)``, ``torch.onnx.export``, ``torch.save``.

    Example:
        >>> plain = bayesify.training.gather(model, lambda: bayesify.convert(build(), components=4))
        >>> if plain is not None:                       # rank 0
        ...     member = bayesify.merge(plain, component=0)
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank0_only and dist.get_rank() != 0:
        return None
    target = into() if callable(into) and not isinstance(into, nn.Module) else into
    if any(p.is_meta for p in target.parameters()):
        target.to_empty(device="cpu")
    target.load_state_dict(state)
    return target

