"""A timm ViT's K-member ensemble exported with a dynamic batch (``torch.export`` and ONNX), checked in
onnxruntime against eager; see ``test_export.py`` for the recipe (a file of its own: the slow one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_export import assert_exports, converted

timm = pytest.importorskip("timm")


def test_export_timm_vit(tmp_path: Path) -> None:
    net = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=5)
    assert_exports(converted(net), (3, 32, 32), tmp_path / "vit.onnx")
