"""Models by name, adapted to the data's channels and classes."""

import sys
import textwrap

import pytest
import torch

from bayesify.zoo.models import RepeatChannels, create_model


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet18", "timm:resnet18", "torchvision:resnet18"])
def test_gray_8x8_images_with_10_classes(name):
    net = create_model(name, in_channels=1, num_classes=10, input_shape=(1, 8, 8))
    assert net.eval()(torch.rand(2, 1, 8, 8)).shape == (2, 10)


def test_timm_builds_its_stem_for_the_channels_and_torchvision_repeats_gray():
    timm_net = create_model("resnet18", in_channels=1, num_classes=3)
    assert timm_net.conv1.in_channels == 1
    tv_net = create_model("torchvision:resnet18", in_channels=1, num_classes=3)
    assert isinstance(tv_net[0], RepeatChannels) and tv_net[1].conv1.in_channels == 3
    with pytest.raises(ValueError, match="use the timm model"):
        create_model("torchvision:resnet18", in_channels=2, num_classes=3)


def test_signals_and_tables():
    assert create_model("cnn1d", in_channels=1, num_classes=10, input_shape=(1, 40), kind="signal")(
        torch.rand(2, 1, 40)
    ).shape == (2, 10)
    assert create_model("mlp", in_channels=30, num_classes=2, input_shape=(30,), kind="tabular")(
        torch.rand(2, 30)
    ).shape == (2, 2)


def test_module_factory(tmp_path, monkeypatch):
    (tmp_path / "mynets.py").write_text(textwrap.dedent(
        """
        import torch
        def tiny(num_classes, in_channels=3):
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes))
        """
    ))  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    net = create_model("mynets:tiny", in_channels=1, num_classes=4)
    assert net(torch.rand(2, 1, 8, 8)).shape == (2, 4)
    sys.modules.pop("mynets", None)


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("resnet1888", {}, "model='resnet1888' is not a built-in .* 'package.module:factory'"),
        ("resnet18", {"kind": "signal", "input_shape": (1, 40)}, "2-d image model but the data is signal data"),
        ("no_such_module_xyz:f", {}, "cannot import module 'no_such_module_xyz'"),
        ("bayesify.zoo.models:nothing", {}, "has no callable 'nothing'"),
        ("cnn", {"input_shape": (1, 40)}, "takes \\[C, H, W\\] images"),
    ],
)
def test_errors_name_the_value_and_the_fix(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_model(name, in_channels=1, num_classes=10, **kwargs)


@pytest.mark.parametrize("name", ["cnn", "bayesify.zoo.models:_mlp"])
def test_pretrained_without_published_weights_names_weights_file(name):
    with pytest.raises(ValueError, match=r"has no published pretrained weights .* --weights FILE"):
        create_model(name, in_channels=1, num_classes=10, input_shape=(1, 8, 8), pretrained=True)


def test_pretrained_offline_is_one_error_naming_weights_file(monkeypatch):
    # what huggingface_hub raises with no network and no cache (reproduced offline: 70 s of retries, then this)
    import timm
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError(
            "An error happened while trying to locate the file on the Hub and we cannot find the requested files in "
            "the local cache.\nPlease check your connection."
        )

    monkeypatch.setattr(timm, "create_model", offline)
    with pytest.raises(ValueError) as error:
        create_model("resnet18", in_channels=1, num_classes=10, pretrained=True)
    message = str(error.value)
    assert "\n" not in message and error.value.__cause__ is None and error.value.__suppress_context__
    assert message.startswith("model='resnet18': could not get its pretrained weights (LocalEntryNotFoundError: An ")
    assert "offline, pass --weights FILE" in message
    # what to save: the published weights with the data's channels (not its classes: a random head saved at 10 classes
    # would load as a trained one, and an --adapter run would freeze it)
    assert message.endswith("torch.save(timm.create_model('resnet18', pretrained=True, in_chans=1).state_dict(), FILE).")


def test_an_os_error_without_pretrained_is_not_reworded(monkeypatch):
    import timm

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(timm, "create_model", broken)
    with pytest.raises(OSError, match="disk full"):
        create_model("resnet18", in_channels=1, num_classes=10)


def test_torchvision_pretrained_with_other_classes_names_the_timm_model():
    with pytest.raises(ValueError, match=r"pretrained 'resnet18' has 1000 classes, the data 10; use the timm model"):
        create_model("torchvision:resnet18", in_channels=3, num_classes=10, pretrained=True)
