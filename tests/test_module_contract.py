"""A converted model keeps PyTorch's module contract (issue 26): what PyTorch lets a user do to a module does for a
converted layer's rank-1 factors what it does for its weight. One test per idiom, named by it; the rule where a
test is silent is what PyTorch does for a plain ``nn.Linear``.

1. A module's parameters are its own: freezing, training the head alone, groups by module, timm's layer decay,
   ``rank1_parameters(submodule)``, ``requires_grad_`` on a factor, ``summary()``'s counts.
2. A parameter change is seen by the next forward pass, whichever way it was made (``.data``, casts,
   ``load_state_dict(assign=True)``, ``vector_to_parameters``, ``functional_call``, an EMA through ``.data``).
3. Calling part of a model: deterministic where ``mode()`` says so, equal to the whole model's own members, and a
   one-line error where a route needs the root.
"""

from __future__ import annotations

import copy
import io

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import bayesify
from tests._rank1 import perturb

K = 4


def _resnet(num_classes: int = 5) -> nn.Module:
    torch.manual_seed(0)
    model = bayesify.convert(timm.create_model("resnet18", num_classes=num_classes), components=K)
    perturb(model, loc_std=0.1, offset_std=0.1)
    return model


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(5, (n,), generator=g)


def _own_rank1(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if "rank1_" in n}


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _adam_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    x, y = _batch()
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y) + bayesify.kl_loss(model, 1000)
        loss.backward()
        optimizer.step()


def _moved(before: dict[str, torch.Tensor], model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}


# ---- 1. a module's parameters are its own ------------------------------------------------------------------


def test_every_layers_factors_are_parameters_named_under_it() -> None:
    model = _resnet()
    names = set(_own_rank1(model))
    assert {"layer1.0.conv1.rank1_s.loc", "layer1.0.conv1.rank1_s.rho", "fc.rank1_r.loc", "fc.rank1_bias"} <= names
    assert not any(n.startswith("rank1_") for n in names)  # nothing of a layer's lives on the root


def test_freezing_a_block_freezes_its_factors() -> None:
    model = _resnet()
    for p in model.layer1.parameters():
        p.requires_grad = False
    before = _snapshot(model)
    _adam_steps(model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    moved = _moved(before, model)
    assert not {n for n in moved if n.startswith("layer1.")}, "a frozen block's factors trained"
    assert {"fc.rank1_s.loc", "layer2.0.downsample.0.rank1_r.rho"} <= moved


def test_training_the_head_alone_trains_its_factors_and_nothing_else() -> None:
    model = _resnet()
    model.requires_grad_(False)
    model.fc.requires_grad_(True)
    assert all(p.requires_grad for p in bayesify.rank1_parameters(model.fc))
    before = _snapshot(model)
    _adam_steps(model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    moved = _moved(before, model)
    assert moved and all(n.startswith("fc.") for n in moved), moved
    assert {"fc.rank1_s.loc", "fc.rank1_r.loc", "fc.rank1_s.rho"} <= moved  # the head trains as a Bayesian layer


def _outputs_of(model: nn.Module, x: torch.Tensor, *modules: nn.Module) -> list[torch.Tensor]:
    """What each of ``modules`` outputs in one pass of ``model`` on ``x``."""
    seen: dict[int, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o.detach().clone())) for i, m in enumerate(modules)]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(modules))]


def test_a_backbone_in_eval_mode_takes_its_posterior_means_in_a_training_step() -> None:
    """As a dropout there stops: a frozen backbone put in eval mode (its batch norms on their running statistics)
    gives each row its component's features at the means, the same in every step; the head, training, samples."""
    model = _resnet()
    x, _ = _batch(8)

    def backbone_eval() -> None:
        model.train()
        for name, m in model.named_children():
            if name != "fc":
                m.eval()

    backbone_eval()
    torch.manual_seed(0)
    features = _outputs_of(model, x, model.global_pool)[0]
    rows = model.rank1_model.router.state.rows.clone()
    model.eval()
    for k in range(K):  # the rows of component k take member k's features at its means
        with bayesify.mode(model, component=k, noise=False), torch.no_grad():
            means = _outputs_of(model, x, model.global_pool)[0]
        torch.testing.assert_close(features[rows == k], means[rows == k])
    backbone_eval()
    with bayesify.mode(model, component=2):  # one member: the backbone alike in both steps, the head not
        (first, first_out), (second, second_out) = (_outputs_of(model, x, model.global_pool, model.fc) for _ in range(2))
    assert torch.equal(first, second)
    assert not torch.allclose(first_out, second_out)
    with bayesify.mode(model, component=2, noise=True):  # noise said: every layer samples
        first, second = (_outputs_of(model, x, model.global_pool)[0] for _ in range(2))
    assert not torch.allclose(first, second)


