"""``bayesify.cost``: the counts the benchmarks print and the tests hold are what they say."""

from __future__ import annotations

import torch

from bayesify.cost import HeldBytes, held_activation_bytes, op_calls


def test_op_calls_counts_each_dispatched_op_once() -> None:
    x = torch.randn(8)
    assert op_calls(lambda: x.add(1).mul(2)) == 2
    assert op_calls(lambda: x.view(2, 4)) == 1  # views dispatch too
    assert op_calls(lambda: None) == 0


def test_held_bytes_counts_what_the_backward_keeps_once_and_not_what_died() -> None:
    x = torch.randn(256, requires_grad=True)

    def step(record: HeldBytes) -> None:
        with record:
            (x * 2).sum()  # made and freed in the forward: not held
            h = x.exp()  # exp keeps its output for the backward ...
            loss = (h + h.sin()).sum()  # ... and sin its input: one storage, counted once
            record.bytes_held = record.held()
        loss.backward()

    # h (1 KiB, saved by exp and by sin) and the loss (4 bytes); x * 2, sin's output and the sum's input are freed
    assert held_activation_bytes(step) == 256 * 4 + 4
