"""``bayesify.kl_loss``: the drop-in KL term (its warm-up, its errors) and the recipe on small data."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesify


def _net() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _perturbed(model: nn.Module) -> nn.Module:
    """Move the posterior away from the prior so that the KL is not 0."""
    with torch.no_grad():
        for _, layer in bayesify.rank1_layers(model):
            for _, factor in layer.rank1_factors():
                factor.loc.add_(0.3)  # a view of the model's store: written through
    return model


def test_the_weight_rises_linearly_over_the_warm_up_then_stays_one() -> None:
    model = _perturbed(bayesify.convert(_net(), task="classification"))
    full = bayesify.kl_divergence(model) / 100
    assert full > 0
    for step, weight in ((0, 0.1), (4, 0.5), (9, 1.0), (50, 1.0)):
        torch.testing.assert_close(bayesify.kl_loss(model, 100, step=step, warmup_steps=10), full * weight)
    torch.testing.assert_close(bayesify.kl_loss(model, 100), full)  # no step: the full term
    torch.testing.assert_close(bayesify.kl_loss(model, 100, step=3, warmup_steps=0), full)
    # counts as a loop may hold them: NumPy integers, one-element integer tensors (len of a tensor data set, a step)
    np = pytest.importorskip("numpy")
    torch.testing.assert_close(bayesify.kl_loss(model, np.int64(100), step=torch.tensor(4), warmup_steps=np.int32(10)), full * 0.5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_train": 0}, "num_train=0"), ({"num_train": 2.5}, "num_train=2.5"), ({"num_train": True}, "num_train=True"),
    ({"num_train": 10, "warmup_steps": -1}, "warmup_steps=-1"),
    ({"num_train": 10, "step": -5, "warmup_steps": 10}, r"step=-5 must be the 0-based optimizer step"),  # (weight -0.4)
    ({"num_train": torch.tensor(2.5)}, r"num_train=tensor\(2.5000\)"),
    ({"num_train": 10, "warmup_steps": 100}, r"warmup_steps=100 raises .*pass step="),  # (it was ignored: weight 1)
])  # fmt: skip
def test_bad_arguments_name_the_value(kwargs: dict, message: str) -> None:
    model = bayesify.convert(_net(), task="classification")
    with pytest.raises(ValueError, match=message):
        bayesify.kl_loss(model, **kwargs)


def test_on_small_data_the_term_starts_at_zero_where_release_0_1_started_at_20_nats() -> None:
    """The README's recipe on a ResNet-18 with 1.3k training examples: the KL per example at conversion."""
    timm = pytest.importorskip("timm")
    net = timm.create_model("resnet18", num_classes=10)
    assert bayesify.kl_loss(bayesify.convert(net, task="classification"), 1300).item() == pytest.approx(0, abs=1e-6)
    old = bayesify.convert(timm.create_model("resnet18", num_classes=10), prior_std=0.1, init_dropout=1e-3)
    assert bayesify.kl_loss(old, 1300).item() > 10  # release 0.1's defaults: the term swamped a CE of ~2


def test_the_recipe_learns_300_examples_as_well_as_the_deterministic_loop() -> None:
    """A plain loop on 300 sklearn digits, run twice from the same weights and batches: the converted net with
    the KL term learns as the deterministic one does (held-out NLL within 10%), and the term stays small (it
    starts at 0 and grows only as the data moves the posterior): the KL does not swamp the data."""
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    deterministic = _net()
    converted = bayesify.convert(copy.deepcopy(deterministic), task="classification")
    epochs, batches = 20, 10
    results = {}
    for name, model in (("deterministic", deterministic), ("rank-1", converted)):
        torch.manual_seed(1)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        step, largest = 0, 0.0
        for _ in range(epochs):
            for rows in torch.randperm(300).split(300 // batches):
                loss = F.cross_entropy(model(x[rows]), y[rows])
                if model is converted:
                    kl = bayesify.kl_loss(model, 300, step=step, warmup_steps=2 * epochs * batches // 3)
                    largest = max(largest, kl.item())
                    loss = loss + kl
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
        model.eval()
        with torch.no_grad():  # the converted net's eval output: the mixture's log-probabilities
            results[name] = F.cross_entropy(model(x[300:800]), y[300:800]).item()
    assert largest < 0.3, largest  # nats per example; the cross-entropy starts at ~2.3
    assert results["rank-1"] < 1.1 * results["deterministic"], results


def test_a_count_of_batches_for_the_examples_is_warned_of_once() -> None:
    # kl_loss(model, len(loader)) right after a batch of 64: the KL weighed 64x too much, silently
    model = bayesify.convert(_net(), task="classification")
    model(torch.randn(64, 1, 8, 8))
    with pytest.warns(UserWarning, match=r"num_train=10\) is fewer than the 64 examples .*len\(train_set\)"):
        bayesify.kl_loss(model, 10)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bayesify.kl_loss(model, 10)  # once per model
        bayesify.kl_loss(bayesify.convert(_net(), task="classification"), 10)  # no pass yet: nothing to compare
