"""A run's model: start weights from a file, the adapter, and rebuilding from a checkpoint without the file."""

from __future__ import annotations

import json

import pytest
import torch

import bayesify
from bayesify.training import TrainConfig, Trainer, build_model, load_run, restore_model
from bayesify.training.run import new_run_config
from bayesify.zoo.models import create_model


@pytest.fixture
def weights_file(tmp_path, digits):
    torch.manual_seed(123)
    plain = create_model("mlp", in_channels=1, num_classes=10, input_shape=digits.input_shape)
    path = tmp_path / "mlp.pt"
    torch.save(plain.state_dict(), path)
    return path, plain.double()


def _config(tmp_path, **values) -> TrainConfig:
    return new_run_config({"model": "mlp", "data": "digits", "out": str(tmp_path / "run"), "progress": False, **values})


def test_weights_load_before_conversion_and_the_function_is_kept(tmp_path, digits, weights_file):
    path, plain = weights_file
    config = _config(tmp_path, weights=str(path))
    assert config.init == "preserve"  # as with --pretrained: the start network's function is kept
    model = build_model(config, digits).double()
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    x = torch.randn(5, *digits.input_shape, dtype=torch.float64)
    with bayesify.mode(model, route="tile", noise=False):
        members = model(x).view(4, 5, 10)
    for k in range(4):
        torch.testing.assert_close(members[k], plain(x))


def test_an_adapter_run_trains_the_rank1_parameters_only_and_logs_the_base_lr(tmp_path, digits, weights_file):
    path, _ = weights_file
    config = _config(tmp_path, weights=str(path), adapter=True, max_steps=4, log_every=2, batch_size=32,
                     fast_weight_lr_multiplier=3.0, lr=0.01)  # fmt: skip
    config.validate()
    model = build_model(config, digits)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in bayesify.rank1_parameters(model)}
    start = {k: v.clone() for k, v in model.state_dict().items()}
    Trainer(config, model, digits).run()
    after = model.state_dict()
    frozen = [k for k in after if "rank1_" not in k and "running_" not in k and "num_batches" not in k]
    assert frozen and all(torch.equal(after[k], start[k]) for k in frozen)
    assert any(not torch.equal(after[k], start[k]) for k in after if "rank1_" in k)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if r["kind"] == "train"] == [0.01, 0.01]  # not the factors' 0.03


def test_a_run_is_rebuilt_from_its_checkpoint_without_the_weights_file(tmp_path, digits, weights_file):
    path, _ = weights_file
    config = _config(tmp_path, weights=str(path), adapter=True, max_steps=2)
    model = build_model(config, digits)
    Trainer(config, model, digits).run()
    path.unlink()  # the file may be gone by evaluation time: the checkpoint holds every weight
    saved_config, state = load_run(tmp_path / "run")
    assert saved_config.weights == str(path) and saved_config.adapter
    restored = restore_model(saved_config, state, digits)
    for name, value in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], value), name


@pytest.mark.parametrize(
    "values, match",
    [
        ({"adapter": True}, "--adapter freezes the network's own weights, which here are random"),
        ({"adapter": True, "deterministic": True, "weights": "w.pt"}, "--deterministic does not add"),
        ({"pretrained": True, "weights": "w.pt"}, "pass --pretrained or --weights w.pt, not both"),
    ],
)
def test_inconsistent_start_settings_name_the_fix(tmp_path, values, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **values).validate()


def test_an_adapter_from_pretrained_weights_of_other_classes_trains_its_new_head(tmp_path, digits, monkeypatch):
    # --pretrained --adapter: timm builds a random head for the data's classes, and freeze_base froze it (its classes
    # stayed at chance, silently); the head the weights carried (--weights FILE) stays frozen
    import timm

    torch.manual_seed(0)
    published = tmp_path / "published.pth"  # what timm's hub would give: the weights of 1000 classes
    torch.save(timm.create_model("test_resnet", num_classes=1000).state_dict(), published)
    create = timm.create_model

    def from_the_file(name, pretrained=False, **kwargs):
        if pretrained:
            kwargs["pretrained_cfg_overlay"] = {"file": str(published)}
        return create(name, pretrained=pretrained, **kwargs)

    monkeypatch.setattr(timm, "create_model", from_the_file)
    model = build_model(_config(tmp_path, model="test_resnet", pretrained=True, adapter=True), digits)
    head = model.get_classifier()
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert trained == {id(p) for p in bayesify.rank1_parameters(model)} | {id(p) for p in head.parameters()}
    torch.save({k: v for k, v in create("test_resnet", num_classes=10, in_chans=1).state_dict().items()}, tmp_path / "w.pt")
    model = build_model(_config(tmp_path, model="test_resnet", weights=str(tmp_path / "w.pt"), adapter=True), digits)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in bayesify.rank1_parameters(model)}


def test_weights_published_for_other_classes_start_a_timm_run_with_a_new_head_that_trains(tmp_path, digits):
    # what the offline hint says to save: timm.create_model(name, pretrained=True, in_chans=C), its published head
    import timm

    torch.manual_seed(0)
    published = timm.create_model("test_resnet", num_classes=1000, in_chans=1)
    torch.save(published.state_dict(), tmp_path / "w.pt")
    model = build_model(_config(tmp_path, model="test_resnet", weights=str(tmp_path / "w.pt"), adapter=True), digits)
    head = model.get_classifier()
    assert head.out_features == 10
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert trained == {id(p) for p in bayesify.rank1_parameters(model)} | {id(p) for p in head.parameters()}
    for name, value in published.state_dict().items():
        if not name.startswith("fc."):
            assert torch.equal(model.state_dict()[name], value), name


def test_a_torchvision_state_dict_loads_into_its_gray_image_wrapper(tmp_path, digits):
    # gray images put a torchvision net behind RepeatChannels (its keys "1."-prefixed): a plain state_dict was refused
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=10)
    torch.save(net.state_dict(), tmp_path / "tv.pt")
    model = build_model(_config(tmp_path, model="torchvision:resnet18", weights=str(tmp_path / "tv.pt")), digits)
    for name, value in net.state_dict().items():
        assert torch.equal(model.state_dict()[f"1.{name}"], value), name
