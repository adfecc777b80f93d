"""``variational/distributions.py``: the scale's parameterisation, sampling, and the noise op of compiled CPU graphs."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bayesify.options import Posterior
from bayesify.variational import distributions


@pytest.mark.parametrize("value", [1e-3, 0.1, 1.0, 30.0])
def test_raw_scale_is_the_inverse_of_scale(value: float) -> None:
    raw = torch.tensor(distributions.raw_scale(value), dtype=torch.float64)
    assert distributions.scale(raw).item() == pytest.approx(value, rel=1e-6)


def test_rsample_is_loc_plus_scale_times_the_noise() -> None:
    loc, scale = torch.randn(3, 5), torch.rand(3, 5) + 0.1
    eps = torch.randn(3, 5)
    torch.testing.assert_close(distributions.rsample(Posterior.NORMAL, loc, scale, eps), loc + scale * eps)
    assert distributions.rsample(Posterior.DELTA, loc, scale) is loc  # a point estimate: no noise
    torch.manual_seed(0)
    drawn = distributions.rsample(Posterior.NORMAL, loc, scale)
    torch.manual_seed(0)
    torch.testing.assert_close(drawn, loc + scale * torch.randn(3, 5))


def test_the_noise_families() -> None:
    torch.manual_seed(0)
    like = torch.empty(20_000)
    normal, cauchy = distributions.noise(Posterior.NORMAL, like), distributions.noise(Posterior.CAUCHY, like)
    assert abs(normal.std().item() - 1) < 0.03 and normal.abs().max() < 6
    assert cauchy.median().abs() < 0.05 and (cauchy.abs() > 100).sum() > 20  # heavy tails: P(|x| > 100) ~ 0.6%


def test_the_compiled_cpu_noise_op_is_torchs_generator_and_tagged_as_random() -> None:
    op = torch.ops.bayesify.standard_noise.default
    assert torch.Tag.nondeterministic_seeded in op.tags  # the compiler never merges, drops or recomputes it
    like = torch.empty(4, 7)
    for cauchy in (False, True):
        torch.manual_seed(3)
        drawn = op(like.shape, like.dtype, like.device, cauchy)
        torch.manual_seed(3)
        torch.testing.assert_close(drawn, torch.empty_like(like).cauchy_() if cauchy else torch.randn_like(like))
    with FakeTensorMode():  # what tracing sees: the shape, dtype and device asked for
        out = op((2, 3), torch.float64, torch.device("cpu"), False)
    assert out.shape == (2, 3) and out.dtype == torch.float64


def test_a_compiled_draw_calls_the_op_on_the_cpu() -> None:
    calls = []

    def backend(gm: torch.fx.GraphModule, inputs: list) -> object:
        calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    loc = torch.randn(2, 3)
    torch._dynamo.reset()
    torch.compile(lambda t: distributions.rsample(Posterior.NORMAL, t, t.exp()), backend=backend, fullgraph=True)(loc)
    assert any("bayesify.standard_noise" in c for c in calls), calls
