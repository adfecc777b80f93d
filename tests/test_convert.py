"""convert(): sharing, state, subclasses, patterns, mapping, intercepted weights, revert."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import nn

import bayesify
from bayesify.layers import Rank1Layer, Rank1Linear


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 3))


def test_shares_parameters_and_keeps_state_dict_keys() -> None:
    net = _mlp()
    before = dict(net.named_parameters())
    keys = list(net.state_dict())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    bayesify.convert(net)
    after = dict(net.named_parameters())
    for name, p in before.items():
        assert after[name] is p, f"{name} was copied, not shared"
    new_keys = [k for k in net.state_dict() if k not in keys]
    assert list(net.state_dict())[: len(keys)] == keys or set(keys) <= set(net.state_dict())
    assert new_keys and all(".rank1_" in k for k in new_keys), new_keys  # each layer's own
    # an optimizer made before conversion still trains the shared weights
    w0 = net[0].weight.detach().clone()
    net.train()
    net(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    assert not torch.equal(w0, net[0].weight)


def test_pretrained_checkpoint_loads_into_converted_model() -> None:
    pretrained = _mlp()
    state = pretrained.state_dict()
    net = bayesify.convert(_mlp(), init="preserve")
    assert net.load_state_dict(state, strict=True).missing_keys == []  # rank-1 values kept (tests/layers)
    with bayesify.mode(net, route="tile", noise=False):
        torch.testing.assert_close(net(x := torch.randn(3, 6)), torch.cat([pretrained(x)] * 4))


def test_keeps_class_identity_hooks_and_training_flag() -> None:
    net = _mlp().eval()
    seen = []
    net[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    bayesify.convert(net, components=2, task="classification")
    assert isinstance(net[0], nn.Linear) and isinstance(net[0], Rank1Layer)
    assert type(net[0]).__name__ == "Rank1Linear"
    assert not net[0].training
    net(torch.randn(5, 6))
    assert seen == [torch.Size([10, 8])]  # the hook still runs (on the tiled batch of K*B rows)


@pytest.mark.parametrize(
    "layer",
    [
        lambda: timm.layers.StdConv2d(3, 8, 3, padding=1),
        lambda: timm.layers.StdConv2dSame(3, 8, 3, stride=2),
        lambda: timm.layers.ScaledStdConv2d(3, 8, 3),
        lambda: timm.layers.Conv2dSame(3, 8, 3, stride=2),
        lambda: timm.layers.Linear(3, 8),
        lambda: nn.modules.linear.NonDynamicallyQuantizableLinear(3, 8),
        lambda: nn.LazyLinear(8),
    ],
    ids=["StdConv2d", "StdConv2dSame", "ScaledStdConv2d", "Conv2dSame", "timm.Linear", "NonDynQuantLinear", "LazyLinear"],
)
def test_subclasses_keep_their_own_forward(layer) -> None:
    module = layer().double()
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    if isinstance(module, nn.Linear) or isinstance(module, nn.LazyLinear):
        x = torch.randn(2, 5, 3, dtype=torch.float64)
    if isinstance(module, nn.LazyLinear):
        with pytest.raises(ValueError, match="LazyLinear"):
            bayesify.convert(module)
        return
    ref = module(x)
    base = type(module)
    bayesify.convert(module, components=3)
    assert isinstance(module, base)
    with torch.no_grad():
        module.rank1_bias.normal_() if module.rank1_bias is not None else None
        module.rank1_bias.zero_() if module.rank1_bias is not None else None
    with bayesify.mode(module, route="tile", noise=False):
        out = module(x)
    torch.testing.assert_close(out, torch.cat([ref] * 3))
    # and a non-identity member equals the base forward on a rank-1 scaled weight
    with torch.no_grad():
        module.rank1_s.loc.normal_(1.0, 0.3)
    with bayesify.mode(module, route="component", component=2, noise=False):
        out = module(x)
    s = module.rank1_s.loc[2].view(1, -1, *([1] * (x.dim() - 2))) if x.dim() == 4 else module.rank1_s.loc[2]
    torch.testing.assert_close(out, base.forward(module, x * s))


def test_include_exclude_patterns() -> None:
    net = bayesify.convert(_mlp(), include=["2", "3"], exclude="2.0")
    assert [n for n, _ in bayesify.rank1_layers(net)] == ["3"]
    report = bayesify.summary(net)
    assert report.skipped == {"0": "not matched by include", "2.0": "excluded by pattern '2.0'"}


def test_pattern_that_matches_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"\['blocks\.\*'\] matched no"):
        bayesify.convert(_mlp(), exclude="blocks.*")


def test_root_may_be_a_layer() -> None:
    layer = nn.Linear(4, 2)
    assert bayesify.convert(layer, task="classification") is layer
    assert layer.eval()(torch.randn(3, 4)).shape == (3, 2)


def test_user_mapping_converts_own_layers() -> None:
    class Dense(nn.Module):  # a third-party layer that is not an nn.Linear
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4))
            self.bias = nn.Parameter(torch.zeros(3))
            self.in_features, self.out_features = 4, 3

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight, self.bias)

    class Rank1Dense(Rank1Linear):
        source_types = (Dense,)

    net = nn.Sequential(Dense(), nn.Linear(3, 2))
    default = bayesify.summary(bayesify.convert(nn.Sequential(Dense(), nn.Linear(3, 2))))
    assert "0" in default.skipped and "mapping" in default.skipped["0"]
    bayesify.convert(net, mapping={**bayesify.default_mapping(), Dense: Rank1Dense})
    assert isinstance(net[0], Rank1Dense) and isinstance(net[0], Dense)
    net.train()
    net(torch.randn(5, 4)).sum().backward()
    assert net[0].rank1_s.grad() is not None and net[0].rank1_s.grad().abs().sum() > 0


def test_second_conversion_neither_stacks_nor_breaks() -> None:
    net = bayesify.convert(_mlp(), include="3")
    bayesify.convert(net, exclude="3")  # the rest, with the same components
    assert len(list(bayesify.rank1_layers(net))) == 3
    assert bayesify.convert(net) is net  # nothing new, nothing asked: as it is
    with pytest.raises(ValueError, match="components=4"):
        bayesify.convert(_mlp_partly := bayesify.convert(_mlp(), include="0"), components=2)
    del _mlp_partly
    assert all(type(layer).__mro__.count(Rank1Layer) == 1 for _, layer in bayesify.rank1_layers(net))


def test_a_head_put_in_after_conversion_is_named_once_with_the_fix() -> None:
    # timm's reset_classifier (or transformers' resize_token_embeddings) after convert makes a plain head that the K
    # members share, trained as it is with nothing said: the training step's KL names it and the two ways out
    import warnings

    model = timm.create_model("resnet10t", num_classes=10)
    bayesify.convert(model)
    kept = model.conv1[0].rank1_s.loc.detach().clone()
    model.reset_classifier(5)
    with pytest.warns(UserWarning, match=r"fc \(Linear\) was put in ResNet after bayesify.convert .* exclude=\['fc'\]"):
        bayesify.kl_loss(model, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bayesify.kl_loss(model, 100)  # once
        bayesify.convert(model)  # converts the new head; the others keep their values
        assert isinstance(model.fc, Rank1Linear) and torch.equal(model.conv1[0].rank1_s.loc, kept)
        bayesify.kl_loss(model, 100)
    model.reset_classifier(3)
    bayesify.convert(model, exclude=["fc"])  # kept deterministic, and said: in the report, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bayesify.kl_loss(model, 100)
    assert "excluded" in bayesify.summary(model).skipped["fc"]
    model.extra_head = nn.Linear(3, 2)  # a module added beside the converted ones (none replaced): named too
    model.table = nn.Embedding(5, 3)  # (deterministic by default, as a second convert() would leave it: not named)
    with pytest.warns(UserWarning, match=r"extra_head \(Linear\) was put in") as said:
        bayesify.kl_loss(model, 100)
    assert not any("table" in str(w.message) for w in said)


def test_converting_a_part_then_the_whole_uses_one_routing() -> None:
    net = _mlp()
    bayesify.convert(net[2])  # a part converted on its own first
    bayesify.convert(net, task="classification")
    net.eval()
    assert net(torch.randn(5, 6)).shape == (5, 3)  # the inner part does not tile a second time
    with bayesify.mode(net, route="tile"):
        assert net(torch.randn(5, 6)).shape == (20, 3)


def test_a_backbone_converted_on_its_own_under_a_new_head_takes_the_whole_models_task() -> None:
    """A headless backbone is converted with task="regression" (its features, averaged: the README's recipe), then put
    under a new head and the whole converted: the task is the whole model's. It kept the backbone's: an explicit
    task="classification" was refused, and the default averaged the head's logits, silently."""
    def backbone() -> nn.Module:
        torch.manual_seed(0)
        return bayesify.convert(nn.Sequential(nn.Linear(6, 8), nn.ReLU()), components=4, task="regression", init="normal")

    x = torch.randn(5, 6)
    model = bayesify.convert(nn.Sequential(backbone(), nn.Linear(8, 3)), task="classification").eval()
    with torch.no_grad():
        members = torch.stack([_member(model, x, k) for k in range(4)])
        torch.testing.assert_close(model(x), members.softmax(-1).mean(0).log())
    assert str(bayesify.summary(model)).splitlines()[2] == "output: classification"
    unsaid = bayesify.convert(nn.Sequential(backbone(), nn.Linear(8, 3))).eval()  # a plain Sequential states no task
    with pytest.raises(ValueError, match=r"does not know what the output of shape \(5, 3\) of Sequential means"), torch.no_grad():
        unsaid(x)


def test_a_plain_module_holding_a_converted_part_states_its_own_task_not_the_parts() -> None:
    """A backbone converted on its own with task="regression", under a plain head that is never converted: the
    module's class logits were decomposed as a regression (the part's task), silently. The part's task is its own
    output's; the module states what it states (nothing: task= is asked), and wrappers that hand the call on (DDP,
    DataParallel, torch.compile's, AveragedModel) state the root's."""
    torch.manual_seed(0)
    encoder = bayesify.convert(nn.Sequential(nn.Linear(8, 16), nn.ReLU()), task="regression")

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.head = encoder, nn.Linear(16, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x))

    wrapper, x = Classifier().eval(), torch.randn(4, 8)
    assert "regression (the output of its converted part, Sequential;" in str(bayesify.summary(wrapper)).splitlines()[2]
    with pytest.raises(ValueError, match=r"bayesify.uncertainty does not know what the output of Classifier means: .*task="):
        bayesify.uncertainty(wrapper, x)
    with pytest.raises(ValueError, match=r"evaluate\(\) does not know what the output of Classifier means"):
        bayesify.evaluation.evaluate(wrapper, torch.utils.data.TensorDataset(x, torch.randint(0, 10, (4,))))
    said = bayesify.uncertainty(wrapper, x, task="classification", noise=False)
    torch.testing.assert_close(said.probs, bayesify.predict(wrapper, x, noise=False).softmax(-1).mean(0))  # a mixture
    model = bayesify.convert(nn.Sequential(nn.Linear(8, 3)), task="classification")
    for wrapped in (nn.DataParallel(model), torch.optim.swa_utils.AveragedModel(model)):
        assert bayesify.uncertainty(wrapped, x).probs.shape == (4, 3)
    assert bayesify.uncertainty(encoder, x).mean.shape == (4, 16)  # the part itself: as said

    class Adapter(nn.Module):  # a module around it that returns its output as it is: its task
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x.flatten(1))

    assert bayesify.uncertainty(Adapter(), x[:, None]).probs.shape == (4, 3)


