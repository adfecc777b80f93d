"""Every conversion option is declared once (Rank1Config) and reachable from convert(), TrainConfig and the CLI."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
import torch

import bayesify
from bayesify import cli
from bayesify.config import Rank1Config
from bayesify.options import StrOption
from bayesify.training import build_model
from bayesify.zoo.data import load_data

FIELDS = dataclasses.fields(Rank1Config)
HINTS = typing.get_type_hints(Rank1Config)
# where the first other value would be invalid on its own (a Cauchy posterior needs a Cauchy prior)
SPECIAL = {"posterior": "delta", "task": "multilabel"}


def _other_value(f: dataclasses.Field) -> object:
    """A valid value different from the field's default, derived from its type."""
    if f.name in SPECIAL:
        return SPECIAL[f.name]
    kind = HINTS[f.name]
    base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
    if isinstance(base, type) and issubclass(base, StrOption):
        return next(m for m in base if m != f.default).value
    if base is bool:
        return not f.default
    if base is int:
        return 1 if f.default is None else f.default + 1
    if f.default is None:
        return 0.01
    return f.default / 2 if f.default else 0.05


def _flag(name: str, value: object) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    return [flag, str(value)]


def test_convert_signature_lists_every_option_with_its_default() -> None:
    params = inspect.signature(bayesify.convert).parameters
    for f in FIELDS:
        assert f.name in params, f"convert() does not show option {f.name}"
        assert params[f.name].default == f.default
        assert f"{f.name}:" in bayesify.convert.__doc__


CLI_FIELDS = [f for f in FIELDS if f.metadata.get("cli", True)]  # (unbatched_inputs names a Python model's inputs)


@pytest.mark.parametrize("field", CLI_FIELDS, ids=[f.name for f in CLI_FIELDS])
def test_every_option_reaches_the_layers_from_the_cli(field: dataclasses.Field, tmp_path) -> None:
    value = _other_value(field)
    argv = ["train", "--model", "mlp", "--data", "breast-cancer", "--out", str(tmp_path / "run"), *_flag(field.name, value)]
    config = cli._train_config(cli._parser().parse_args(argv))
    assert getattr(config, field.name) == value, f"--{field.name} did not reach TrainConfig"
    assert isinstance(config, Rank1Config) and getattr(config.rank1, field.name) == value
    model = build_model(config, load_data("breast-cancer"))
    layer = next(layer for _, layer in bayesify.rank1_layers(model))
    scope = field.metadata["scope"]
    if scope == "layer":  # each layer's own options (the prior's scale resolved for the depth, when unset)
        assert getattr(layer.rank1_options, field.name) == value, f"{field.name} did not reach the converted layers"
    elif scope == "model":  # the model's one copy, which every layer reads
        assert getattr(layer.rank1_state.model.options, field.name) == value, f"{field.name} did not reach the model"
        assert layer.rank1_state.model is model.rank1_model
    elif field.name == "embeddings":  # what convert() does: the table's embeddings become Gaussian
        assert any(isinstance(m, bayesify.layers.GaussianEmbedding) for m in model.modules()) or not any(
            isinstance(m, torch.nn.Embedding) for m in model.modules()
        )
    else:  # the task and its details: the model's task, decided once by convert() (a detail where it applies)
        task = model.rank1_model.task
        shown = {"task": str(task), "class_axis": getattr(task, "class_axis", value), "gaussian_variance": str(getattr(task, "variance", value))}
        assert shown[field.name] == value, f"{field.name} did not reach the model's task ({task!r})"


def test_every_option_has_one_scope_and_the_option_classes_hold_theirs() -> None:
    """``scope`` says who reads an option; ModelOptions and LayerOptions hold exactly the options of theirs."""
    from bayesify.config import LayerOptions, ModelOptions, scoped

    assert {f.metadata["scope"] for f in FIELDS} == {"model", "layer", "conversion"}
    assert [f.name for f in dataclasses.fields(ModelOptions)] == list(scoped(Rank1Config, "model"))
    assert [f.name for f in dataclasses.fields(LayerOptions)] == list(scoped(Rank1Config, "layer"))


def test_unknown_options_are_named() -> None:
    from torch import nn

    with pytest.raises(TypeError, match=r"unknown conversion option\(s\) \['prior_sd'\]; the options are: components"):
        bayesify.convert(nn.Linear(2, 2), prior_sd=0.1)


def test_convert_states_every_option_for_type_checkers() -> None:
    """``convert(model, **options: Unpack[Rank1Options])``: the TypedDict lists Rank1Config's fields, in order, each
    with the field's type (an option enum also as a string), so IDEs and type checkers see every option."""
    from bayesify.config import Rank1Options

    assert list(Rank1Options.__annotations__) == [f.name for f in FIELDS]
    assert not Rank1Options.__total__
    hints = typing.get_type_hints(Rank1Options)
    for f in FIELDS:
        field_type, stated = HINTS[f.name], hints[f.name]
        wanted = set(typing.get_args(field_type) or (field_type,))
        assert wanted <= set(typing.get_args(stated) or (stated,)), f"{f.name}: {stated} does not take {field_type}"
    assert "Unpack[Rank1Options]" in str(inspect.get_annotations(bayesify.convert)["options"])
