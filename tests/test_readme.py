"""The README's usage snippet runs as written (pretrained weights from a local file: no hub here)."""

from __future__ import annotations

import re
from pathlib import Path

import timm
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_snippet_runs(tmp_path: Path, capsys) -> None:
    code = re.search(r"## Use\s+```python\n(.*?)```", README.read_text(), re.S).group(1)
    checkpoint = tmp_path / "resnet50.pth"
    torch.save(timm.create_model("resnet50").state_dict(), checkpoint)
    assert 'pretrained=True)' in code
    code = code.replace("pretrained=True)", f"pretrained=True, pretrained_cfg_overlay=dict(file={str(checkpoint)!r}))")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["logits"].shape == (8, 1000)
    assert namespace["members"].shape == (16, 8, 1000)
    assert namespace["tiled"].shape == namespace["sampled"].shape == (32, 1000)
    assert namespace["u"].mutual_information.shape == (8,)
    printed = capsys.readouterr().out
    assert "54 rank-1 layers, K=4" in printed and "25,557,032 original + 421,112 rank-1" in printed
    assert "output: classification (class axis -1)" in printed


def test_every_option_is_in_the_readme_table() -> None:
    import dataclasses

    from bayesify import Rank1Config

    table = README.read_text().split("## Options", 1)[1].split("\n## ", 1)[0]
    for field in dataclasses.fields(Rank1Config):
        assert f"`{field.name}`" in table, f"README's options table does not list {field.name}"


def test_the_install_section_names_every_extra_and_what_the_trainer_needs() -> None:
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    section = README.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    for extra in extras:
        assert f'"bayesify[{extra}]"' in section, f"README's install section does not show the {extra!r} extra"
    assert any(dep.startswith("accelerate") for dep in extras["hf"])  # what the section says the hf extra brings
    assert "`transformers.Trainer` does not start without `accelerate`" in section