def test_a_sub_module_in_training_mode_samples_in_an_evaluation() -> None:
    model = _resnet().eval()
    model.fc.train()
    x, _ = _batch(4)
    with torch.no_grad():
        torch.manual_seed(0)
        first, second = model(x), model(x)
        features = [_outputs_of(model, x, model.layer4)[0] for _ in range(2)]
    assert not torch.allclose(first, second)  # the head samples: an MC-dropout-like evaluation
    assert torch.equal(features[0], features[1])  # the rest is the mixture of the means


def test_an_embedding_in_eval_mode_takes_its_means_in_a_training_step() -> None:
    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(24, 3)), components=K, embeddings=True)
    perturb(model, loc_std=0.1, offset_std=0.1)
    tokens = torch.randint(10, (6, 3))
    model.train()
    model[0].eval()
    with bayesify.mode(model, component=1):
        first, second = (_outputs_of(model, tokens, model[0])[0] for _ in range(2))
    assert torch.equal(first, second)
    model[0].train()
    with bayesify.mode(model, component=1):
        first, second = (_outputs_of(model, tokens, model[0])[0] for _ in range(2))
    assert not torch.allclose(first, second)


def test_parameter_groups_by_module_give_the_heads_factors_the_heads_rate() -> None:
    model = _resnet()
    head = list(model.fc.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in head)]
    assert any(p is model.fc.rank1_s.loc for p in head)
    optimizer = torch.optim.SGD([{"params": head, "lr": 1e-2}, {"params": rest, "lr": 1e-3}])
    before = _snapshot(model)
    model.train()
    optimizer.zero_grad()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        step = float((before[name] - p.detach()).flatten()[0])
        assert step == pytest.approx(1e-2 if name.startswith("fc.") else 1e-3, rel=1e-4), name


def test_parameter_groups_by_name_prefix_include_the_factors() -> None:
    model = _resnet()
    prefix = [n for n, _ in model.named_parameters() if n.startswith("layer4.")]
    assert {"layer4.1.conv2.rank1_s.loc", "layer4.1.conv2.rank1_r.rho"} <= set(prefix)


def test_timm_layer_decay_scales_the_factors_with_their_layer() -> None:
    from timm.optim import create_optimizer_v2

    torch.manual_seed(0)
    model = bayesify.convert(timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=5), components=K)
    optimizer = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.75)
    scale = {id(p): g["lr_scale"] for g in optimizer.param_groups for p in g["params"]}
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    for block in ("blocks.0.attn.qkv", "blocks.11.mlp.fc2", "head"):
        layer = model.get_submodule(block)
        for name, p in _own_rank1(layer).items():
            assert scale[id(p)] == pytest.approx(scale[id(layer.weight)]), f"{block}.{name}"
            assert decay[id(p)] == 0.0, f"{block}.{name} is decayed"  # no_weight_decay() keeps rank1_* out
    assert scale[id(model.blocks[0].attn.qkv.rank1_s.loc)] < scale[id(model.head.rank1_s.loc)]


def test_rank1_parameters_of_a_submodule_are_its_own() -> None:
    model = _resnet()
    own = list(bayesify.rank1_parameters(model.layer1))
    assert {id(p) for p in own} == {id(p) for p in _own_rank1(model.layer1).values()}
    assert sum(p.numel() for p in own) == sum(
        p.numel() for n, p in model.named_parameters() if n.startswith("layer1.") and "rank1_" in n
    )
    assert sum(p.numel() for p in bayesify.rank1_parameters(model)) == sum(p.numel() for p in _own_rank1(model).values())


