"""torch.jit.script on a converted model (timm's train.py --torchscript) is refused in one line naming torch.export,
torch.compile and bayesify.merge, as torch.jit.trace is; it failed deep inside layers/affine.py ("Compiled functions
can't take variable number of arguments")."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesify

FIXES = r"torch\.export\.export.*torch\.compile.*bayesify\.merge\(model, component=k\)"


def _script(model: nn.Module) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated
        return torch.jit.script(model)


class UserNet(nn.Module):
    """A root class of the user's own: only its layers are bayesify's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv(x)).mean(dim=(2, 3)))


def test_torch_jit_script_of_a_user_model_is_refused_naming_the_fixes() -> None:
    model = bayesify.convert(UserNet(), task="classification").eval()
    x = torch.randn(2, 3, 8, 8)
    model(x)
    with pytest.raises(RuntimeError, match=r"^torch\.jit\.script cannot compile a converted UserNet .*" + FIXES):
        _script(model)
    assert model(x).shape == (2, 5)  # the model is left as it was
    member = bayesify.merge(model, component=1)  # the fix it names
    torch.testing.assert_close(_script(member)(x), member(x))


def test_torch_jit_script_of_a_converted_timm_resnet_is_refused_naming_the_fixes() -> None:
    timm = pytest.importorskip("timm")
    model = bayesify.convert(timm.create_model("resnet18", num_classes=10)).eval()
    with pytest.raises(RuntimeError, match=r"^torch\.jit\.script cannot compile a converted ResNet .*" + FIXES):
        _script(model)
    assert "\n" not in str(pytest.raises(RuntimeError, _script, model).value)
    member = bayesify.merge(model, component=0)
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(_script(member)(x), member(x))
