"""The K-member ensemble exported as one graph with a dynamic batch: ``torch.export`` and ONNX.

The recipe of the README: ``model.eval()``, ``bayesify.mode(model, noise=False)`` (the posterior
means; with noise the graph holds random ops and every run draws afresh), then
``torch.export.export`` / ``torch.onnx.export(..., dynamo=True)`` with ``dynamic_shapes``. Both
graphs are checked against eager on batch sizes other than the traced one, including 1 and K
(onnxscript's ``repeat_interleave`` with a symbolic count failed for B > 1 and was silently wrong
for B = K; the rows are now built without it), and with the folded path forced, whose blocks are
slices of a symbolic size.
"""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

import bayesify
from tests._rank1 import perturb

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

K = 4
BATCHES = (1, 2, 3, 4, 5, 7)  # traced at 2; 1 and K = 4 were the failing / silently wrong sizes


def converted(net: nn.Module, **options) -> nn.Module:
    model = bayesify.convert(net, components=K, task="classification", **options)
    return perturb(model).eval()  # members that differ, so the mixture is not any single member


def _eager(model: nn.Module, x: torch.Tensor, **mode) -> torch.Tensor:
    with torch.no_grad(), bayesify.mode(model, noise=False, **mode):
        return model(x)


def assert_exports(model: nn.Module, shape: tuple[int, ...], path: Path, *, onnx_from_model: bool = False) -> None:
    """torch.export and ONNX of the evaluation mixture, dynamic batch, equal to eager at every batch size.

    ONNX is exported from the exported program (one trace for both), or with ``onnx_from_model``
    straight from the model as the README's recipe does (its own trace).
    """
    example = torch.randn(2, *shape)
    batch = {0: Dim("batch")}
    with bayesify.mode(model, noise=False):
        program = torch.export.export(model, (example,), dynamic_shapes=(batch,))
        with contextlib.redirect_stdout(io.StringIO()):  # the exporter's progress lines
            if onnx_from_model:
                torch.onnx.export(
                    model, (example,), path, dynamo=True, input_names=["input"], output_names=["output"],
                    dynamic_shapes=(batch,), external_data=False,
                )  # fmt: skip
            else:
                torch.onnx.export(
                    program, (example,), path, dynamo=True, input_names=["input"], output_names=["output"]
                )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert isinstance(session.get_inputs()[0].shape[0], str), "the ONNX graph keeps a symbolic batch"
    for b in BATCHES:
        x = torch.randn(b, *shape)
        expected = _eager(model, x)
        assert expected.shape[0] == b
        assert (expected - _eager(model, x, component=0)).abs().max() > 1e-3, "the mixture is not one member"
        torch.testing.assert_close(program.module()(x), expected, atol=1e-5, rtol=1e-5)
        got = torch.from_numpy(session.run(None, {"input": x.numpy()})[0])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"onnxruntime, batch {b}: {m}")


def test_export_mlp_classifier(tmp_path: Path) -> None:
    model = converted(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    assert_exports(model, (6,), tmp_path / "mlp.onnx", onnx_from_model=True)


def test_a_failed_export_leaves_the_model_usable() -> None:
    # an example batch of 1 makes torch.export specialise the batch; the traced forward pass must leave
    # no fake tensors behind: the model still runs, copies and merges
    model = converted(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
    with bayesify.mode(model, noise=False), pytest.raises(Exception, match=r"Constraints violated \(batch\)"):
        torch.export.export(model, (torch.randn(1, 6),), dynamic_shapes=({0: Dim("batch")},))
    x = torch.randn(3, 6)
    torch.testing.assert_close(_eager(copy.deepcopy(model), x), _eager(model, x))
    torch.testing.assert_close(bayesify.merge(model, component=1)(x), _eager(model, x, component=1))


def test_export_small_cnn(tmp_path: Path) -> None:
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2),
        nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 5),
    )  # fmt: skip
    assert_exports(converted(net), (3, 8, 8), tmp_path / "cnn.onnx")


def test_export_folded_blocks_of_a_symbolic_batch(tmp_path: Path) -> None:
    # sampling='component' always runs the folded path: K blocks x.narrow(0, i * B, B) of a symbolic B
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(36, 3))
    assert_exports(converted(net, sampling="component"), (3, 5, 5), tmp_path / "folded.onnx")


def test_export_members_with_the_tile_route() -> None:
    # the K members themselves, member-major [K * B, ...], for a deployment that reduces them itself
    model = converted(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
    with bayesify.mode(model, route="tile", noise=False):
        program = torch.export.export(model, (torch.randn(2, 6),), dynamic_shapes=({0: Dim("batch")},))
    for b in (1, 3, 5):
        x = torch.randn(b, 6)
        expected = _eager(model, x, route="tile")
        assert expected.shape == (K * b, 3)
        torch.testing.assert_close(program.module()(x), expected, atol=1e-5, rtol=1e-5)


class _LastStep(nn.Module):
    def __init__(self, recurrent: nn.Module) -> None:
        super().__init__()
        self.recurrent, self.head = recurrent, nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.recurrent(x)[0][:, -1])


@pytest.mark.parametrize("recurrent", [nn.LSTM, nn.GRU])
def test_a_recurrent_model_exports_with_a_dynamic_batch(recurrent: type) -> None:
    """A converted LSTM / GRU keeps one pass's draws per call size; exported with a dynamic batch that size is
    symbolic, which cannot key a dict ("unhashable type: non-nested SymInt"): keyed by its expression."""
    torch.manual_seed(0)
    model = _LastStep(recurrent(6, 4, batch_first=True))
    bayesify.convert(model, components=3, task="classification", init="normal").eval()
    program = torch.export.export(model, (torch.randn(2, 5, 6),), dynamic_shapes=({0: Dim("batch")},))
    for batch in (1, 3, 7):
        x = torch.randn(batch, 5, 6)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(x), model(x))


def test_a_model_in_training_exported_with_a_dynamic_batch_is_refused_in_one_line() -> None:
    """The sample route's blocks are Python numbers; a symbolic batch failed deep in the router ("unsupported operand
    type(s) for divmod(): 'SymInt' and 'int'"). One line names the two ways that work."""
    model = bayesify.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), components=2, task="classification")
    model.train()
    with pytest.raises(ValueError, match=r"exports with a static batch only: export it in evaluation"):
        torch.export.export(model, (torch.randn(4, 4),), dynamic_shapes=({0: Dim("batch")},))
    torch.export.export(model, (torch.randn(4, 4),))  # a static batch exports