def test_requires_grad_on_a_factor_freezes_it() -> None:
    model = _resnet()
    model.fc.rank1_s.requires_grad_(False)
    model.layer1[0].conv1.rank1_r.loc.requires_grad = False
    before = _snapshot(model)
    _adam_steps(model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    moved = _moved(before, model)
    assert not {"fc.rank1_s.loc", "fc.rank1_s.rho", "layer1.0.conv1.rank1_r.loc"} & moved
    assert {"fc.rank1_r.loc", "fc.rank1_r.rho"} <= moved
    assert model.fc.rank1_s.loc.grad is None


def test_summary_gives_each_layer_its_own_count() -> None:
    model = _resnet()
    report = bayesify.summary(model)
    rows = [line for line in str(report).splitlines() if line.strip().startswith(("conv1 ", "layer", "fc "))]
    counts = [int(line.rsplit("+", 1)[1].replace(",", "")) for line in rows if "+" in line]
    total = sum(p.numel() for p in _own_rank1(model).values())
    assert len(counts) == len(list(bayesify.rank1_layers(model))) and sum(counts) == total
    assert f"+ {total:,} rank-1" in str(report) or f"{total:,} rank-1" in str(report)


# ---- 2. a parameter change is seen by the next forward pass ------------------------------------------------


def _evaluate(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


def _fresh_copy(model: nn.Module) -> nn.Module:
    """A new model of the same network loaded with ``model``'s state dict: what the outputs must equal."""
    torch.manual_seed(0)
    fresh = bayesify.convert(timm.create_model("resnet18", num_classes=5), components=K)
    fresh.load_state_dict(model.state_dict())
    return fresh.to(next(model.parameters()).dtype)


def _write_data(model: nn.Module) -> None:
    model.fc.rank1_s.loc.data = model.fc.rank1_s.loc.data * 1.5
    model.layer4[1].conv2.rank1_r.loc.data.mul_(0.5)
    model.conv1.weight.data.mul_(2.0)  # the stem folds its members' weights in evaluation
    model.conv1.rank1_s.loc.data.add_(0.2)


def _vector_to_parameters(model: nn.Module) -> None:
    params = list(model.parameters())
    vector = torch.nn.utils.parameters_to_vector(params)
    torch.nn.utils.vector_to_parameters(vector * 1.01, params)


def _half_float(model: nn.Module) -> None:
    model.half().float()


def _apply(model: nn.Module) -> None:
    model.apply(lambda m: m.rank1_s.loc.data.add_(0.1) if isinstance(m, bayesify.ConvertedLayer) else None)


def _assign(model: nn.Module) -> None:
    state = {k: v.clone() * 1.1 if "rank1_" in k else v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


def _copy_no_grad(model: nn.Module) -> None:
    with torch.no_grad():
        for p in bayesify.rank1_parameters(model):
            p.copy_(p * 0.9)


def _to_double(model: nn.Module) -> None:
    model.to(torch.float64)


@pytest.mark.parametrize(
    "change", [_write_data, _vector_to_parameters, _half_float, _apply, _assign, _copy_no_grad, _to_double],
    ids=["data", "vector_to_parameters", "half-float", "apply", "load_state_dict-assign", "copy-no-grad", "to"],
)
def test_a_parameter_change_is_seen_by_the_next_forward_pass(change) -> None:
    model = _resnet()
    x, _ = _batch(4)
    _evaluate(model, x)  # anything kept from this call must not outlive the change
    with bayesify.mode(model, route="tile", noise=False), torch.no_grad():
        model(x)
    change(model)
    x = x.to(next(model.parameters()).dtype)
    fresh = _fresh_copy(model)
    torch.testing.assert_close(_evaluate(model, x), _evaluate(fresh, x))
    with bayesify.mode(model, route="tile", noise=False), bayesify.mode(fresh, route="tile", noise=False), torch.no_grad():
        torch.testing.assert_close(model(x), fresh(x))


def test_functional_call_with_the_factors_uses_them() -> None:
    model = _resnet()
    x, _ = _batch(4)
    _evaluate(model, x)
    replaced = {n: p.detach() * 1.2 for n, p in _own_rank1(model).items()}
    with torch.no_grad():
        out = torch.func.functional_call(model.eval(), replaced, (x,))
    fresh = _fresh_copy(model)
    fresh.load_state_dict(replaced, strict=False)
    torch.testing.assert_close(out, _evaluate(fresh, x))
    torch.testing.assert_close(_evaluate(model, x), _evaluate(_fresh_copy(model), x))  # and back to its own


def test_an_ema_written_through_data_is_evaluated_as_it_is() -> None:
    model, ema = _resnet(), _resnet()
    x, _ = _batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        _adam_steps(model, optimizer, steps=1)
        for e, p in zip(ema.parameters(), model.parameters()):  # hand-written EMA, the .data way
            e.data.mul_(0.5).add_(p.data, alpha=0.5)
        torch.testing.assert_close(_evaluate(ema, x), _evaluate(_fresh_copy(ema), x))


def test_the_kl_after_a_data_write_sees_the_written_values() -> None:
    model = _resnet()
    x, y = _batch()
    model.train()
    F.cross_entropy(model(x), y).backward()  # a training pass (keeps its joined tables for the KL of its step)
    model.fc.rank1_s.loc.data = torch.zeros_like(model.fc.rank1_s.loc)
    kl = bayesify.kl_divergence(model)
    fresh = _fresh_copy(model)
    torch.testing.assert_close(kl, bayesify.kl_divergence(fresh))


# ---- 3. calling part of a model ---------------------------------------------------------------------------------


def _members(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with bayesify.mode(model, route="tile", noise=False), torch.no_grad():
        return model(x).view(K, x.shape[0], -1)


def test_timm_forward_features_and_forward_head_under_mode_are_the_models_member() -> None:
    model = _resnet().eval()
    x, _ = _batch(4)
    members = _members(model, x)
    for k in range(K):
        with bayesify.mode(model, component=k, noise=False), torch.no_grad():
            features = model.forward_features(x)
            assert torch.equal(features, model.forward_features(x))  # deterministic
            torch.testing.assert_close(model.forward_head(features), members[k])


def test_forward_features_in_evaluation_says_what_to_do_in_one_line() -> None:
    model = _resnet().eval()
    x, _ = _batch(4)
    with pytest.raises(RuntimeError) as error, torch.no_grad():
        model.forward_features(x)
    message = str(error.value)
    assert "outside the forward pass" in message and "bayesify.mode(model, component=k)" in message
    assert "\n" not in message
    with bayesify.mode(model, route="tile"), pytest.raises(RuntimeError, match="tiles the inputs"), torch.no_grad():
        model.forward_features(x)


def test_sub_module_calls_in_training_route_every_layer_alike() -> None:
    """Outside the root's forward, training splits the rows into K blocks in component order, in every layer."""
    model = _resnet()
    x, _ = _batch(8)
    model.train()
    with torch.no_grad():
        torch.manual_seed(3)
        sampled = model.forward_head(model.forward_features(x))
    assert sampled.shape == (8, 5) and torch.isfinite(sampled).all()
    seen = []
    handles = [layer.register_forward_hook(lambda m, a, o: seen.append(o)) for _, layer in bayesify.rank1_layers(model)]
    model.eval()  # (batch norm on its running statistics, as the members below)
    with bayesify.mode(model, route="sample", noise=False), torch.no_grad():
        model.forward_head(model.forward_features(x))  # blocks in order at the means: member k's rows
    for h in handles:
        h.remove()
    members = _members(model, x)
    out = seen[-1]
    for k in range(K):
        torch.testing.assert_close(out[2 * k : 2 * k + 2], members[k, 2 * k : 2 * k + 2])


def test_timm_features_only_model_converts_and_runs_each_member() -> None:
    torch.manual_seed(0)
    model = bayesify.convert(timm.create_model("resnet18", features_only=True, out_indices=(2, 3)), components=K, task="regression")
    x, _ = _batch(2)
    with bayesify.mode(model, component=1, noise=False), torch.no_grad():
        a = model.eval()(x)
        b = model(x)
    assert [t.shape[1] for t in a] == [128, 256] and all(torch.equal(p, q) for p, q in zip(a, b))


def test_torchvision_feature_extractor_of_a_converted_model() -> None:
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    model = bayesify.convert(torchvision.models.resnet18(num_classes=5), components=K)
    perturb(model, loc_std=0.1, offset_std=0.1)
    model.eval()
    extractor = create_feature_extractor(model, {"layer4": "features", "fc": "logits"})
    x, _ = _batch(3)
    members = _members(model, x)
    for k in (0, 3):
        with bayesify.mode(extractor, component=k, noise=False), torch.no_grad():
            out = extractor(x)
            assert torch.equal(out["features"], extractor(x)["features"])
        torch.testing.assert_close(out["logits"], members[k])
    with pytest.raises(RuntimeError, match="outside the forward pass"), torch.no_grad():
        extractor(x)


def test_torch_fx_traces_a_converted_subclass_of_another_library_as_a_leaf() -> None:
    # a user's nn.Linear subclass and timm's StdConv2d: fx traced into the converted layer's routing and failed
    # ("symbolically traced variables cannot be used as inputs to control flow"); a plain torch.nn layer was a leaf
    class MyLinear(nn.Linear):
        pass

    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(MyLinear(4, 8), nn.ReLU(), nn.Linear(8, 3)), task="classification", components=K)
    perturb(model, loc_std=0.1, offset_std=0.1)
    traced = torch.fx.symbolic_trace(model)
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["0", "1", "2"]
    x = torch.randn(5, 4)
    members = bayesify.predict(model.eval(), x, noise=False)
    with bayesify.mode(traced, component=2, noise=False), torch.no_grad():
        torch.testing.assert_close(traced(x), members[2])
    timm = pytest.importorskip("timm")
    from torchvision.models.feature_extraction import get_graph_node_names

    net = bayesify.convert(timm.create_model("resnetv2_50x1_bit", pretrained=False, num_classes=3), components=K)
    assert "stem.conv" in get_graph_node_names(net)[1]  # StdConv2d, a leaf


def test_hugging_face_base_model_call() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = bayesify.convert(transformers.GPT2LMHeadModel(config), components=K)
    perturb(model, loc_std=0.1, offset_std=0.1)
    model.eval()
    tokens = torch.randint(50, (2, 6))
    with torch.no_grad():
        with bayesify.mode(model, route="tile", noise=False):
            whole = model(input_ids=tokens).logits.view(K, 2, 6, 50)
        for k in range(K):
            with bayesify.mode(model, component=k, noise=False):
                hidden = model.transformer(input_ids=tokens).last_hidden_state
                torch.testing.assert_close(model.lm_head(hidden), whole[k])
        with pytest.raises(RuntimeError, match="outside the forward pass"):
            model.transformer(input_ids=tokens)


def test_a_lone_layer_call_is_member_k_of_that_layer() -> None:
    model = _resnet().eval()
    h = torch.randn(3, 512)
    with bayesify.mode(model, component=2, noise=False), torch.no_grad():
        out = model.fc(h)
    fc = model.fc
    expected = ((h * fc.rank1_s.loc[2]) @ fc.weight.T) * fc.rank1_r.loc[2] + fc.bias + fc.rank1_bias[2]
    torch.testing.assert_close(out, expected)


def test_a_deep_copy_of_a_converted_model_owns_its_factors() -> None:
    model = _resnet()
    copied = copy.deepcopy(model)
    x, _ = _batch(4)
    torch.testing.assert_close(_evaluate(copied, x), _evaluate(model, x))
    copied.fc.rank1_s.loc.data.mul_(2.0)
    assert not torch.equal(_evaluate(copied, x), _evaluate(model, x))


def test_a_layer_copied_out_of_its_model_stays_in_that_model() -> None:
    """peft's ``modules_to_save`` (and any "copy the head" code) deep-copies one converted layer and calls the copy
    inside the model's forward: the copy keeps the model's routing and ``mode()``; a copy of the whole model gets
    its own."""
    model = _resnet().eval()
    x, _ = _batch(3)
    head = copy.deepcopy(model.fc)
    assert head.rank1_state.model is model.fc.rank1_state.model
    members = _members(model, x)
    model.fc = head  # what peft's wrapper does: the copy runs in the model's pass
    torch.testing.assert_close(_members(model, x), members)
    with bayesify.mode(model, component=2, noise=False), torch.no_grad():
        torch.testing.assert_close(model.fc(model.forward_head(model.forward_features(x), pre_logits=True)), members[2])
    twin = copy.deepcopy(model)
    assert twin.fc.rank1_state.model is twin.rank1_model is not model.rank1_model
    with bayesify.mode(twin, route="tile", noise=False), torch.no_grad():
        torch.testing.assert_close(twin(x).view(K, 3, -1), members)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_layer_copied_out_of_a_copied_model_before_its_first_pass_stays_in_the_copy(how: str) -> None:
    """An EMA copy or a loaded model hands out a head copy (modules_to_save) before it has run a pass: the head
    stays in that copy. It was cut off (a model state without a root): mode() was ignored for it, silently in
    training (rows through every component, fresh noise each call)."""
    model = _resnet()
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    assert twin.rank1_model.root is twin
    head = copy.deepcopy(twin.fc)
    assert head.rank1_state.model is twin.rank1_model
    features = torch.randn(3, head.in_features)
    expected = (features * head.rank1_s.loc[1]) @ head.weight.T * head.rank1_r.loc[1] + head.bias + head.rank1_bias[1]
    for training in (True, False):
        twin.train(training)
        with bayesify.mode(twin, component=1, noise=False), torch.no_grad():
            torch.testing.assert_close(head(features), expected)


def test_the_error_of_a_sub_module_call_names_the_layer_and_the_model() -> None:
    model = _resnet().eval()
    model(_batch(2)[0])  # (the router learns its root in a pass; convert sets it too)
    with pytest.raises(RuntimeError, match=r"Rank1Conv2d 'conv1' was called outside the forward pass of its converted model \(ResNet\)"), torch.no_grad():
        model.forward_features(_batch(2)[0])


def test_converted_on_the_meta_device_a_plain_checkpoint_loads_with_the_initial_factors() -> None:
    # the large-model pattern: build on meta, to_empty(), load a checkpoint of the plain network strictly. The
    # rank-1 values "kept" were whatever the new memory held (NaN or 1e10 outputs, an infinite KL), silently
    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    torch.manual_seed(0)
    plain = net()
    checkpoint = plain.state_dict()
    options = {"task": "classification", "init": "normal", "init_std": 0.05, "init_jitter": 0.1}
    with torch.device("meta"):
        model = bayesify.convert(net(), **options)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in bayesify.rank1_parameters(model):
            p.fill_(float("nan"))  # what fresh memory may hold
    assert not model.load_state_dict(checkpoint, strict=True).missing_keys
    reference = bayesify.convert(net(), **options)
    reference.load_state_dict(checkpoint)
    for (name, value), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.isfinite(value).all(), name
        if name.endswith((".loc", "rank1_bias")):
            assert (value - expected).abs().max() < 0.5, name  # init="normal" draws its own spread
    assert torch.isfinite(bayesify.kl_divergence(model))
    x = torch.randn(2, 8)
    assert torch.isfinite(model.eval()(x)).all()
    # a converted checkpoint loads its own values, and a model converted on a real device keeps what it has
    with torch.device("meta"):
        again = bayesify.convert(net(), **options)
    again.load_state_dict(reference.state_dict(), assign=True)
    torch.testing.assert_close(again.eval()(x), reference.eval()(x))


def test_a_plain_checkpoint_assigned_to_a_model_on_meta_or_moved_there_gives_the_initial_factors() -> None:
    # converted on meta then a plain checkpoint loaded with assign=True: the factors stayed on meta ("All keys
    # matched", then a crash deep in the forward); converted on the CPU, moved to meta and given memory (to_empty):
    # a strict load of the plain checkpoint kept what that memory held (NaN rows, silently)
    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))

    torch.manual_seed(0)
    plain = net().eval()
    checkpoint, x = plain.state_dict(), torch.randn(4, 6)
    with torch.device("meta"):
        assigned = bayesify.convert(net(), task="classification", components=K)
    assert not assigned.load_state_dict(checkpoint, assign=True, strict=True).missing_keys
    moved = bayesify.convert(net(), task="classification", components=K).to("meta").to_empty(device="cpu")
    with torch.no_grad():
        for p in bayesify.rank1_parameters(moved):
            p.fill_(float("nan"))  # what fresh memory may hold
    assert not moved.load_state_dict(checkpoint, strict=True).missing_keys
    for model in (assigned, moved):
        assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in bayesify.rank1_parameters(model))
        torch.testing.assert_close(model.eval()(x), plain(x).log_softmax(-1))  # every member the original
    # values set since (a reset, a converted checkpoint) are kept by a later plain load
    trained = bayesify.convert(net(), task="classification", components=K).to("meta").to_empty(device="cpu")
    trained.load_state_dict(assigned.state_dict())
    with torch.no_grad():
        trained[0].rank1_s.loc.add_(0.5)
    trained.load_state_dict(checkpoint)
    assert (trained[0].rank1_s.loc - 1.5).abs().max() < 0.2


