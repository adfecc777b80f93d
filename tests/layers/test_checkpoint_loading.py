"""An unconverted (pretrained) checkpoint loads strictly into a converted model; a damaged converted one does not.

Every layer owns its rank-1 tables (``layer.rank1_s.loc``, ``layer.rank1_bias``: release 0.2's keys too). Each
layer's load pre-hook applies the rule: none of its ``rank1_*`` keys in the state dict -> an unconverted
checkpoint, the current rank-1 values stay; some -> a missing one is reported as missing. The root's pre-hook
(``variational/store.py``) splits release 0.3's flat store (``rank1_store_<i>_loc`` / ``_rho``) onto the
layers' keys and refuses a checkpoint of another K in one line, before anything is loaded. Original keys are
always strict.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import timm
import torch
from torch import nn

import bayesify


class SequenceModel(nn.Module):
    """LSTM -> self-attention -> linear head: three layer families with rank-1 state of different shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(a.mean(1))


def _rank1_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "rank1_" in k}


def release_0_3_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict as release 0.3 wrote it: each group of tables as the columns of two flat
    ``[K, total]`` entries on the root, ``rank1_store_<i>_loc`` / ``_rho``, and no per-layer ``rank1_*`` keys."""
    state = model.state_dict()
    flat = {}
    for group in model.rank1_model.draws.groups:
        names = ("loc", "rho") if group.kind == "factor" else ("loc",)
        for name in names:
            keys = [f"{stem}.{name}" if group.kind == "factor" else stem for stem in group.names]
            if all(k in state for k in keys):
                flat[f"rank1_store_{group.key}_{name}"] = torch.cat([state.pop(k) for k in keys], 1)
    return {**state, **flat}


def _perturb(model: nn.Module) -> None:
    # rank-1 values away from their initialisation, so "kept" and "reset" differ
    with torch.no_grad():
        for p in bayesify.rank1_parameters(model):
            p.add_(torch.randn_like(p))


@pytest.mark.parametrize(
    "make", [lambda: SequenceModel().double(), lambda: timm.create_model("resnet18", num_classes=5)]
)
def test_unconverted_checkpoint_loads_strictly_and_keeps_the_rank1_values(make) -> None:
    torch.manual_seed(0)
    pretrained_state = make().state_dict()
    model = bayesify.convert(make(), init="preserve", task="classification")
    _perturb(model)
    rank1_before = _rank1_entries(model)

    result = model.load_state_dict(pretrained_state, strict=True)

    assert result.missing_keys == [] and result.unexpected_keys == []
    after = model.state_dict()
    for key, value in pretrained_state.items():
        assert torch.equal(after[key], value), key
    for key, value in rank1_before.items():
        assert torch.equal(after[key], value), key
    own = {n for n, _ in model.named_parameters() if "rank1_" in n}
    assert set(rank1_before) == own  # every table is its layer's own, and all of it was kept


def test_the_loaded_function_is_the_pretrained_one() -> None:
    torch.manual_seed(0)
    pretrained = SequenceModel().double()
    model = bayesify.convert(SequenceModel().double(), init="preserve", task="classification")
    model.load_state_dict(pretrained.state_dict())
    x = torch.randn(5, 6, 4, dtype=torch.float64)
    with bayesify.mode(model, route="tile", noise=False):
        members = model(x).view(4, 5, 3)
    for k in range(4):
        torch.testing.assert_close(members[k], pretrained(x))


def test_a_converted_checkpoint_still_replaces_the_rank1_values() -> None:
    torch.manual_seed(0)
    source = bayesify.convert(SequenceModel().double(), task="classification")
    _perturb(source)
    target = bayesify.convert(SequenceModel().double(), task="classification")
    target.load_state_dict(source.state_dict(), strict=True)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def test_a_missing_rank1_key_is_reported_missing() -> None:
    model = bayesify.convert(SequenceModel().double(), task="classification")
    state = model.state_dict()
    rho = "head.rank1_r.rho"
    del state[rho]
    with pytest.raises(RuntimeError, match="Missing key") as error:
        model.load_state_dict(state, strict=True)
    assert f'"{rho}"' in str(error.value)
    assert model.load_state_dict(state, strict=False).missing_keys == [rho]


@pytest.mark.parametrize(
    "make", [lambda: SequenceModel().double(), lambda: timm.create_model("resnet18", num_classes=5)]
)
def test_a_checkpoint_of_release_0_3_loads_strictly_onto_the_layers(make) -> None:
    torch.manual_seed(0)
    source = bayesify.convert(make(), task="classification")
    _perturb(source)
    legacy = release_0_3_state_dict(source)
    assert any(k.startswith("rank1_store_") for k in legacy) and not any(k.endswith("rank1_s.loc") for k in legacy)
    target = bayesify.convert(make(), task="classification")
    result = target.load_state_dict(legacy, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def test_rank1_keys_missing_from_a_checkpoint_are_reported_by_name() -> None:
    model = bayesify.convert(SequenceModel().double(), task="classification")
    legacy = model.state_dict()  # release 0.2's keys: the same
    del legacy["head.rank1_r.rho"], legacy["attn.rank1_bias_out"]
    with pytest.raises(RuntimeError, match="Missing key") as error:
        model.load_state_dict(legacy, strict=True)
    assert '"head.rank1_r.rho"' in str(error.value) and '"attn.rank1_bias_out"' in str(error.value)
    result = model.load_state_dict(legacy, strict=False)
    assert sorted(result.missing_keys) == ["attn.rank1_bias_out", "head.rank1_r.rho"]


@pytest.mark.parametrize("legacy", [False, True])
def test_a_checkpoint_of_another_k_is_refused_in_one_line_naming_both(legacy: bool) -> None:
    saved = bayesify.convert(timm.create_model("resnet18", num_classes=5), components=2, task="classification")
    state = release_0_3_state_dict(saved) if legacy else saved.state_dict()
    model = bayesify.convert(timm.create_model("resnet18", num_classes=5), components=4, task="classification")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as error:
        model.load_state_dict(state)
    message = str(error.value)
    assert "components=2" in message and "components=4" in message and "bayesify.convert(model, components=2)" in message
    assert "size mismatch" not in message and "Missing key" not in message and "\n" not in message, message
    for key, value in before.items():  # nothing was loaded: the weights neither
        assert torch.equal(model.state_dict()[key], value), key
    assert "load_state_dict(..., strict=False) into an unconverted copy" in message
    plain = timm.create_model("resnet18", num_classes=5)  # the hint works: the shared weights, the factors left out
    plain.load_state_dict(state, strict=False)
    assert torch.equal(plain.layer1[0].conv1.weight, saved.layer1[0].conv1.weight)


def test_original_keys_stay_strict() -> None:
    plain_state = SequenceModel().double().state_dict()
    model = bayesify.convert(SequenceModel().double(), task="classification")
    missing = {k: v for k, v in plain_state.items() if k != "head.weight"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head.weight"\.'):
        model.load_state_dict(missing)
    extra = {**plain_state, "head.scale": torch.ones(3)}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "head.scale"'):
        model.load_state_dict(extra)


def test_the_callers_state_dict_is_not_changed() -> None:
    state = SequenceModel().double().state_dict()
    keys = list(state)
    bayesify.convert(SequenceModel().double(), task="classification").load_state_dict(state)
    assert list(state) == keys


def test_assign_keeps_the_rank1_parameter_objects() -> None:
    model = bayesify.convert(SequenceModel().double(), task="classification")
    store = [p for n, p in model.named_parameters() if "rank1_" in n]
    model.load_state_dict(SequenceModel().double().state_dict(), assign=True)
    after = [p for n, p in model.named_parameters() if "rank1_" in n]
    assert all(a is b and a.requires_grad for a, b in zip(after, store)) and len(after) == len(store)


def test_the_hook_survives_copies_and_goes_with_revert() -> None:
    state = SequenceModel().double().state_dict()
    model = bayesify.convert(SequenceModel().double(), task="classification")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    for copied in (
        copy.deepcopy(model),
        pickle.loads(pickle.dumps(model)),
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=False),
    ):
        assert copied.load_state_dict(state).missing_keys == []

    bayesify.revert(model)
    assert all(not m._load_state_dict_pre_hooks for m in model.modules())
    converted_state = bayesify.convert(SequenceModel().double(), task="classification").state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        model.load_state_dict(converted_state)  # a plain model again: rank-1 keys are foreign


def test_gaussian_embeddings_follow_the_same_rule() -> None:
    plain = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)).double()
    model = bayesify.convert(copy.deepcopy(plain), embeddings=True, task="classification")
    rho = model[0].rank1_rho.detach().clone()
    model.load_state_dict(plain.state_dict(), strict=True)
    assert torch.equal(model[0].rank1_rho, rho)