def _member(model: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
    with bayesify.mode(model, component=k, noise=False):
        return model(x)


def test_revert_restores_the_original_model() -> None:
    net = _mlp()
    keys = list(net.state_dict())
    x = torch.randn(2, 6)
    ref = net(x)
    bayesify.convert(net)
    bayesify.revert(net)
    assert list(net.state_dict()) == keys
    assert type(net[0]) is nn.Linear and not bayesify.is_converted(net)
    torch.testing.assert_close(net(x), ref)
    bayesify.convert(net, components=2)  # and it converts again cleanly


@pytest.mark.parametrize("name", ["beit_base_patch16_224", "eva02_tiny_patch14_224", "swinv2_cr_tiny_ns_224"])
def test_weights_used_directly_are_intercepted(name: str) -> None:
    """timm's beit / eva / swinv2 call F.linear(x, self.qkv.weight): the qkv layers must stay in the graph."""
    kwargs = dict(img_size=32, patch_size=16, depth=1) if not name.startswith("swin") else dict(img_size=64, depths=(1, 1, 1, 1), embed_dim=32, num_heads=(1, 1, 1, 1))
    if name.startswith("eva"):
        kwargs = dict(img_size=32, patch_size=16, depth=1)
    model = timm.create_model(name, num_classes=4, **kwargs).eval()
    x = torch.randn(2, 3, kwargs["img_size"], kwargs["img_size"])
    ref = model(x)
    bayesify.convert(model, components=2)
    with bayesify.mode(model, route="tile", noise=False):
        torch.testing.assert_close(model(x), torch.cat([ref, ref]), rtol=1e-4, atol=1e-4)
    report = bayesify.summary(model, x)
    assert not report.bypassed, report.bypassed
    model.train()
    with torch.no_grad():  # timm zero-initialises some heads and post-norm scales (swinv2_cr): they stop every gradient
        model.get_classifier().weight.normal_()
        for module in model.modules():
            if isinstance(module, nn.LayerNorm) and module.weight is not None:
                module.weight.fill_(1.0)
    model(x).sum().backward()
    missing = [n for n, layer in bayesify.rank1_layers(model) if not layer.rank1_s.grad().abs().sum() > 0]
    assert not missing, f"no gradient for {missing}"


def test_summary_names_a_weight_used_outside_forward() -> None:
    class Sneaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x @ self.proj.weight.t())  # not a call the converter can take over

    model = bayesify.convert(Sneaky())
    report = bayesify.summary(model, torch.randn(3, 4))
    assert "matmul" in report.bypassed["proj"] or "t" in report.bypassed["proj"]
    assert "never ran" in report.bypassed["unused"]
    assert "head" not in report.bypassed
    assert "converted but not in the compute path" in str(report)