def test_a_checkpoint_of_another_perturbation_or_posterior_is_refused_and_leaves_the_factors() -> None:
    # the values mean something else (a location near 1 or near 0; a Normal or a Cauchy scale): they loaded
    # silently, and the additive model computed another function
    import io

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    saved = {}
    for name, options in {"multiplicative": {}, "additive": {"perturbation": "additive"},
                          "cauchy": {"posterior": "cauchy", "prior": "cauchy"}}.items():  # fmt: skip
        buffer = io.BytesIO()
        torch.save(bayesify.convert(net(), task="classification", **options).state_dict(), buffer)
        buffer.seek(0)
        saved[name] = torch.load(buffer)  # through torch.save: the state dict's metadata travels with it
    model = bayesify.convert(net(), task="classification")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # refused in one line before anything loads (the network's own weights were loaded, then a RuntimeError raised)
    additive = (r"perturbation='additive'.*perturbation='multiplicative'.*"
                r"bayesify.convert\(model, perturbation='additive'\) before loading; nothing was loaded$")
    for other, match in (("additive", additive), ("cauchy", "posterior='cauchy'.*posterior='normal'")):
        with pytest.raises(ValueError, match=match) as error:
            model.load_state_dict(saved[other])
        assert "\n" not in str(error.value)
        for k, v in before.items():
            assert torch.equal(model.state_dict()[k], v), k
    delta = bayesify.convert(net(), task="classification", posterior="delta")  # (a normal checkpoint's rho: no key here)
    with pytest.raises(ValueError, match="posterior='normal'.*posterior='delta'"):
        delta.load_state_dict(saved["multiplicative"])
    # the model inside another module (a Lightning module's self.model): torch hands the root a dict without its
    # layers' metadata; the root's own carries their meanings (the network's weights loaded before the error)
    class Wrapper(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model, self.extra = model, nn.Linear(2, 2)

    buffer = io.BytesIO()
    torch.save(Wrapper(bayesify.convert(net(), task="classification", perturbation="additive")).state_dict(), buffer)
    buffer.seek(0)
    wrapped = Wrapper(bayesify.convert(net(), task="classification"))
    kept = {k: v.clone() for k, v in wrapped.state_dict().items()}
    with pytest.raises(ValueError, match=r"^the checkpoint's rank-1 values \(of model.0, .*perturbation='additive'"):
        wrapped.load_state_dict(torch.load(buffer))
    assert all(torch.equal(v, wrapped.state_dict()[k]) for k, v in kept.items())
    # a layer loaded on its own: its own pre-hook keeps the check (torch's error, the layer's values kept)
    layer = bayesify.convert(net(), task="classification", posterior="cauchy", prior="cauchy")[0].state_dict()
    with pytest.raises(RuntimeError, match="posterior='cauchy'"):
        model[0].load_state_dict(layer)
    assert torch.equal(model[0].rank1_s.loc, before["0.rank1_s.loc"])
    assert not model.load_state_dict(saved["multiplicative"]).missing_keys  # the same options: loads
    assert not model.load_state_dict(net().state_dict()).missing_keys  # a plain checkpoint: loads, as always


def test_reset_parameters_reinitialises_the_layers_factors_and_bias_offsets_too() -> None:
    # nn.Linear.reset_parameters draws the weight and bias anew: on a converted layer it puts its rank-1 values at
    # their initialisation too (a head reset for a new task kept its trained members), and model.apply(reset) gives a
    # model whose members are identical and whose KL is 0, as a fresh conversion's (the bias offsets stayed)
    model = _resnet()
    fresh = bayesify.convert(timm.create_model("resnet18", num_classes=5), components=K)
    model.fc.reset_parameters()
    for name, value in _own_rank1(model.fc).items():
        torch.testing.assert_close(value, _own_rank1(fresh.fc)[name], msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(_own_rank1(model.layer4).values(), _own_rank1(fresh.layer4).values()))
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    assert float(bayesify.kl_divergence(model)) == pytest.approx(float(bayesify.kl_divergence(fresh)), abs=1e-4)
    x, _ = _batch(4)
    with torch.no_grad(), bayesify.mode(model.eval(), route="tile", noise=False):
        members = model(x).view(K, 4, -1)
    torch.testing.assert_close(members, members[:1].expand_as(members))
    transformers = pytest.importorskip("transformers")
    gpt2 = bayesify.convert(transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20)))
    assert not hasattr(gpt2.h[0].attn.c_attn, "reset_parameters")  # (a Conv1D has none: nor has its converted layer)


