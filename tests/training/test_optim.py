"""Parameter groups (fast-weight lr multiplier), optimizers, the reference's warm-up + step decay."""

import pytest
import torch
from torch import nn

import bayesify
from bayesify.training.optim import WarmupStepDecay, build_optimizer, param_groups


def _net() -> nn.Module:
    return bayesify.convert(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), components=2)


def test_param_groups_put_rank1_factors_apart_with_the_multiplier():
    net = _net()
    groups = param_groups(net, lr=0.1, fast_weight_lr_multiplier=0.5)
    assert [g["name"] for g in groups] == ["weights", "rank1_factors"]
    factors = {
        id(p)
        for layer in (net[0], net[2])
        for p in (layer.rank1_r.loc, layer.rank1_r.rho, layer.rank1_s.loc, layer.rank1_s.rho)
    }
    assert {id(p) for p in groups[1]["params"]} == factors
    assert groups[1]["lr"] == pytest.approx(0.05) and groups[0]["lr"] == 0.1
    # per-component biases are slow weights, as in the reference
    assert any(p is net[0].rank1_bias for p in groups[0]["params"])
    every = [p for g in groups for p in g["params"]]
    assert len(every) == len(list(net.parameters())) == len({id(p) for p in every})


def test_param_groups_of_a_plain_model_is_one_group():
    assert [g["name"] for g in param_groups(nn.Linear(2, 2), lr=1e-3)] == ["weights"]


def test_multiplier_scales_the_sgd_update_of_factors_only():
    net = _net()
    opt = build_optimizer("sgd", param_groups(net, lr=0.1, fast_weight_lr_multiplier=3.0), lr=0.1, momentum=0.0)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for name, p in net.named_parameters():
        step = float((before[name] - p.detach()).flatten()[0])
        assert step == pytest.approx(0.3 if ".rank1_r." in name or ".rank1_s." in name else 0.1), name


@pytest.mark.parametrize(
    "name, cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("ADAMW", torch.optim.AdamW)]
)
def test_build_optimizer(name, cls):
    opt = build_optimizer(name, param_groups(_net(), lr=0.1), lr=0.1)
    assert isinstance(opt, cls)
    if cls is torch.optim.SGD:
        assert opt.defaults["nesterov"] and opt.defaults["momentum"] == 0.9


def test_bad_optimizer_settings_name_the_value():
    with pytest.raises(ValueError, match="optimizer='lbfgs'"):
        build_optimizer("lbfgs", param_groups(_net(), lr=0.1), lr=0.1)
    with pytest.raises(ValueError, match="fast_weight_lr_multiplier=0"):
        param_groups(_net(), lr=0.1, fast_weight_lr_multiplier=0)


def test_warmup_step_decay_matches_the_reference_schedule():
    # reference WarmUpPiecewiseConstantSchedule(steps_per_epoch=10, warmup 1, decay [3, 5], ratio 0.2)
    f = WarmupStepDecay(10, warmup_epochs=1, decay_epochs=[3, 5], decay_ratio=0.2)
    assert f(0) == 0.0 and f(5) == pytest.approx(0.5)
    assert f(10) == 1.0 and f(29) == 1.0
    assert f(30) == pytest.approx(0.2) and f(49) == pytest.approx(0.2)
    assert f(50) == pytest.approx(0.04) and f(1000) == pytest.approx(0.04)
    assert WarmupStepDecay(10)(0) == 1.0  # no warm-up, no decay: constant


def test_schedule_drives_lambda_lr_on_every_group():
    net = _net()
    opt = build_optimizer("sgd", param_groups(net, lr=0.1, fast_weight_lr_multiplier=2.0), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupStepDecay(2, 1, [2], 0.1))
    lrs = []
    for _ in range(5):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert (
        lrs[1] == pytest.approx([0.05, 0.1])
        and lrs[2] == pytest.approx([0.1, 0.2])
        and lrs[4] == pytest.approx([0.01, 0.02])
    )
