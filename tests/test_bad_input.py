"""Bad input fails loudly, names the option and value, and says what is accepted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bayesify


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(components=0), ValueError, r"components=0 must be an integer >= 1"),
        (dict(components=2.5), ValueError, r"components=2.5"),
        (dict(components=True), ValueError, r"components=True"),
        (dict(prior_std=0.0), ValueError, r"prior_std=0.0 must be a finite number > 0"),
        (dict(prior_std=-1), ValueError, r"prior_std=-1"),
        (dict(prior_std=float("nan")), ValueError, r"prior_std=nan"),
        (dict(prior="laplace"), ValueError, r"prior='laplace' is not a valid Prior option; accepted: 'normal', 'cauchy'"),
        (dict(posterior="gaussian"), ValueError, r"posterior='gaussian' .* accepted: 'normal', 'cauchy', 'delta'"),
        (dict(posterior="cauchy", prior="normal"), ValueError, r"infinite KL"),
        (dict(perturbation="both"), ValueError, r"perturbation='both'"),
        (dict(init="zeros"), ValueError, r"init='zeros' .* accepted: 'preserve', 'random_sign', 'normal'"),
        (dict(init_dropout=1.5), ValueError, r"init_dropout=1.5 must be in \(0, 1\)"),
        (dict(init_std=0), ValueError, r"init_std=0"),
        (dict(clip=-1), ValueError, r"clip=-1"),
        (dict(batch_dim=-1), ValueError, r"batch_dim=-1"),
        (dict(reduction="max"), TypeError, r"unknown conversion option\(s\) \['reduction'\]"),
        (dict(include="encoder.*"), ValueError, r"\['encoder\.\*'\] matched no convertible module"),
        (dict(exclude=["0", "nope"]), ValueError, r"\['nope'\] matched no"),
        (dict(include=3), TypeError, r"include=3 must be a string or a list of strings"),
        (dict(exclude="*"), ValueError, r"exclude=\['\*'\] left no layer of Sequential to convert \(it left out 0, 2\)"),
        (dict(exclude=["0", "2"]), ValueError, r"exclude=\['0', '2'\] left no layer"),
        (dict(task="regression", class_axis=1), ValueError, r"class_axis=1 goes with task='classification' .* drop"),
        (dict(task="binary", class_axis=-1), ValueError, r"class_axis=-1 goes with task='classification'"),
        (dict(mapping={nn.Linear: nn.Linear}), TypeError, r"mapping\[Linear\]=.* must be a subclass of bayesify.layers.Rank1Layer"),
    ],
)
def test_invalid_options(kwargs: dict, error: type, match: str) -> None:
    net = _net()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(error, match=match):
        bayesify.convert(net, **kwargs)
    # nothing was half-converted
    assert not bayesify.is_converted(net)
    assert list(net.state_dict()) == list(state)


def test_nothing_to_convert() -> None:
    with pytest.raises(ValueError, match=r"no layer to convert: none of its modules is an instance of"):
        bayesify.convert(nn.Sequential(nn.ReLU(), nn.LayerNorm(3)))


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match="convert\\(\\) takes an nn.Module, got function"):
        bayesify.convert(lambda x: x)


def test_converting_twice_with_other_layer_options_refuses_and_leaves_model_working() -> None:
    net = bayesify.convert(_net(), task="classification")
    keys = list(net.state_dict())
    with pytest.raises(ValueError, match=r"already converted .* left unchanged, and its layers keep their prior_std\. .*bayesify.revert"):
        bayesify.convert(net, prior_std=0.5)
    assert list(net.state_dict()) == keys
    assert net.eval()(torch.randn(3, 4)).shape == (3, 2)


def test_converting_again_with_what_the_model_has_is_a_no_op() -> None:
    """Lightning calls ``configure_model`` in every stage (fit, then test, predict) and asks it to be idempotent:
    a second ``convert`` with the model's own options was refused ("nothing new matched")."""
    net = bayesify.convert(_net(), task="classification", components=4, prior_std=0.5)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    state = net.rank1_model
    assert bayesify.convert(net) is net
    assert bayesify.convert(net, task="classification", components=4, prior_std=0.5) is net
    depth = bayesify.convert(_net(), task="classification", prior_std=None, init_std=None)  # every option's default said
    assert bayesify.convert(depth, task="classification", prior_std=None, init_std=None) is depth  # (None: unset)
    assert net.rank1_model is state and {k: v for k, v in net.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert net.eval()(torch.randn(3, 4)).shape == (3, 2)


@pytest.mark.parametrize(
    "layer,x,match",
    [
        (nn.Linear(5, 3), torch.randn(2, 7), "mat1 and mat2 shapes cannot be multiplied"),
        (nn.Conv2d(4, 3, 3), torch.randn(2, 3, 8, 8), "expected input.* to have 4 channels"),
        (nn.Conv1d(4, 3, 3), torch.randn(2, 4, 2), "Kernel size can't be greater than actual input size"),
    ],
)
def test_wrong_input_shapes_give_torchs_own_errors(layer: nn.Module, x: torch.Tensor, match: str) -> None:
    bayesify.convert(layer)
    for training in (True, False):
        layer.train(training)
        with pytest.raises(RuntimeError, match=match):
            layer(x)


def test_kl_of_unconverted_model() -> None:
    with pytest.raises(ValueError, match="call bayesify.convert"):
        bayesify.kl_divergence(_net())


def test_model_without_tensor_input() -> None:
    class Takes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, values: list[float]) -> torch.Tensor:
            return self.fc(torch.tensor(values))

    net = bayesify.convert(Takes())
    with pytest.raises(TypeError, match="no tensor input"):
        net([1.0, 2.0])