@pytest.mark.parametrize("sampling", ["auto", "component", "example"])
@pytest.mark.parametrize("route", ["sample", "tile"])
def test_training_after_a_pass_in_inference_mode_works(sampling: str, route: str) -> None:
    """A model checked under ``torch.inference_mode()`` (a baseline accuracy before fine-tuning) then trained: the
    index tensors bayesify keeps between calls (a group's columns, the tiled rows, the blocks' numbers, the Cauchy
    KL's quadrature nodes) were made in inference mode and kept, and every training step from the second failed
    ("Inference tensors cannot be saved for backward"). What is made in inference mode is not kept."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    bayesify.convert(model, components=3, task="classification", sampling=sampling, prior="cauchy", posterior="cauchy")
    x = torch.randn(5, 3, 12, 12)
    with torch.inference_mode():
        model.eval()(x)
        bayesify.predict(model, x)
        bayesify.kl_loss(model, 10)
        model.train()(x)
    for _ in range(3):
        with bayesify.mode(model, route=route):
            loss = model(x).logsumexp(-1).mean() + bayesify.kl_loss(model, 10)
        loss.backward()
    assert all(p.grad is not None for p in bayesify.rank1_parameters(model) if p.requires_grad)


def test_predict_on_a_model_left_in_training_mode_says_its_batch_norms_moved() -> None:
    # predict() / uncertainty() run the model in its own mode: in training mode its batch norms' running statistics
    # moved with the batch, silently (evaluate() switches to eval itself); said once, and nothing in eval mode
    import warnings

    model = bayesify.convert(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)),
                             task="classification")  # fmt: skip
    with pytest.warns(UserWarning, match=r"training mode: its batch norms \(1\) updated their running statistics"):
        bayesify.uncertainty(model, torch.randn(5, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bayesify.predict(model, torch.randn(5, 4))  # once
        fresh = bayesify.convert(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)), task="classification")
        bayesify.predict(fresh.eval(), torch.randn(5, 4))


def test_a_converted_layer_put_in_from_another_model_is_refused_until_convert_adopts_it() -> None:
    """``a.fc = copy.deepcopy(b.fc)`` (a trained rank-1 head on another backbone): the head routed its rows by b's
    rules inside a's pass (each training row a mix of two members, silently; in evaluation an error whose advice
    failed too), and ``convert(a)`` said "nothing new matched". Now a's pass refuses it in one line naming the fix,
    and ``convert(a)`` takes it in: its tables join a's groups, its values stay."""
    a, b = _resnet(), _resnet()
    with torch.no_grad():
        b.fc.rank1_s.loc.add_(0.5)
    a.fc = copy.deepcopy(b.fc)
    x, _ = _batch(4)
    for training in (True, False):
        a.train(training)
        with pytest.raises(RuntimeError, match=r"Rank1Linear 'fc' runs in the forward pass of ResNet as a part of it, "
                                               r"but belongs to another converted model.*bayesify.convert\(model\)"):
            a(x)
    s_loc = a.fc.rank1_s.loc.detach().clone()
    assert bayesify.convert(a) is a
    assert a.fc.rank1_state.model is a.rank1_model and torch.equal(a.fc.rank1_s.loc, s_loc)
    before = bayesify.kl_divergence(a).item()  # the KL takes the adopted head's terms with the others
    with torch.no_grad():
        a.fc.rank1_s.rho.add_(0.5)
    assert bayesify.kl_divergence(a).item() != pytest.approx(before)
    with torch.no_grad():
        a.fc.rank1_s.rho.sub_(0.5)
    a.eval()
    members = _members(a, x)
    fc = a.fc
    for k in range(K):
        with bayesify.mode(a, component=k, noise=False), torch.no_grad():
            features = a.forward_head(a.forward_features(x), pre_logits=True)
        expected = (features * fc.rank1_s.loc[k]) @ fc.weight.T * fc.rank1_r.loc[k] + fc.bias + fc.rank1_bias[k]
        torch.testing.assert_close(members[k], expected)
    # each training row is one member of a (the sample route through a's components, the head's included)
    a.train()
    for m in a.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    with bayesify.mode(a, noise=False), torch.no_grad():
        rows = a(x)
    distance = (members[:, None] - rows[None]).abs().amax(-1).min(0).values
    assert distance.max() < 1e-5


