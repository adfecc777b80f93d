"""freeze_base: a Bayesian adapter (only the rank-1 parameters train) and the way back."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

import bayesify
from bayesify.training import param_groups


def _resnet() -> nn.Module:
    return bayesify.convert(timm.create_model("resnet18", num_classes=10, in_chans=1), init="preserve")


def test_only_the_rank1_parameters_stay_trainable() -> None:
    model = _resnet()
    assert bayesify.freeze_base(model) is model
    rank1 = {id(p) for p in bayesify.rank1_parameters(model)}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == rank1
    fraction = sum(p.numel() for p in bayesify.rank1_parameters(model)) / sum(p.numel() for p in model.parameters())
    assert 0.005 < fraction < 0.02  # the "~1% trainable" of a ResNet-18 adapter (K=4)


def test_an_adapter_step_moves_the_rank1_parameters_only() -> None:
    model = bayesify.freeze_base(_resnet()).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(param_groups(model, lr=0.1))
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    loss = nn.functional.cross_entropy(model(x), y) + bayesify.kl_divergence(model) / 100
    loss.backward()
    optimizer.step()
    moved = set()
    for name, p in model.named_parameters():
        is_rank1 = "rank1_" in name
        assert (p.grad is not None) == is_rank1, name
        if not torch.equal(p.detach(), before[name]):
            moved.add(name)
    # (r of a conv followed by train-mode batch norm gets ~0 gradient: the norm removes per-channel scales)
    assert moved <= {n for n in before if "rank1_" in n} and "fc.rank1_s.loc" in moved
    assert model.fc.rank1_r.grad().abs().sum() > 0 and model.fc.rank1_s.grad().abs().sum() > 0


def test_frozen_false_makes_every_parameter_trainable_again() -> None:
    model = bayesify.freeze_base(_resnet())
    model.conv1.weight.requires_grad_(False)
    bayesify.freeze_base(model, frozen=False)
    assert all(p.requires_grad for p in model.parameters())


def test_rank1_parameters_frozen_by_other_code_are_turned_back_on() -> None:
    # e.g. peft's get_peft_model freezes every non-LoRA parameter, the rank-1 factors included
    model = _resnet()
    for p in model.parameters():
        p.requires_grad_(False)
    bayesify.freeze_base(model)
    assert all(p.requires_grad for p in bayesify.rank1_parameters(model))


def test_batch_norm_statistics_still_update_in_train_mode_as_documented() -> None:
    # freeze_base freezes parameters, not buffers: the running statistics are the user's choice (module doc)
    model = bayesify.freeze_base(_resnet()).train()
    mean = model.bn1.running_mean.clone()
    model(torch.randn(4, 1, 16, 16) + 3.0)
    assert not torch.equal(model.bn1.running_mean, mean)
    model.bn1.eval()  # the documented way to keep them
    mean = model.bn1.running_mean.clone()
    model(torch.randn(4, 1, 16, 16) + 3.0)
    assert torch.equal(model.bn1.running_mean, mean)


def test_bad_input_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"no rank-1 layer.*call bayesify.convert\(model\) first"):
        bayesify.freeze_base(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="takes an nn.Module, got dict"):
        bayesify.freeze_base({})  # type: ignore[arg-type]
