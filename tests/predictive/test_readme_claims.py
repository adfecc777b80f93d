"""What the README says of outputs and their reloading holds: the uncertainty section's attribute names, the
variation ratio's definition, the Hugging Face reload recipe (run as written, on a tied GPT-2), and where to fold a
batch norm into a converted convolution."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import bayesify
from bayesify.predictive.decompositions import (
    BinaryUncertainty,
    ClassificationUncertainty,
    RegressionUncertainty,
    classification_uncertainty,
)

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _names(cell: str) -> set[str]:
    """The attribute names a README cell shows in backticks (`interval(level)` -> interval)."""
    return {re.match(r"\w+", name).group() for name in re.findall(r"`([a-z_]+(?:\(\w*\))?)`", cell)}


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")} | {f.name for f in dataclasses.fields(cls)}


def test_the_uncertainty_section_names_the_attributes_the_results_have() -> None:
    section = _section("Uncertainty outputs")
    rows = {line.split("|")[1].strip(): line.split("|")[-2] for line in section.splitlines() if line.startswith("| `")}
    for task, cls in [('`"classification"`', ClassificationUncertainty), ('`"regression"`', RegressionUncertainty)]:
        assert _names(rows[task]) and _names(rows[task]) <= _public(cls), (task, _names(rows[task]) - _public(cls))
    gaussian = _names(rows['`"gaussian"`'].split("|")[-1]) - {"gaussian_variance"}
    assert gaussian <= _public(RegressionUncertainty) and {"total_variance", "epistemic_variance"} <= gaussian
    # every per-example quantity of a classification is named (it said "probabilities": u.probabilities fails)
    fields = {f.name for f in dataclasses.fields(ClassificationUncertainty)} - {"class_axis", "member_probs"}
    assert fields <= _names(rows['`"classification"`'])
    assert rows['`"binary"`, `"multilabel"`'].strip() == "the same, per label"
    assert fields <= _public(BinaryUncertainty)
    for name in re.findall(r"\bu\.(\w+)", section):  # the examples' u.mutual_information, u.interval(0.9), ...
        assert any(name in _public(cls) for cls in (ClassificationUncertainty, RegressionUncertainty)), name


def test_the_readme_says_which_variation_ratio_and_its_example_holds() -> None:
    section = " ".join(_section("Uncertainty outputs").split())
    assert "`variation_ratio` is Gal's (2016)" in section
    assert "members voting 8, 9, 8, 8 give 0.25 even where the mixture ranks 9 first" in section
    logits = torch.full((4, 1, 10), -10.0)
    logits[[0, 2, 3], 0, 8], logits[[0, 2, 3], 0, 9] = 0.0, -0.1
    logits[1, 0, 9] = 10.0  # one member sure of 9: the mixture's argmax
    u = classification_uncertainty(logits)
    assert u.prediction.tolist() == [9] and u.variation_ratio.tolist() == [0.25]


def _recipe() -> str:
    block = README.split("fresh factors. Convert the architecture, then load the file", 1)[1]
    return re.search(r"```python\n(.*?)```", block, re.DOTALL).group(1)


@pytest.mark.parametrize("tied, shard", [(True, None), (False, None), (True, "8KB")], ids=["tied", "untied", "sharded"])
def test_the_hugging_face_reload_recipe_runs_on_a_tied_gpt2(tmp_path: Path, tied: bool, shard: str | None) -> None:
    # (sharded: a large model's save_pretrained writes model-0000i-of-0000n files; the recipe read model.safetensors)
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    saved = bayesify.convert(transformers.GPT2LMHeadModel(config), components=2)
    with torch.no_grad():
        for name, parameter in saved.named_parameters():
            if "rank1" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    saved.save_pretrained(tmp_path, **({} if shard is None else {"max_shard_size": shard}))
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == (shard is not None)
    namespace = {
        "pathlib": __import__("pathlib"),
        "bayesify": bayesify,
        "safetensors": __import__("safetensors.torch"),
        "Cls": transformers.GPT2LMHeadModel,
        "config": config,
        "path": str(tmp_path),
        "the_same_options": {"components": 2},
    }
    exec(compile(_recipe(), "README.md", "exec"), namespace)  # noqa: S102 (strict loading failed: lm_head.weight missing)
    model = namespace["model"]
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    tokens = torch.randint(50, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens).logits, saved.eval()(tokens).logits, rtol=0, atol=0)
    # the recipe's check is no blanket strict=False: a key missing that is not tied stops it
    state = namespace["state"]
    del state["transformer.h.0.mlp.c_fc.rank1_s.loc"]
    (tmp_path / "short").mkdir()
    namespace["safetensors"].torch.save_file(state, str(tmp_path / "short" / "model.safetensors"))
    with pytest.raises(AssertionError):
        exec(compile(_recipe(), "README.md", "exec"), {**namespace, "path": str(tmp_path / "short")})  # noqa: S102


def test_a_batch_norm_folds_before_convert_or_into_the_merged_copy_as_the_readme_says() -> None:
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    deployment = " ".join(_section("Deployment").split())
    assert "before `convert` or in the merged copy, not in the converted model" in deployment
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 36, 2))
    with torch.no_grad():
        net[1].running_mean.normal_(), net[1].running_var.uniform_(0.5, 2.0), net[1].weight.normal_()
    model = bayesify.convert(net, components=2, task="regression")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "rank1" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    model.eval()
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad(), bayesify.mode(model, component=1, noise=False):
        member = model(x)
    merged = bayesify.merge(model, component=1).eval()
    merged[0], merged[1] = fuse_conv_bn_eval(merged[0], merged[1]), nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(merged(x), member, rtol=1e-5, atol=1e-5)  # in the merged copy: exact
        model[0], model[1] = fuse_conv_bn_eval(model[0], model[1]), nn.Identity()
        with bayesify.mode(model, component=1, noise=False):
            assert (model(x) - member).abs().max() > 1e-2  # in the converted model: the bias offsets were not scaled