def test_a_forward_hook_on_the_root_registered_before_convert_sees_the_reduced_output() -> None:
    # it ran before bayesify's reduction: K x B rows in evaluation, where one registered after saw B
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    seen: list = []
    net.register_forward_pre_hook(lambda m, a: seen.append(("pre", a[0].shape[0])))
    net.register_forward_hook(lambda m, a, o: seen.append(("post", a[0].shape[0], o.shape[0])))
    bayesify.convert(net, task="classification", components=K)
    net.register_forward_hook(lambda m, a, o: seen.append(("after", a[0].shape[0], o.shape[0])))
    net.eval()(torch.randn(5, 4))
    assert seen == [("pre", 5), ("post", 5 * K, 5), ("after", 5 * K, 5)]


def test_a_sub_module_put_in_eval_in_a_training_model_is_called_as_the_training_step_routes_it() -> None:
    # the route is the root's train / eval state: a frozen backbone (eval) called by itself in a training step
    # raised evaluation's error; in the whole model's pass it routes as the step does, at its posterior means
    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 3)),
                             task="classification", components=2, init="normal", init_mean_std=0.5)  # fmt: skip
    model.train()
    model[0].eval()
    x = torch.randn(6, 4)
    with torch.no_grad():
        out = model[0](x)  # K blocks of rows in component order: rows 0-2 member 0, 3-5 member 1, at the means
        for k, rows in ((0, slice(0, 3)), (1, slice(3, 6))):
            with bayesify.mode(model, component=k, noise=False):
                torch.testing.assert_close(out[rows], model[0](x[rows]))
    model.eval()  # the root and the part in evaluation: the mixture, which a part's call cannot reduce
    with pytest.raises(RuntimeError, match="called outside the forward pass"), torch.no_grad():
        model[1](torch.randn(6, 8))
    model[1].train()  # a head trained by itself on cached features while the root stays in eval: it samples
    out = model[1](torch.randn(6, 8))
    out.sum().backward()
    assert model[1].rank1_s.loc.grad is not None


@pytest.mark.parametrize("how", ["weight_norm", "custom"])
def test_revert_keeps_a_parametrization_registered_after_convert(how: str) -> None:
    # revert swapped ParametrizedRank1Linear for the plain Linear class: its weight (the parametrization's property)
    # was gone, and the layer's next call failed
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    class Doubled(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), task="classification", components=2)
    if how == "weight_norm":
        weight_norm(model[0])
    else:
        parametrize.register_parametrization(model[0], "weight", Doubled())
    bayesify.revert(model)
    layer = model[0]
    assert isinstance(layer, nn.Linear) and parametrize.is_parametrized(layer, "weight")
    assert not isinstance(layer, bayesify.layers.ConvertedLayer) and not bayesify.is_converted(model)
    x = torch.randn(2, 4)
    expected = model[2](torch.relu(F.linear(x, layer.weight, layer.bias)))
    torch.testing.assert_close(model(x), expected)
    parametrize.remove_parametrizations(layer, "weight")
    assert type(layer) is nn.Linear
    torch.testing.assert_close(model(x), expected)
