"""``bayesify train`` on a task, an option or a model that does not fit the data: one line naming the value and the
fix, exit status 2 (these ended in a traceback from inside torch or a converted layer, or were ignored)."""

import sys

import pytest
import torch

from bayesify import cli
from bayesify.training import TrainConfig, load_checkpoint
from bayesify.zoo.data import load_data


def _one_line_error(capsys, argv: list[str]) -> str:
    code = cli.main([*argv, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data", "digits", "--task", "gaussian"],
         ("--task gaussian cannot train on digits, whose targets are one of 10 class labels per example: the tasks "
          "that fit are classification (leave --task out")),
        (["--data", "breast-cancer", "--task", "multilabel"],
         ("--task multilabel cannot train on breast-cancer, whose targets are one of 2 class labels per example: the "
          "tasks that fit are classification, binary")),
        (["--data", "digits", "--task", "binary"], "--task binary cannot train on digits"),
        (["--data", "digits", "--task", "members"], "--task members cannot train on digits"),
        (["--data", "diabetes", "--task", "classification"],
         "whose targets are real values (a regression): the tasks that fit are gaussian, regression"),
        (["--data", "diabetes", "--batch-dim", "1"],
         ("--batch-dim 1: the data loader hands the model batch-first inputs ([batch, 10] for diabetes), so the batch "
          "lies at 0; drop --batch-dim")),
        (["--data", "diabetes", "--class-axis", "5"],
         ("--class-axis 5 says where the classes lie in a classification output, but this run's task is gaussian; "
          "drop --class-axis")),
        (["--data", "digits", "--gaussian-variance", "std"], "but this run's task is classification; drop --gaussian-variance"),
    ],
)  # fmt: skip
def test_a_task_or_option_that_does_not_fit_the_data_is_one_line(tmp_path, capsys, flags, message):
    err = _one_line_error(capsys, ["train", "--model", "mlp", *flags, "--epochs", "1", "--out", str(tmp_path / "r")])
    assert message in err, err
    assert not (tmp_path / "r").exists()


def test_a_path_as_data_says_what_data_takes(tmp_path, capsys):
    table = tmp_path / "x.csv"
    table.write_text("a,b\n1,2\n")
    err = _one_line_error(capsys, ["train", "--model", "mlp", "--data", str(table), "--out", str(tmp_path / "r")])
    assert f"--data {table} is a path, not a data set's name; --data takes one of digits, mnist1d," in err
    assert "or folder:PATH (an image tree)" in err and "bayesify.zoo.data.DataBundle" in err
    images = tmp_path / "images"
    images.mkdir()
    err = _one_line_error(capsys, ["train", "--model", "cnn", "--data", str(images), "--out", str(tmp_path / "r")])
    assert f"pass --data folder:{images}" in err


def test_binary_on_a_two_class_set_trains_a_one_logit_head_and_evaluates(tmp_path, capsys):
    run = tmp_path / "bc"
    argv = ["train", "--model", "mlp", "--data", "breast-cancer", "--task", "binary", "--epochs", "1", "--out", str(run)]
    assert cli.main([*argv, "--no-progress"]) == 0, capsys.readouterr().err
    weights = load_checkpoint(run / "checkpoint.pt")["model"]
    assert weights["5.weight"].shape == (1, 128)  # the head: one logit, the log-odds of class 1
    capsys.readouterr()
    assert cli.main(["evaluate", "--out", str(run), "--no-progress"]) == 0
    assert "AUC-PR" in capsys.readouterr().out


