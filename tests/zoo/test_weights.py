"""Start weights from a local file (bayesify/zoo/weights.py): formats read, mismatches refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import bayesify
from bayesify.zoo.weights import first_line, load_weights, read_state_dict


def _net(classes: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, classes))


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("form", ["state_dict", "safetensors", "under_state_dict", "under_model", "ddp_prefix"])
def test_every_supported_form_loads_the_same_weights(form: str, tmp_path) -> None:
    source = _net()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    state = source.state_dict()
    path = tmp_path / ("w.safetensors" if form == "safetensors" else "w.pt")
    if form == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        payload = {
            "state_dict": state,
            "under_state_dict": {"state_dict": state, "epoch": 3},
            "under_model": {"model": state, "optimizer": {}},
            "ddp_prefix": {f"module.{k}": v for k, v in state.items()},
        }[form]
        torch.save(payload, path)
    target = _net()
    assert load_weights(target, path) is target
    _assert_same_state(target, source)


def test_mismatched_keys_and_shapes_are_named_and_nothing_is_loaded(tmp_path) -> None:
    state = _net(classes=5).state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["0.bias"]
    torch.save(state, tmp_path / "w.pt")
    target = _net(classes=3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError) as error:
        load_weights(target, tmp_path / "w.pt")
    message = str(error.value)
    assert "does not fit Sequential" in message and "\n" not in message
    assert "1 missing (0.bias)" in message and "1 unexpected (extra.weight)" in message
    assert (
        "2 of another shape (3.weight [5, 8] in the file, [3, 8] in the model, 3.bias [5] in the file, [3]" in message
    )
    assert "same architecture and input channels, and the number of classes" in message
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())


def test_a_long_list_of_keys_is_cut(tmp_path) -> None:
    torch.save({f"w{i}": torch.zeros(1) for i in range(6)}, tmp_path / "w.pt")
    with pytest.raises(ValueError, match=r"6 unexpected \(w0, w1, w2, \.\.\.\)"):
        load_weights(_net(), tmp_path / "w.pt")


def test_files_that_are_not_weights_are_refused_with_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"--weights .*nothere.pt: no such file"):
        read_state_dict(tmp_path / "nothere.pt")
    torch.save(_net(), tmp_path / "whole.pt")  # a pickled model, not a state_dict
    with pytest.raises(
        ValueError, match=r"not a state_dict .*UnpicklingError.*torch.save\(model.state_dict\(\), FILE\)"
    ):
        read_state_dict(tmp_path / "whole.pt")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds a list, not a state_dict of tensors"):
        read_state_dict(tmp_path / "list.pt")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_state_dict(tmp_path / "bad.safetensors")


def test_a_converted_models_weights_point_to_resume(tmp_path) -> None:
    torch.save(bayesify.convert(_net(), task="classification").state_dict(), tmp_path / "converted.pt")
    with pytest.raises(ValueError, match=r"holds rank-1 parameters \(0.rank1_bias.*--resume"):
        read_state_dict(tmp_path / "converted.pt")


def test_first_line_drops_colour_codes_and_cuts() -> None:
    error = RuntimeError("\x1b[1mbold\x1b[0m start " + "x" * 200 + "\nsecond line")
    text = first_line(error, limit=30)
    assert text == "RuntimeError: bold start " + "x" * 16 + "..." and len(text) == len("RuntimeError: ") + 30