def test_a_weight_used_by_other_maths_is_named_once_in_a_pass() -> None:
    # a cosine classifier normalises fc's weight itself: the factors cannot act there (bayesify takes over F.linear
    # and convolutions only), and training ran with K identical heads, silently (only summary(model, x) said)
    import warnings

    class Cosine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.fc = nn.Linear(4, 8), nn.Linear(8, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 10 * F.linear(F.normalize(self.body(x), dim=1), F.normalize(self.fc.weight, dim=1))

    model = bayesify.convert(Cosine(), task="classification")
    x = torch.randn(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "normalize" in bayesify.summary(model, x).bypassed["fc"]  # reported there, not warned
    with pytest.warns(UserWarning, match=r"fc's weight was used by normalize outside the layer .* exclude=\['fc'\]"):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)  # once
        model.fc.weight.new_zeros(3)  # (outside a pass: the plain Parameter)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda m: torch.nn.utils.parametrizations.weight_norm(m),
        lambda m: torch.nn.utils.parametrizations.spectral_norm(m),
        lambda m: torch.nn.utils.prune.l1_unstructured(m, "weight", amount=0.5),
    ],
    ids=["weight_norm", "spectral_norm", "prune"],
)
@pytest.mark.parametrize("make,shape", [(lambda: nn.Linear(6, 4), (3, 6)), (lambda: nn.Conv2d(3, 4, 3), (2, 3, 7, 7))])
def test_parametrized_and_pruned_layers(wrap, make, shape) -> None:
    layer = make().eval()
    wrap(layer)
    x = torch.randn(*shape)
    ref = layer(x)
    bayesify.convert(layer, components=2)
    with bayesify.mode(layer, route="tile", noise=False):
        torch.testing.assert_close(layer(x), torch.cat([ref, ref]))
    layer.train()
    layer(x).sum().backward()
    assert layer.rank1_s.grad() is not None and layer.rank1_s.grad().abs().sum() > 0


