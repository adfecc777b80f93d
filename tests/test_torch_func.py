"""torch.func's transforms on a converted model: per-example gradients (``vmap(grad(...))``), Jacobians
(``jacrev``) and ``vmap`` of the model give what the same maths gives one example at a time. bayesify's own
autograd Functions (fewer ops per step) have no vmap rule: under a transform each takes its plain ops."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import bayesify
from tests._rank1 import perturb


def _models() -> list[nn.Module]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    return [mlp, cnn]


@pytest.mark.parametrize("index", [0, 1], ids=["mlp", "cnn"])
def test_per_example_gradients_jacobians_and_vmap_match_one_example_at_a_time(index: int) -> None:
    model = bayesify.convert(_models()[index], task="classification", components=2).double()
    perturb(model)
    model.eval()
    x = torch.randn(5, 4, dtype=torch.float64) if index == 0 else torch.randn(5, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(3, (5,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.nll_loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(5):
        one = grad(loss)(params, x[i], y[i])
        for name in ("0.weight", "0.rank1_s.loc", "0.rank1_r.rho"):
            torch.testing.assert_close(per_example[name][i], one[name])
    torch.testing.assert_close(vmap(lambda xi: model(xi.unsqueeze(0)).squeeze(0))(x), model(x))
    jacobian = jacrev(lambda xi: model(xi.unsqueeze(0)).squeeze(0))(x[0])
    torch.testing.assert_close(jacobian, torch.autograd.functional.jacobian(lambda xi: model(xi.unsqueeze(0)).squeeze(0), x[0]))


class _KL(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self) -> torch.Tensor:
        return bayesify.kl_divergence(self.model)


def test_the_kl_under_grad_is_its_plain_formula() -> None:
    model = bayesify.convert(_models()[0], task="classification", components=2).double()
    perturb(model)
    kl = _KL(model)
    params = {k: v.detach() for k, v in kl.named_parameters()}
    by_func = grad(lambda p: functional_call(kl, p, ()))(params)
    bayesify.kl_divergence(model).backward()
    for name, p in kl.named_parameters():
        if "rank1" in name:  # (a bias offset has no KL: no gradient, zeros under torch.func)
            torch.testing.assert_close(by_func[name], p.grad if p.grad is not None else torch.zeros_like(p))
    assert any(g.abs().sum() > 0 for g in by_func.values())


@pytest.mark.parametrize("family", ["linear", "conv", "lstm"])
def test_forward_mode_ad_matches_torch_func_jvp(family: str) -> None:
    # a dual tensor through a converted layer failed deep inside (the saved-tensors hook read a dual tensor's storage;
    # the folded weights' Function has no jvp); the plain ops run in forward-mode AD, as under torch.func
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    net, x = {
        "linear": (nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), torch.randn(3, 4)),
        "conv": (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 3)), torch.randn(3, 3, 6, 6)),
        "lstm": (nn.LSTM(4, 3, batch_first=True), torch.randn(3, 5, 4)),
    }[family]
    model = bayesify.convert(net, task="regression", components=4, init="normal")
    tangent = torch.randn_like(x)

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    for training, context in ((True, lambda: bayesify.mode(model, component=2, noise=False)), (False, contextlib.nullcontext)):
        model.train(training)
        with context():
            with fwAD.dual_level():
                got = fwAD.unpack_dual(first(model(fwAD.make_dual(x, tangent)))).tangent
            _, expected = torch.func.jvp(lambda v: first(model(v)), (x,), (tangent,))
        torch.testing.assert_close(got, expected)
