"""The memory figure's pieces: conversion on the meta device, FSDP2's padded shard size, the activation count."""

import pytest
import torch

import bayesify


def test_a_model_converted_on_the_meta_device_loads_real_weights_and_runs():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    real = bayesify.convert(transformers.GPT2LMHeadModel(config), components=4)
    with torch.device("meta"):
        meta = bayesify.convert(transformers.GPT2LMHeadModel(config), components=4)
    assert all(p.is_meta for p in meta.parameters())
    assert meta.state_dict().keys() == real.state_dict().keys()
    meta.to_empty(device="cpu")
    meta.load_state_dict(real.state_dict())
    x = torch.randint(0, 64, (2, 8))
    real.eval(), meta.eval()
    with torch.no_grad():
        torch.testing.assert_close(meta(x).logits, real(x).logits)


def test_the_shard_of_a_rank_is_padded_rows_as_fsdp2_cuts_them():
    from benchmarks.fsdp_memory import sharded_numel

    assert sharded_numel(torch.Size([4, 10]), 1) == 40
    assert sharded_numel(torch.Size([4, 10]), 8) == 10  # one row each, ranks 4..7 hold padding
    assert sharded_numel(torch.Size([10]), 4) == 3


def test_the_converted_model_saves_more_for_the_backward_pass_than_the_deterministic_one():
    pytest.importorskip("transformers")
    from benchmarks.fsdp_memory import activation_bytes

    plain, converted = activation_bytes(4, False, 16, 32), activation_bytes(4, True, 16, 32)
    assert 0 < plain < converted < 3 * plain