class _PlusOne(nn.Module):
    def forward(self, b: torch.Tensor) -> torch.Tensor:
        return b + 1.0


@pytest.mark.parametrize(
    "wrap",
    [
        lambda m: torch.nn.utils.prune.l1_unstructured(m, "bias", amount=1),
        lambda m: torch.nn.utils.parametrize.register_parametrization(m, "bias", _PlusOne()),
    ],
    ids=["prune", "parametrize"],
)
@pytest.mark.parametrize("before", [True, False], ids=["before convert", "after convert"])
@pytest.mark.parametrize("make,shape", [(lambda: nn.Linear(6, 4), (3, 6)), (lambda: nn.Conv2d(3, 4, 3), (2, 3, 7, 7))])
def test_a_pruned_or_parametrized_bias_is_the_bias_the_layer_adds(wrap, before, make, shape) -> None:
    # the converted layer read the bias from _parameters alone, where pruning or a parametrization leaves none:
    # it computed W x with no bias at all, silently
    torch.manual_seed(0)
    plain, layer = make().eval(), make().eval()
    layer.load_state_dict(plain.state_dict())
    wrap(plain)
    if before:
        wrap(layer)
    bayesify.convert(layer, components=2, task="regression")
    if not before:
        wrap(layer)
    x = torch.randn(*shape)
    torch.testing.assert_close(layer(x), plain(x))
    with bayesify.mode(layer, route="tile", noise=False):
        torch.testing.assert_close(layer(x), torch.cat([plain(x), plain(x)]))
    layer.train()
    layer(x).sum().backward()
    raw = layer.bias_orig if hasattr(layer, "bias_orig") else layer.parametrizations.bias.original
    assert raw.grad is not None and raw.grad.abs().sum() > 0
    if not hasattr(layer, "bias_orig"):  # (a pruned module after a forward pass cannot be deep-copied: torch's limit)
        # the fix it names works: torch's function takes a parametrization applied after conversion out of the
        # converted layer, but not one applied before (bayesify's class is then around torch's)
        fix = r"Remove it from the network before convert" if before else r"Remove it first"
        with pytest.raises(ValueError, match=rf"bias is computed .* {fix}.*remove_parametrizations"):
            bayesify.merge(layer, component=0)
        if not before:
            torch.nn.utils.parametrize.remove_parametrizations(layer, "bias")
            bayesify.merge(layer, component=0)


