"""State survives every round trip: state_dict, deepcopy, pickling, devices and dtypes, DDP."""

from __future__ import annotations

import copy
import io
import os

import pytest
import timm
import torch
import torch.distributed as dist
from torch import nn

import bayesify


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=5).eval()
    bayesify.convert(model, components=3)
    with torch.no_grad():  # trained-looking factors, so members differ
        for p in bayesify.rank1_parameters(model):
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _members(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), bayesify.mode(model, route="tile", noise=False):
        return model(x)


X = torch.randn(2, 3, 32, 32)


def test_state_dict_round_trip_is_exact() -> None:
    model = _model()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    fresh = bayesify.convert(timm.create_model("resnet18", num_classes=5), components=3).eval()
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert torch.equal(_members(model, X), _members(fresh, X))


def test_deepcopy_is_independent_and_identical() -> None:
    model = _model()
    clone = copy.deepcopy(model)
    assert torch.equal(_members(model, X), _members(clone, X))
    assert clone.conv1.weight is not model.conv1.weight
    # the copy has its own routing context, shared by its own layers only
    assert clone.conv1.rank1_state.model is clone.rank1_model is not model.rank1_model
    with bayesify.mode(clone, route="tile"):
        assert clone(X).shape == (6, 5)
        assert model(X).shape == (2, 5)


def test_whole_model_pickle_round_trip(tmp_path) -> None:
    model = _model()
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert type(loaded.conv1).__name__ == "Rank1Conv2d" and isinstance(loaded.conv1, nn.Conv2d)
    assert torch.equal(_members(model, X), _members(loaded, X))
    assert loaded.eval()(X).shape == (2, 5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_moves(dtype: torch.dtype) -> None:
    model = _model()
    ref = _members(model, X)
    moved = copy.deepcopy(model).to(dtype)
    assert all(p.dtype == dtype for p in moved.parameters())
    out = _members(moved, X.to(dtype))
    assert out.dtype == dtype
    tol = {torch.bfloat16: 0.15, torch.float16: 0.02, torch.float64: 1e-5}[dtype]
    assert (out.float() - ref).abs().max() <= tol * ref.abs().max()


def test_half_method_and_channels_last() -> None:
    model = _model()
    ref = _members(model, X)
    cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
    torch.testing.assert_close(_members(cl, X.to(memory_format=torch.channels_last)), ref, rtol=1e-4, atol=1e-4)
    half = copy.deepcopy(model).half()
    assert half.conv1.rank1_s.loc.dtype == torch.float16
    assert torch.isfinite(_members(half, X.half())).all()


def test_autocast_keeps_low_precision_activations() -> None:
    model = _model().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(X)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None for p in bayesify.rank1_parameters(model))


def test_ddp_has_no_unused_parameters() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = _model().train()
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(3):  # an unused parameter makes DDP raise on the following iteration
            optimizer.zero_grad()
            loss = ddp(X).logsumexp(-1).mean() + bayesify.kl_divergence(ddp) / 1000
            loss.backward()
            optimizer.step()
        assert all(p.grad is not None for p in ddp.parameters())
        with bayesify.mode(ddp, route="tile"):  # mode() finds the model through the wrapper
            assert ddp(X).shape == (6, 5)
    finally:
        dist.destroy_process_group()
