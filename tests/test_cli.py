"""The ``bayesify`` command line: train / evaluate end to end, presets, and user errors."""

import json
import subprocess
import sys

import pytest

import bayesify
from bayesify import cli
from bayesify.training import load_checkpoint

FAST = ["--model", "mlp", "--data", "digits", "--batch-size", "64", "--no-progress"]


def _train(tmp_path, *extra: str, name: str = "run") -> int:
    return cli.main(["train", *FAST, "--out", str(tmp_path / name), *extra])


def test_train_then_evaluate_with_corruptions_writes_the_report(tmp_path, capsys):
    assert _train(tmp_path, "--epochs", "1", "--max-steps", "3", "--route", "tile") == 0
    run = tmp_path / "run"
    assert (run / "checkpoint.pt").is_file() and (run / "metrics.jsonl").is_file()
    capsys.readouterr()
    code = cli.main(["evaluate", "--out", str(run), "--corruptions", "gaussian_noise,contrast", "--severities", "1,5",
                     "--max-examples", "64", "--samples", "2", "--no-progress"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "| NLL | accuracy | ECE | Brier | cNLL | cA | cECE |" in printed and "## Members" in printed
    for png in ("reliability.png", "corruptions.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((run / "evaluation.json").read_text())
    assert report["clean"]["components"] == 4 and report["clean"]["samples"] == 2
    assert set(report["corrupted"]["results"]) == {"gaussian_noise", "contrast"}
    assert set(report["corrupted"]["by_severity"]) == {"1", "5"}
    assert (run / "report.md").read_text().startswith("# mlp on digits")


def test_resume_continues_with_the_saved_settings(tmp_path):
    assert _train(tmp_path, "--epochs", "1", "--lr", "0.002") == 0
    first = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert cli.main(["train", "--out", str(tmp_path / "run"), "--resume", "--epochs", "2", "--no-progress"]) == 0
    second = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert second["step"] == 2 * first["step"] and second["epoch"] == 2
    assert second["config"]["lr"] == 0.002 and second["config"]["model"] == "mlp"


def test_preset_fills_the_paper_recipe_scaled_to_epochs_and_batch():
    args = cli._parser().parse_args(
        ["train", "--model", "cnn", "--data", "digits", "--out", "/nonexistent/x", "--preset", "cifar10",
         "--epochs", "2", "--batch-size", "64", "--l2", "0"]
    )  # fmt: skip
    config = cli._train_config(args)
    assert config.optimizer == "sgd" and config.nesterov and config.momentum == 0.9
    assert config.lr == pytest.approx(0.05)  # 0.1 x 64 / 128
    assert config.decay_epochs == (0.8, 1.6, 1.8) and config.decay_ratio == 0.2 and config.warmup_epochs == 1
    assert config.kl_annealing_epochs == pytest.approx(1.6) and config.route == "tile" and config.components == 4
    assert config.prior_std == 0.1 and config.l2 == 0  # explicit flags win over the preset
    imagenet = cli._train_config(
        cli._parser().parse_args(
            ["train", "--model", "resnet50", "--data", "digits", "--out", "/nonexistent/y", "--preset", "imagenet"]
        )
    )
    assert imagenet.lr == pytest.approx(0.1) and imagenet.prior_std == 0.05 and not imagenet.l2_norm_layers
    assert imagenet.decay_epochs == (45.0, 90.0, 120.0) and imagenet.init_sign_p == 0.75


def test_defaults_are_convert_s_and_pretrained_preserves_the_network():
    parse = cli._parser().parse_args
    plain = cli._train_config(parse(["train", "--model", "cnn", "--data", "digits", "--out", "/nonexistent/a"]))
    # the trainer converts with convert()'s own defaults: means at the identity, the posterior at the prior
    assert (plain.init, plain.prior_std, plain.init_std, plain.route, plain.components) == ("preserve", None, None, "sample", 4)
    assert plain.rank1 == bayesify.Rank1Config(task=plain.task)
    pretrained = cli._train_config(
        parse(["train", "--model", "resnet18", "--data", "digits", "--out", "/nonexistent/b", "--pretrained"])
    )
    assert pretrained.init == "preserve"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--model", "resnet1888", "--data", "digits"], "model='resnet1888' is not a built-in"),
        (["train", "--model", "mlp", "--data", "svhn"], "data='svhn' is not a known data set"),
        (["train", "--model", "mlp", "--data", "fashion-mnist"], "needs --data-dir DIR"),
        (["train", "--model", "resnet18", "--data", "mnist1d"], "2-d image model but the data is signal data"),
        (["train", "--model", "mlp", "--data", "digits", "--batch-size", "5000"], "--batch-size 1257 or less"),
        (["train", "--model", "mlp"], "train needs --data"),
        (["train", "--model", "mlp", "--data", "digits", "--resume"], "no checkpoint at"),
        (["evaluate"], "no checkpoint at"),
        (["train", "--model", "mlp", "--data", "digits", "--weights", "/nonexistent/w.pt"], "w.pt: no such file"),
        (["train", "--model", "mlp", "--data", "digits", "--adapter"], "--pretrained or --weights FILE"),
        (["train", "--model", "cnn", "--data", "digits", "--pretrained"], "no published pretrained weights"),
    ],
)
def test_user_errors_exit_2_with_one_line_naming_the_fix(tmp_path, capsys, argv, message):
    code = cli.main([*argv, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_nothing_saved_is_lost_by_a_second_train_or_a_corrupt_checkpoint(tmp_path, capsys):
    assert _train(tmp_path, "--max-steps", "2", "--epochs", "1") == 0
    path = tmp_path / "run" / "checkpoint.pt"
    saved = path.read_bytes()
    assert _train(tmp_path, "--max-steps", "2") == 2
    assert "already holds a checkpoint; pass --resume" in capsys.readouterr().err
    assert path.read_bytes() == saved
    path.write_bytes(saved[: len(saved) // 2])  # a torn file, e.g. from a copy that was cut short
    torn = path.read_bytes()
    for argv in (["evaluate", "--out", str(tmp_path / "run")], ["train", "--out", str(tmp_path / "run"), "--resume"]):
        assert cli.main(argv) == 2
        assert "is corrupt or unreadable" in capsys.readouterr().err
        assert path.read_bytes() == torn


def test_corruptions_need_images_and_resume_keeps_the_model(tmp_path, capsys):
    assert cli.main(["train", "--model", "mlp", "--data", "breast-cancer", "--max-steps", "2", "--out",
                     str(tmp_path / "bc"), "--no-progress"]) == 0  # fmt: skip
    assert cli.main(["evaluate", "--out", str(tmp_path / "bc"), "--corruptions"]) == 2
    assert "--corruptions applies to image data" in capsys.readouterr().err
    assert cli.main(["train", "--out", str(tmp_path / "bc"), "--resume", "--model", "cnn"]) == 2
    assert "--model cnn differs from the run" in capsys.readouterr().err
    # a conversion option the checkpoint's model was made with: changed at resume it would read the same weights as
    # another model (additive factors: NLL 0.19 -> 3.6), so it is refused in one line, as --model is
    assert cli.main(["train", "--model", "mlp", "--data", "breast-cancer", "--epochs", "2", "--out", str(tmp_path / "two"),
                     "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    assert cli.main(["train", "--out", str(tmp_path / "two"), "--resume", "--epochs", "1"]) == 2
    assert "--epochs 1 is not more than the 2 epochs the run" in capsys.readouterr().err
    assert cli.main(["train", "--out", str(tmp_path / "two"), "--resume", "--epochs", "2"]) == 2  # (it trained nothing)
    assert "--epochs 2 is not more than the 2 epochs the run" in capsys.readouterr().err
    # so is a --max-steps the run has reached (it trained nothing and logged the same evaluation again)
    assert cli.main(["train", "--out", str(tmp_path / "bc"), "--resume", "--max-steps", "2"]) == 2
    assert "--max-steps 2 is not more than the 2 steps the run" in capsys.readouterr().err
    assert cli.main(["train", "--out", str(tmp_path / "bc"), "--resume", "--max-steps", "3", "--no-progress"]) == 0
    for flag in (["--perturbation", "additive"], ["--prior", "cauchy"], ["--components", "2"], ["--deterministic"]):
        assert cli.main(["train", "--out", str(tmp_path / "bc"), "--resume", *flag]) == 2
        assert f"{flag[0]} " in (err := capsys.readouterr().err) and "differs from the run" in err, err
    # the optimizer and schedule go on from the checkpoint: a new --lr was logged and not used, another --optimizer
    # failed in torch's step (KeyError 'momentum'), another --batch-size reused the place in the epoch
    for flag in (["--lr", "0.05"], ["--optimizer", "sgd"], ["--batch-size", "8"], ["--decay-epochs", "1"]):
        assert cli.main(["train", "--out", str(tmp_path / "bc"), "--resume", *flag]) == 2
        assert "differs from the run" in (err := capsys.readouterr().err) and "go on from the checkpoint" in err, err
    assert cli.main(["train", "--model", "mlp", "--data", "breast-cancer", "--decay-epochs", "2,1", "--out",
                     str(tmp_path / "order")]) == 2  # fmt: skip
    assert "must be in increasing order" in capsys.readouterr().err
    assert cli.main(["evaluate", "--out", str(tmp_path / "bc")]) == 0
    assert "AUC-PR" in capsys.readouterr().out


def test_python_dash_m_reports_user_errors_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bayesify", "evaluate", "--out", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("bayesify evaluate: error: no checkpoint at") and "Traceback" not in result.stderr


def test_evaluate_with_a_baseline_draws_both_runs(tmp_path, capsys):
    assert _train(tmp_path, "--max-steps", "2", "--epochs", "1", "--components", "2") == 0
    assert _train(tmp_path, "--max-steps", "2", "--epochs", "1", "--deterministic", name="det") == 0
    capsys.readouterr()
    code = cli.main(["evaluate", "--out", str(tmp_path / "run"), "--baseline", str(tmp_path / "det"),
                     "--corruptions", "contrast", "--severities", "2", "--max-examples", "32", "--no-progress"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "| deterministic (det) |" in printed and "| rank-1 K=2 (run) |" in printed
    report = json.loads((tmp_path / "run" / "evaluation.json").read_text())
    assert report["baseline"]["config"]["deterministic"] is True and report["config"]["components"] == 2
    assert (tmp_path / "run" / "corruptions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pretrained_offline_ends_in_one_line_naming_weights_file(tmp_path, capsys, monkeypatch):
    import timm
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):  # what timm raises here after huggingface_hub's retries (no network, no cache)
        raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub.\nCheck it.")

    monkeypatch.setattr(timm, "create_model", offline)
    code = cli.main(["train", "--model", "resnet18", "--data", "digits", "--pretrained", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "could not get its pretrained weights (LocalEntryNotFoundError" in err and "pass --weights FILE" in err


def test_weights_file_with_the_adapter_trains_resumes_and_refuses_other_groups(tmp_path, capsys):
    import torch

    from bayesify.zoo.models import create_model

    plain = create_model("mlp", in_channels=1, num_classes=10, input_shape=(1, 8, 8))
    torch.save(plain.state_dict(), tmp_path / "w.pt")
    assert _train(tmp_path, "--weights", str(tmp_path / "w.pt"), "--adapter", "--max-steps", "2") == 0
    config = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["config"]
    assert config["adapter"] and config["init"] == "preserve"
    run = ["train", "--out", str(tmp_path / "run"), "--resume", "--no-progress"]
    assert cli.main([*run, "--max-steps", "4"]) == 0
    assert cli.main([*run, "--max-steps", "6", "--no-adapter"]) == 2
    err = capsys.readouterr().err  # (the adapter is what the checkpoint's run trained: refused before its optimizer)
    assert "--no-adapter differs from the run" in err and "which trained with --adapter" in err, err


def test_fashion_mnist_from_data_dir_trains_and_evaluates_mnist_as_ood(tmp_path, capsys):
    from tests.zoo.test_data import _tiny_set, _write

    data = tmp_path / "data"
    _write(data / "FashionMNIST" / "raw", _tiny_set(n_train=40, n_test=20, seed=3))
    _write(data / "MNIST" / "raw", _tiny_set(n_train=10, n_test=30, seed=4))
    argv = ["train", "--model", "cnn", "--data", "fashion-mnist", "--data-dir", str(data), "--batch-size", "16",
            "--epochs", "1", "--no-progress", "--out", str(tmp_path / "run")]  # fmt: skip
    assert cli.main(argv) == 0
    capsys.readouterr()
    # the OOD set is read from the run's --data-dir: MNIST test images against Fashion-MNIST test images
    assert cli.main(["evaluate", "--out", str(tmp_path / "run"), "--ood", "mnist", "--no-progress"]) == 0
    report = json.loads((tmp_path / "run" / "evaluation.json").read_text())
    assert report["clean"]["components"] == 4
    ood = report["clean"]["ood"]
    assert set(ood) == {"max_probability", "entropy", "mutual_information"}
    assert all(0.0 <= ood[s]["auroc"] <= 1.0 for s in ood)


def test_a_factory_whose_model_changed_since_the_run_trained_is_named_in_one_line(tmp_path, capsys, monkeypatch):
    """`--model module:factory`, then the file edited (other layers): `evaluate` and `--resume` name the keys that
    differ and the fix, where they ended in load_state_dict's traceback of every key."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # (the edited file must be read again, not its .pyc)
    factory = tmp_path / "edited_net.py"

    def write(*widths: int) -> None:
        layers = ", ".join(f"nn.Linear({a}, {b}), nn.ReLU()" for a, b in zip((64, *widths), widths))
        factory.write_text(
            "from torch import nn\n\n\ndef build(num_classes):\n"
            f"    return nn.Sequential(nn.Flatten(), {layers}, nn.Linear({widths[-1]}, num_classes))\n"
        )
        monkeypatch.delitem(sys.modules, "edited_net", raising=False)

    write(16)
    argv = ["train", "--model", "edited_net:build", "--data", "digits", "--max-steps", "2", "--epochs", "1"]
    assert cli.main([*argv, "--no-progress", "--out", str(tmp_path / "run")]) == 0
    saved = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    write(32, 32)  # the first layer wider, one more layer
    capsys.readouterr()
    for command in (["evaluate", "--out", str(tmp_path / "run")],
                    ["train", "--out", str(tmp_path / "run"), "--resume", "--epochs", "2", "--no-progress"]):  # fmt: skip
        assert cli.main(command) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert "the model that --model edited_net:build builds now does not match the weights in" in err
        assert "not in the checkpoint: '5.weight', '5.bias'" in err  # the new layer
        assert "another shape: '1.weight' ([16, 64] saved, [32, 64] now)" in err  # the wider one
        assert "Put it back as it was to use this run, or train a new run in another --out" in err
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == saved