def test_num_components_of_a_model_its_parts_and_a_plain_model():
    net = bayesify.convert(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.LSTM(4, 2)), components=3)
    assert bayesify.num_components(net) == 3
    assert bayesify.num_components(net[2]) == 3  # a part of a converted model
    assert bayesify.num_components(nn.Linear(2, 2)) == 1  # deterministic: one member


def test_a_second_conversion_keeps_every_layer_on_its_own_columns_of_the_store() -> None:
    """A second convert() adds groups to the store and renumbers the groups the router draws (by which the
    layers' takes are learnt): every layer must still read its own columns (member k is still merge(k))."""
    from tests._rank1 import perturb

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    bayesify.convert(model, include="2", task="classification", components=2)
    perturb(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(2):  # learn how the layers take their draws
        with bayesify.mode(model, component=1, noise=False):
            model(x)
    bayesify.convert(model, include=["0", "4"], task="classification", components=2)
    perturb(model)
    for _ in range(3):
        with bayesify.mode(model, component=1, noise=False):
            out = model(x)
    torch.testing.assert_close(out, bayesify.merge(model, component=1)(x))


def test_converting_again_with_other_model_wide_options_refuses_naming_each() -> None:
    # the case: the model kept example / False while the new layer said component / True
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    bayesify.convert(net, include="0", sampling="example", eval_noise=False, task="classification")
    with pytest.raises(ValueError, match=r"converted with eval_noise=False, sampling='example'; .* \(got eval_noise=True, sampling='component'\)"):
        bayesify.convert(net, sampling="component", eval_noise=True)
    with pytest.raises(ValueError, match=r"task='classification'.*got task='regression'"):
        bayesify.convert(net, sampling="example", task="regression")
    assert not isinstance(net[2], bayesify.ConvertedLayer)  # nothing was converted by the refused calls
    bayesify.convert(net, sampling="example")  # the same options (the task left "auto"): the rest converts
    state = net.rank1_model
    assert isinstance(net[2], bayesify.ConvertedLayer) and str(state.task) == "classification"
    # one owner at run time: every layer reads the model-wide options from the root's one model state
    assert all(layer.rank1_state.model is state for _, layer in bayesify.rank1_layers(net))
    assert not hasattr(bayesify.rank1_layers(net).__next__()[1].rank1_state.options, "components")


def test_summary_names_a_layer_put_in_after_the_conversion_and_the_fix() -> None:
    # a new head after convert (timm's reset_classifier does this): its type is in the mapping, so the fix is to
    # convert again, not a mapping entry; the fix as named works for a model of other model-wide options too (a
    # second convert() takes the model's where none are said: it refused components=4 against 2)
    net = bayesify.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), task="classification", components=2)
    net[2] = nn.Linear(8, 5)
    report = bayesify.summary(net, torch.randn(2, 4))
    assert report.skipped["2"] == ("Linear was not converted (added after bayesify.convert?); call "
                                   "bayesify.convert(model) again to convert it")  # fmt: skip
    bayesify.convert(net)
    assert "2" not in bayesify.summary(net, torch.randn(2, 4)).skipped
    assert net[2].rank1_s.loc.shape == (2, 8) and net.rank1_model.options.components == 2
    with pytest.raises(ValueError, match=r"converted with components=2.*got components=3"):
        bayesify.convert(net, components=3)  # said otherwise: still refused



