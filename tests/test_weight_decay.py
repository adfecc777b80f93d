"""timm's optimizer factory keeps weight decay off every rank-1 parameter (the root's no_weight_decay hook)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import timm
import torch
from timm.optim import create_optimizer_v2
from torch import nn

import bayesify
from bayesify._weight_decay import RANK1_PATTERNS, NoWeightDecay

MODELS = {
    "resnet18": lambda: timm.create_model("resnet18", num_classes=5),
    "vit_tiny": lambda: timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5),
}


def _decay_of(optimizer: torch.optim.Optimizer) -> dict[int, float]:
    return {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.parametrize("layer_decay", [None, 0.75])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_rank1_parameter_is_decayed_by_timm(name: str, layer_decay: float | None) -> None:
    model = bayesify.convert(MODELS[name]())
    decay = _decay_of(create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=layer_decay))
    rank1 = list(bayesify.rank1_parameters(model))
    assert rank1 and all(decay[id(p)] == 0.0 for p in rank1)
    # the network's own matrices are still decayed: the hook adds names, it does not switch decay off
    own = {"pos_embed", "cls_token"}  # ViT's own no-decay names (ResNet has none)
    weights = [p for n, p in model.named_parameters() if p.ndim >= 2 and "rank1_" not in n and n not in own]
    assert weights and all(decay[id(p)] == 0.05 for p in weights)


def test_without_the_hook_timm_would_decay_them() -> None:
    # guards the test above: it can fail (timm decays 2-d parameters unless told otherwise)
    model = bayesify.convert(MODELS["resnet18"]())
    del model.__dict__["no_weight_decay"]
    decay = _decay_of(create_optimizer_v2(model, "adamw", weight_decay=0.05))
    assert all(decay[id(p)] == 0.05 for p in bayesify.rank1_parameters(model))


def test_a_class_with_its_own_no_weight_decay_keeps_its_names() -> None:
    plain = MODELS["vit_tiny"]()
    own = set(plain.no_weight_decay())
    model = bayesify.convert(plain)
    assert own == {"pos_embed", "cls_token", "dist_token", "reg_token"}
    assert model.no_weight_decay() == own | set(RANK1_PATTERNS)
    decay = _decay_of(create_optimizer_v2(model, "adamw", weight_decay=0.05))
    assert decay[id(model.pos_embed)] == 0.0 and decay[id(model.cls_token)] == 0.0


def test_the_model_still_pickles_and_copies_with_the_hook_bound_to_the_copy() -> None:
    model = bayesify.convert(MODELS["resnet18"]())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    for copied in (loaded, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        hook = copied.no_weight_decay
        assert isinstance(hook, NoWeightDecay) and hook.root is copied
        assert hook() == set(RANK1_PATTERNS)
    assert set(model.state_dict()) == set(loaded.state_dict())


def test_revert_removes_the_hook_and_restores_an_instance_level_one() -> None:
    vit = bayesify.convert(MODELS["vit_tiny"]())
    bayesify.revert(vit)
    assert "no_weight_decay" not in vit.__dict__ and vit.no_weight_decay() == {
        "pos_embed", "cls_token", "dist_token", "reg_token"
    }  # fmt: skip

    class Own:  # a picklable instance-level hook a user set before converting
        def __call__(self) -> set[str]:
            return {"scale"}

    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    net.no_weight_decay = Own()
    previous = net.no_weight_decay
    bayesify.convert(net, task="classification")
    assert net.no_weight_decay() == {"scale", *RANK1_PATTERNS}
    bayesify.revert(net)
    assert net.no_weight_decay is previous


def test_a_second_conversion_installs_the_hook_once() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    bayesify.convert(net, include="0", task="classification")
    hook = net.no_weight_decay
    bayesify.convert(net, include="2", task="classification")
    assert net.no_weight_decay is hook and hook.previous is None
