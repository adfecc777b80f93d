"""Numerics: heavy-tailed samples, extreme parameters, low precision, tiny scales."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import bayesify


def test_cauchy_samples_are_clipped_like_the_reference() -> None:
    layer = bayesify.convert(nn.Linear(64, 64), components=2, posterior="cauchy", prior="cauchy", init_std=5.0)
    rows = torch.zeros(4096, dtype=torch.long)
    samples = layer.rank1_r.sample(rows, noise=True)
    assert samples.abs().max() <= 10.0
    assert (samples.abs() == 10.0).any()  # heavy tails really reach the clip
    unclipped = bayesify.convert(nn.Linear(64, 64), components=2, posterior="cauchy", prior="cauchy", init_std=5.0, clip=None)
    assert unclipped.rank1_r.sample(rows, noise=True).abs().max() > 10.0


@pytest.mark.parametrize("posterior,prior", [("normal", "normal"), ("cauchy", "cauchy"), ("normal", "cauchy")])
def test_kl_and_std_gradients_stay_finite_near_zero_std(posterior: str, prior: str) -> None:
    layer = bayesify.convert(nn.Linear(8, 8), posterior=posterior, prior=prior)
    with torch.no_grad():
        layer.rank1_s.rho.fill_(-40.0)  # scale = softplus(-40) + 1e-7 ~ 1e-7
        layer.rank1_r.rho.fill_(60.0)  # a huge scale
        layer.rank1_r.loc.fill_(1e4)
    layer.train()
    loss = layer(torch.randn(16, 8)).square().mean() + bayesify.kl_divergence(layer)
    loss.backward()
    assert torch.isfinite(loss)
    for p in bayesify.rank1_parameters(layer):
        assert torch.isfinite(p.grad).all()


def test_long_fp16_autocast_run_with_loss_scaling_has_no_nan() -> None:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    bayesify.convert(net, posterior="cauchy", prior="cauchy", init="random_sign", init_sign_p=0.5, task="classification")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    net.train()
    for step in range(300):
        idx = torch.randint(len(x), (64,))
        with torch.autocast("cpu", dtype=torch.float16):
            logits = net(x[idx])
            assert logits.dtype == torch.float16
            loss = F.cross_entropy(logits.float(), y[idx]) + bayesify.kl_divergence(net) / len(x)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        assert torch.isfinite(loss), f"loss became {loss.item()} at step {step}"
    assert all(torch.isfinite(p).all() for p in net.parameters())
    accuracy = (net.eval()(x).argmax(-1) == y).float().mean()
    assert accuracy > 0.8  # and it learned something