@pytest.mark.parametrize(
    "options",
    [{}, {"posterior": "delta"}, {"prior": "cauchy", "posterior": "cauchy"}, {"perturbation": "additive"}, {"prior_std": 0.1}],
    ids=["defaults", "batchensemble", "cauchy", "additive", "prior_std"],
)
def test_a_head_converted_after_the_model_takes_the_models_layer_options(options: dict) -> None:
    """A head put in after convert() and converted by a second convert() (what summary() advises) took the defaults
    for every layer option: a Normal head on a BatchEnsemble or Cauchy model, a multiplicative one on an additive
    model, the depth rule's prior scale for one layer (0.3 against the model's 0.17). It takes the model's layers'
    options, as a head swapped in before the conversion does; an option said is taken as said."""
    body = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU()]
    first = bayesify.convert(nn.Sequential(*body, nn.Linear(8, 3)), task="classification", **options)
    after = bayesify.convert(nn.Sequential(*copy.deepcopy(body), nn.Linear(8, 5)), task="classification", **options)
    after[4] = nn.Linear(8, 3)
    bayesify.convert(after)
    assert after[4].rank1_state.options == first[4].rank1_state.options == first[0].rank1_state.options
    said = bayesify.convert(nn.Sequential(*copy.deepcopy(body), nn.Linear(8, 5)), task="classification", **options)
    said[4] = nn.Linear(8, 3)
    bayesify.convert(said, prior_std=0.5)
    assert said[4].rank1_state.options.prior_std == 0.5 and said[0].rank1_state.options.prior_std != 0.5
    assert said[4].rank1_state.options.replace(prior_std=0.0) == said[0].rank1_state.options.replace(prior_std=0.0)
    said[2] = nn.Linear(8, 8)  # the model's layers now differ in prior_std: a new one cannot take theirs
    with pytest.raises(ValueError, match=r"have different prior_std values .* pass prior_std=\.\.\. to this convert"):
        bayesify.convert(said)

def test_a_second_conversion_with_other_model_wide_options_names_what_was_converted() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    bayesify.convert(net, components=2, task="classification")
    with pytest.raises(ValueError, match=r"^Sequential was converted with components=2; a second convert\(\) must use"):
        bayesify.convert(net, components=4)

    class Outer(nn.Module):  # a part converted on its own before: named, not the outer model
        def __init__(self) -> None:
            super().__init__()
            self.inner = bayesify.convert(nn.Sequential(nn.Linear(4, 8)), components=2, task="regression")
            self.head = nn.Linear(8, 3)

    with pytest.raises(ValueError, match=r"^a part of Outer \(holding 'inner.0'\) was converted with components=2"):
        bayesify.convert(Outer(), components=4)


def test_an_untied_lm_head_that_resize_token_embeddings_replaced_is_named() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=32,
                                     tie_word_embeddings=False)  # fmt: skip
    model = bayesify.convert(transformers.GPT2LMHeadModel(config))
    model.resize_token_embeddings(60, mean_resizing=False)  # a new, plain lm_head
    with pytest.warns(UserWarning, match=r"lm_head \(Linear\) was put in GPT2LMHeadModel after bayesify.convert"):
        bayesify.kl_loss(model, 100)
    bayesify.convert(model)
    assert isinstance(model.lm_head, bayesify.layers.Rank1Layer)


def test_revert_of_a_model_sharing_a_converted_layer_with_another_is_refused() -> None:
    # b was never converted but shares a layer with a: revert(b) reverted it, and a lost its trained factors silently
    shared = nn.Linear(4, 8)
    a, b = nn.Sequential(shared, nn.ReLU(), nn.Linear(8, 3)), nn.Sequential(shared, nn.ReLU(), nn.Linear(8, 2))
    bayesify.convert(a, task="classification", components=4, init="normal").eval()
    x = torch.randn(5, 4)
    before = a(x)
    with pytest.raises(ValueError, match=r"Sequential holds layers of another converted model \('0', converted with"):
        bayesify.revert(b)
    torch.testing.assert_close(a(x), before)
    bayesify.revert(a)  # its own: as before
    assert not bayesify.is_converted(a) and type(shared) is nn.Linear
