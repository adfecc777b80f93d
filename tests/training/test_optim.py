"""Parameter groups (no decay on bayesify's parameters, fast-weight lr multiplier), optimizers, the reference's
warm-up + step decay."""

import pytest
import timm
import torch
from torch import nn

import bayesify
from bayesify.training.optim import GROUPS, WarmupStepDecay, build_optimizer, param_groups


def _net() -> nn.Module:
    return bayesify.convert(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), components=2)


def _ids(params) -> set[int]:
    return {id(p) for p in params}


def test_param_groups_put_every_parameter_in_its_documented_group():
    net = _net()
    groups = {g["name"]: g for g in param_groups(net, lr=0.1, weight_decay=0.01, fast_weight_lr_multiplier=0.5)}
    assert list(groups) == list(GROUPS) == ["weights", "no_decay", "rank1_factors", "rank1_other"]
    layers = (net[0], net[2])
    # every layer's own factors and bias offsets
    factors = [p for m in layers for f in (m.rank1_s, m.rank1_r) for p in (f.loc, f.rho)]
    assert _ids(groups["weights"]["params"]) == _ids(m.weight for m in layers)
    assert _ids(groups["no_decay"]["params"]) == _ids(m.bias for m in layers)
    assert _ids(groups["rank1_factors"]["params"]) == _ids(factors)
    # per-component bias offsets are slow weights, as in the reference (not in the multiplied group)
    assert _ids(groups["rank1_other"]["params"]) == _ids(m.rank1_bias for m in layers)
    assert [(g["lr"], g["weight_decay"]) for g in groups.values()] == [(0.1, 0.01), (0.1, 0.0), (0.05, 0.0), (0.1, 0.0)]
    every = [p for g in groups.values() for p in g["params"]]
    assert len(every) == len(list(net.parameters())) == len(_ids(every))


def test_param_groups_of_a_plain_model():
    assert [g["name"] for g in param_groups(nn.Linear(2, 2), lr=1e-3)] == ["weights", "no_decay"]
    assert [g["name"] for g in param_groups(nn.Linear(2, 2, bias=False), lr=1e-3)] == ["weights"]


def test_norm_parameters_shared_parameters_and_the_models_own_no_decay_names():
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=3)
    model = bayesify.convert(vit)
    groups = {g["name"]: g for g in param_groups(model, lr=1e-3, weight_decay=0.05)}
    no_decay = _ids(groups["no_decay"]["params"])
    assert id(model.pos_embed) in no_decay and id(model.cls_token) in no_decay  # ViT's no_weight_decay() names
    assert id(model.norm.weight) in no_decay and id(model.blocks[0].norm1.weight) in no_decay
    own = ("pos_embed", "cls_token")
    matrices = [p for n, p in model.named_parameters() if p.ndim >= 2 and "rank1_" not in n and n not in own]
    assert _ids(groups["weights"]["params"]) == _ids(matrices)
    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    assert len(param_groups(tied, lr=1e-3)[0]["params"]) == 1  # a shared parameter is listed once


def test_weight_decay_none_leaves_the_optimizers_default_on_the_weights_only():
    net = _net()
    optimizer = torch.optim.AdamW(param_groups(net, lr=0.1), weight_decay=0.3)
    assert {g["name"]: g["weight_decay"] for g in optimizer.param_groups} == {
        "weights": 0.3, "no_decay": 0.0, "rank1_factors": 0.0, "rank1_other": 0.0
    }  # fmt: skip


def test_adamw_with_the_groups_decays_the_weights_and_leaves_rank1_parameters_alone():
    # one AdamW step with zero gradients is pure decoupled decay: p <- p * (1 - lr * wd)
    net = _net().double()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    optimizer = torch.optim.AdamW(param_groups(net, lr=0.1, weight_decay=0.5))
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in net.named_parameters():
        factor = 1 - 0.1 * 0.5 if name.endswith(".weight") else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, msg=name)


def test_frozen_parameters_are_left_out():
    net = bayesify.freeze_base(_net())
    groups = param_groups(net, lr=0.1)
    assert [g["name"] for g in groups] == ["rank1_factors", "rank1_other"]
    assert _ids(p for g in groups for p in g["params"]) == _ids(bayesify.rank1_parameters(net))


def test_multiplier_scales_the_sgd_update_of_factors_only():
    net = _net()
    opt = build_optimizer("sgd", param_groups(net, lr=0.1, fast_weight_lr_multiplier=3.0), lr=0.1, momentum=0.0)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for name, p in net.named_parameters():
        step = float((before[name] - p.detach()).flatten()[0])
        # every r and s of the model moves 3x; the bias offsets do not
        assert step == pytest.approx(0.3 if ".rank1_s." in name or ".rank1_r." in name else 0.1), name


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
    with pytest.raises(ValueError, match="weight_decay=-0.1 must be >= 0"):
        param_groups(_net(), lr=0.1, weight_decay=-0.1)


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
    # groups: weights, no_decay, rank1_factors (x2), rank1_other
    assert (
        lrs[1] == pytest.approx([0.05, 0.05, 0.1, 0.05])
        and lrs[2] == pytest.approx([0.1, 0.1, 0.2, 0.1])
        and lrs[4] == pytest.approx([0.01, 0.01, 0.02, 0.01])
    )