def _write_factories(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_nets", raising=False)
    (tmp_path / "user_nets.py").write_text(
        "from torch import nn\n\n"
        "seen = {}\n\n\n"
        "def thirty_wide():  # built for a 30-feature table, takes no arguments\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(30, 16), nn.ReLU(), nn.Linear(16, 10))\n\n\n"
        "def named(num_classes, in_channels, in_chans, input_shape):\n"
        "    seen.update(num_classes=num_classes, in_channels=in_channels, in_chans=in_chans, input_shape=input_shape)\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 8 * 8, num_classes))\n\n\n"
        "def anything(**kwargs):\n"
        "    seen.update(kwargs)\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, kwargs['num_classes']))\n\n\n"
        "def needs_hidden(hidden, num_classes=10):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))\n"
    )


def test_a_factory_that_requires_an_argument_bayesify_cannot_give_is_one_line(tmp_path, capsys, monkeypatch):
    """A factory with a required argument of its own (``def f(hidden, num_classes=10)``) ended in its TypeError's
    traceback."""
    _write_factories(tmp_path, monkeypatch)
    argv = ["train", "--model", "user_nets:needs_hidden", "--data", "digits", "--epochs", "1", "--out", str(tmp_path / "r")]
    err = _one_line_error(capsys, argv)
    assert "the factory requires 'hidden', which bayesify cannot give it; a factory is offered num_classes=10" in err, err


def test_a_user_model_that_fails_on_the_data_names_itself_the_shape_and_the_error(tmp_path, capsys, monkeypatch):
    _write_factories(tmp_path, monkeypatch)
    argv = ["train", "--model", "user_nets:thirty_wide", "--data", "digits", "--epochs", "1", "--out", str(tmp_path / "r")]
    err = _one_line_error(capsys, argv)
    assert "--model user_nets:thirty_wide fails on a batch of digits inputs of shape [2, 1, 8, 8]: RuntimeError: mat1 and mat2 shapes cannot be multiplied" in err, err  # fmt: skip
    assert "a factory is offered num_classes=10, in_channels=1 (or in_chans=1) and input_shape=(1, 8, 8)" in err
    assert "BAYESIFY_DEBUG=1 shows the traceback" in err
    monkeypatch.setenv("BAYESIFY_DEBUG", "1")  # the traceback: the model's own error, chained
    with pytest.raises(ValueError, match="fails on a batch of digits inputs") as raised:
        cli.main(argv)
    assert isinstance(raised.value.__cause__, RuntimeError)
    monkeypatch.delenv("BAYESIFY_DEBUG")
    # a head of the wrong width for the task (the factory ignores num_classes): named, where BCE's message was shown
    argv = ["train", "--model", "user_nets:thirty_wide", "--data", "breast-cancer", "--task", "binary", "--out", str(tmp_path / "r")]
    err = _one_line_error(capsys, argv)
    assert "gives outputs of shape [2, 10] for a batch of 2 breast-cancer inputs, but --task binary on breast-cancer trains 1 output per example" in err  # fmt: skip
    assert not (tmp_path / "r").exists()


def test_the_model_help_says_what_a_factory_is_given(tmp_path, capsys, monkeypatch):
    _write_factories(tmp_path, monkeypatch)
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert ("a factory is called with those of these keyword arguments its signature names (a **kwargs gets the first "
            "two): num_classes (the head's width: the classes, 1 for --task binary on two classes, 2 per target for "
            "--task gaussian), in_channels (the data's channels, a table's features; also as in_chans) and input_shape") in shown  # fmt: skip
    import user_nets

    for name, given in (("named", {"num_classes": 10, "in_channels": 1, "in_chans": 1, "input_shape": (1, 8, 8)}),
                        ("anything", {"num_classes": 10, "in_channels": 1})):  # fmt: skip
        user_nets.seen.clear()
        argv = ["train", "--model", f"user_nets:{name}", "--data", "digits", "--max-steps", "1", "--no-progress"]
        assert cli.main([*argv, "--out", str(tmp_path / name)]) == 0
        assert user_nets.seen == given


def test_a_run_that_trained_with_an_option_ignored_still_evaluates_and_resumes(tmp_path, capsys):
    """--class-axis on a regression was ignored before it was refused: a run trained so (its checkpoint's config holds
    class_axis=5) evaluates and resumes; it cannot drop the option, which is fixed at --resume."""
    from bayesify.training.checkpoint import save_checkpoint

    run = tmp_path / "r"
    argv = ["train", "--model", "mlp", "--data", "diabetes", "--max-steps", "1", "--no-progress", "--out", str(run)]
    assert cli.main(argv) == 0
    state = load_checkpoint(run / "checkpoint.pt")
    save_checkpoint({**state, "config": {**state["config"], "class_axis": 5}}, run / "checkpoint.pt")
    assert cli.main(["evaluate", "--out", str(run)]) == 0, capsys.readouterr().err
    assert cli.main(["train", "--out", str(run), "--resume", "--max-steps", "2", "--no-progress"]) == 0
    assert load_checkpoint(run / "checkpoint.pt")["step"] == 2


def test_the_check_of_the_data_leaves_the_run_s_numbers_alone(tmp_path):
    """The model is called on two examples before conversion (eval mode, no gradients, forked random numbers): the
    weights and the random numbers after it are the ones without the call."""
    from bayesify.training import run

    bundle = load_data("digits")
    config = TrainConfig(model="cnn", data="digits", out=str(tmp_path / "r"))
    checked, after_checked = run.build_model(config, bundle), torch.rand(4)
    run_check = run._check_takes_the_data
    try:
        run._check_takes_the_data = lambda *args: None
        plain, after_plain = run.build_model(config, bundle), torch.rand(4)
    finally:
        run._check_takes_the_data = run_check
    assert checked.training and torch.equal(after_checked, after_plain)
    assert all(torch.equal(a, b) for a, b in zip(checked.state_dict().values(), plain.state_dict().values()))