def test_one_unbatched_example_in_evaluation_is_named_with_the_fix() -> None:
    # its one dimension was taken as the batch and tiled for the members: torch's error named K x B rows
    model = bayesify.convert(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), task="classification").eval()
    for call in (lambda x: model(x), lambda x: bayesify.uncertainty(model, x), lambda x: bayesify.predict(model, x)):
        with pytest.raises(ValueError, match=r"one unbatched example \(an input of shape \(5,\)\).*x\.unsqueeze\(0\)"):
            call(torch.randn(5))
    assert model(torch.randn(5)[None]).shape == (1, 3)  # the fix it names


def test_torch_jit_trace_is_refused_naming_export_and_merge() -> None:
    # the tracer turns the shapes a layer's choices read into tensors: it failed deep inside with an AssertionError
    model = bayesify.convert(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), task="classification").eval()
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace .*torch\.export\.export.*dynamo=True.*bayesify\.merge"):
        torch.jit.trace(model, torch.randn(4, 8))
    assert model(torch.randn(2, 8)).shape == (2, 3)  # nothing left half-routed
    member = bayesify.merge(model, component=1)
    x = torch.randn(4, 8)
    torch.testing.assert_close(torch.jit.trace(member, x)(x), member(x))


def test_an_error_in_a_tiled_pass_says_its_rows_are_the_tiled_batchs() -> None:
    # in evaluation torch's error names the K x B rows of the tiled batch (input[8, 1, ...] for 2 examples given)
    net = bayesify.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 2)), task="regression")
    net.eval()
    with pytest.raises(RuntimeError, match=r"input\[8, 1, 6, 6\]") as raised:
        net(torch.randn(2, 1, 6, 6))
    assert any("each of the 2 examples given 4 times" in note and "(2, 1, 6, 6)" in note for note in raised.value.__notes__)
    with pytest.raises(RuntimeError) as plain:  # a training pass runs the batch as given: nothing to add
        net.train()(torch.randn(2, 1, 6, 6))
    assert not getattr(plain.value, "__notes__", None)
