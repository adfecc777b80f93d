"""What a step costs, counted: the ops it dispatches and the bytes its forward pass holds for the backward.

Counts, not times: they are deterministic and device-independent, so tests hold them and a user can check
their own converted step against the original (``benchmarks/overhead.py`` prints both beside its timings)::

    from bayesify.cost import held_activation_bytes, op_calls

    ops = op_calls(step)                # run step() once before: first-call work is not counted
    held = held_activation_bytes(step)  # step(record=...) sets record.bytes_held before backward()

On a GPU a small-batch step is launch-bound: its time follows the op count, not the FLOPs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HeldBytes", "OpCount", "held_activation_bytes", "op_calls"]


class HeldBytes(TorchDispatchMode):
    """Records every storage the forward pass makes; :meth:`held` is the bytes of those still alive.

    Measured right before ``backward()``, that is what the step holds for its backward pass: the
    tensors autograd saved (each storage once, however many nodes share it, as a ReLU's output that
    the next convolution also saves), the output and loss. Parameters and optimizer state are not
    made in the forward pass, so they are not counted. Device-independent; it sees through the
    ``saved_tensors_hooks`` that bayesify uses to recompute, where counting what is packed would not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}
        self.bytes_held = 0  # set by the step right before its backward pass

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta:
                storage = t.untyped_storage()
                self.made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def held(self) -> int:
        return sum(size for ref, size in self.made.values() if not ref.expired())


class OpCount(TorchDispatchMode):
    """Counts the ops dispatched inside it (every aten op below autograd, views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def op_calls(step: Callable[[], Any]) -> int:
    """The ops one call of ``step`` dispatches (run it once before, so first-call work is not counted)."""
    counter = OpCount()
    with counter:
        step()
    return counter.calls


def held_activation_bytes(step: Callable[..., Any]) -> int:
    """What one training step ``step(record=...)`` holds from its forward pass for its backward: the step runs
    its forward inside ``with record:`` and sets ``record.bytes_held = record.held()`` right before ``backward()``
    (see :class:`HeldBytes`)."""
    record = HeldBytes()
    step(record=record)
    return record.bytes_held
