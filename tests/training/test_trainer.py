"""The trainer: routes, precision, metrics.jsonl, checkpoints, exact resume, clear errors."""

import json
import warnings

import pytest
import torch

import bayesify
from bayesify.zoo.data import DataBundle
from bayesify.training import TrainConfig, Trainer, build_model, load_checkpoint


def _config(tmp_path, name="run", **overrides) -> TrainConfig:
    values = dict(
        model="mlp", data="digits", epochs=2, batch_size=32, out=str(tmp_path / name), progress=False, log_every=4
    )
    values.update(overrides)
    return TrainConfig(**values)


def _train(config: TrainConfig, data: DataBundle, callback=None) -> tuple[torch.nn.Module, dict]:
    model = build_model(config, data)
    trainer = Trainer(config, model, data)
    if callback is not None:
        trainer.add_callback("on_batch_end", callback)
    return model, trainer.run()


def test_a_run_writes_metrics_and_a_checkpoint(tmp_path, digits):
    config = _config(tmp_path, route="tile")
    model, results = _train(config, digits)
    assert 0.0 < results["accuracy"] <= 1.0 and results["components"] == 4
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [4, 8, 12, 16, 20]
    assert {"loss", "nll", "kl", "kl_scale", "l2", "lr", "examples_per_s", "steps"} <= set(train[0])
    assert [(r["epoch"], r["step"]) for r in evals] == [(1, 10), (2, 20)]
    # the epochs done, in train lines as in eval lines (a train line said 0 in the first epoch, its eval line 1)
    assert [r["epoch"] for r in train] == [0.4, 0.8, 1.2, 1.6, 2.0]
    state = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert (state["step"], state["epoch"], state["batch"]) == (20, 2, 0)
    assert state["config"]["route"] == "tile"
    for name, value in model.state_dict().items():
        assert torch.equal(state["model"][name], value), name


@pytest.mark.parametrize("interrupt_at, every", [(13, 4), (11, 0)], ids=["mid-epoch", "epoch-end"])
def test_resume_after_an_interruption_is_bitwise_an_uninterrupted_run(tmp_path, digits, interrupt_at, every):
    # sampled route with posterior noise, Adam, warm-up and decay: every RNG stream and state must be restored
    common = dict(route="sample", optimizer="adam", lr=3e-3, warmup_epochs=0.5, decay_epochs=(1.5,), epochs=3,
                  checkpoint_every=every)  # fmt: skip
    reference, _ = _train(_config(tmp_path, "whole", **common), digits)

    def interrupt(trainer):
        if trainer.step == interrupt_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _train(_config(tmp_path, "cut", **common), digits, interrupt)
    saved = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert saved["step"] == (12 if every else 10)
    resumed, _ = _train(_config(tmp_path, "cut", resume=True, **common), digits)

    expected = reference.state_dict()
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, expected[name]), f"{name} differs after resume"
    whole = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    cut = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in cut] == [json.loads(r)["step"] for r in whole]  # no duplicated lines
    # each line says how many steps its means are over: the first after the resume, fewer where it stopped mid-window
    windows = [(r["step"], r["steps"]) for r in map(json.loads, cut) if r["kind"] == "train"]
    previous = 0
    for step, steps in windows:
        start = max(previous, saved["step"]) if step > saved["step"] else previous  # the resumed run counts anew
        assert steps == step - start, windows
        previous = step
    assert any(steps != 4 for _, steps in windows)  # (the run's last line, and the epoch-end resume's first)


def test_an_existing_run_is_never_overwritten(tmp_path, digits):
    config = _config(tmp_path, epochs=1)
    _train(config, digits)
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    with pytest.raises(ValueError, match="already holds a checkpoint.*--resume"):
        _train(config, digits)
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before


def test_batch_norm_with_one_row_per_step_names_the_fix(tmp_path, digits):
    config = _config(tmp_path, model="resnet18", batch_size=1, route="sample")
    with pytest.raises(ValueError, match="batch_size=1 .* at least 2 rows.*--route tile"):
        _train(config, digits)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(route="mixture"), "route='mixture' must be 'sample' or 'tile'"),
        (dict(likelihood="mixture", route="sample"), "--route tile"),
        (dict(precision="fp8"), "precision='fp8'"),
        (dict(batch_size=0), "batch_size=0"),
    ],
)
def test_bad_settings_raise_before_training(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **overrides).validate()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, digits, precision):
    model, results = _train(_config(tmp_path, precision=precision, max_steps=4, route="tile"), digits)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert results["nll"] == results["nll"]  # not NaN


def test_mixture_likelihood_gradient_clipping_and_the_deterministic_baseline(tmp_path, digits):
    _train(_config(tmp_path, "mix", route="tile", likelihood="mixture", grad_clip=1.0, max_steps=4), digits)
    record = json.loads((tmp_path / "mix" / "metrics.jsonl").read_text().splitlines()[0])
    assert "grad_norm" in record
    model, results = _train(_config(tmp_path, "det", deterministic=True, max_steps=4, optimizer="sgd", lr=0.05), digits)
    assert results["components"] == 1 and results["samples"] == 1


def test_torch_compile_path(tmp_path, digits):
    model, results = _train(_config(tmp_path, compile=True, max_steps=2, deterministic=True), digits)
    assert results["accuracy"] >= 0.0


@pytest.mark.parametrize("setting,compiled", [(None, False), (True, True), (False, False)])
def test_the_step_is_compiled_by_default_on_cuda_only(tmp_path, digits, monkeypatch, setting, compiled):
    """``compile=None`` (the default): the step is compiled on CUDA, where fusion pays, and not on the CPU (here);
    ``--compile`` / ``--no-compile`` say so either way."""
    from bayesify.training.config import Strategy
    from bayesify.training.trainer import _compiles_by_default

    assert TrainConfig().compile is None
    assert _compiles_by_default(torch.device("cuda", 0), Strategy.DDP)
    assert not _compiles_by_default(torch.device("cuda", 0), Strategy.FSDP)
    assert not _compiles_by_default(torch.device("cpu"), Strategy.DDP)
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append(model) or model)
    config = _config(tmp_path, compile=setting, max_steps=1)
    _train(config, digits)
    assert bool(calls) is compiled


def test_an_unconverted_model_trains_as_it_is_with_a_warning_unless_said(tmp_path) -> None:
    from bayesify.training import TrainConfig, Trainer
    from bayesify.zoo.data import load_data
    from bayesify.zoo.models import create_model

    bundle = load_data("digits")
    plain = lambda: create_model("mlp", in_channels=1, num_classes=10, input_shape=(1, 8, 8))  # noqa: E731
    config = TrainConfig(model="mlp", data="digits", max_steps=1, out=str(tmp_path / "a"), progress=False)
    with pytest.warns(UserWarning, match=r"Trainer got a .* that is not converted: it trains as it is"):
        Trainer(config, plain(), bundle).run()
    said = TrainConfig(model="mlp", data="digits", max_steps=1, out=str(tmp_path / "b"), progress=False, deterministic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        Trainer(said, plain(), bundle).run()


def test_the_trainer_trains_the_task_the_model_was_converted_with(tmp_path) -> None:
    # a model converted with task="binary" (one logit) and a data bundle left at its default task: the trainer took the
    # bundle's "classification" and failed deep inside cross_entropy; it trains the model's task, and a config that
    # says another one is refused in one line; regression on class labels is refused naming task='classification'
    from bayesify.zoo.data import InMemoryDataset

    torch.manual_seed(0)
    x = torch.randn(120, 5)
    y = (x[:, 0] > 0).float()
    bundle = DataBundle("toy", InMemoryDataset(x[:100], y[:100]), InMemoryDataset(x[100:], y[100:]), 2, (5,), "tabular")

    def binary() -> torch.nn.Module:
        net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1), torch.nn.Flatten(0))
        return bayesify.convert(net, task="binary")

    config = TrainConfig(epochs=1, out=str(tmp_path / "a"), progress=False, data="toy")
    trainer = Trainer(config, binary(), bundle)
    assert str(trainer.task) == "binary"
    trainer.run()
    said = TrainConfig(epochs=1, out=str(tmp_path / "b"), progress=False, data="toy", task="regression")
    with pytest.raises(ValueError, match=r"config says task='regression', but the model was converted with task binary"):
        Trainer(said, binary(), bundle)
    with pytest.raises(ValueError, match=r"targets have shape \(4,\) \(class labels\?\): use task='classification'"):
        bayesify.predictive.Regression().log_likelihood(torch.randn(4, 10), torch.tensor([0, 1, 2, 3]))


def test_a_run_resumed_for_more_epochs_keeps_its_kl_annealing(tmp_path, digits):
    """``--resume --epochs 4`` on a finished 2-epoch run: the KL weight stays at 1 (the run's annealing over 2/3 of
    its 2 epochs, as its learning-rate schedule comes back from the checkpoint), where 2/3 of the new 4 epochs took
    it back to 0.77; a KL annealing this run sets itself is used."""
    _train(_config(tmp_path, log_every=1), digits)
    _train(_config(tmp_path, epochs=4, resume=True, log_every=1), digits)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scales = [r["kl_scale"] for r in records if "kl_scale" in r and r["step"] > 20]
    assert scales and all(s == 1.0 for s in scales), scales
    _train(_config(tmp_path, "other", log_every=1), digits)
    _train(_config(tmp_path, "other", epochs=4, resume=True, kl_annealing_epochs=4.0, log_every=1), digits)
    records = [json.loads(line) for line in (tmp_path / "other" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kl_scale"] for r in records if "kl_scale" in r and r["step"] > 20][0] < 0.7


class _TupleNet(torch.nn.Module):
    """A user's model that returns its logits with its features, as a tuple or a dict."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.as_dict = as_dict
        self.body, self.head = torch.nn.Linear(64, 32), torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> object:
        h = self.body(x.flatten(1)).relu()
        return {"logits": self.head(h), "features": h} if self.as_dict else (self.head(h), h)


@pytest.mark.parametrize("as_dict", [False, True], ids=["tuple", "dict"])
def test_the_trainer_trains_on_a_tuple_or_dict_outputs_logits(tmp_path, digits, as_dict):
    """``bayesify train --model mymodule:factory`` with a model returning ``(logits, features)`` or ``{"logits", ...}``
    ended in ``'tuple' object has no attribute 'shape'``: the objective trains on the primary output, as
    ``evaluate`` scores it, and the run equals one on the logits alone."""
    torch.manual_seed(0)
    model = _TupleNet(as_dict)
    plain = _TupleNet(as_dict)
    plain.load_state_dict(model.state_dict())
    plain.forward = lambda x: _TupleNet.forward(plain, x)["logits" if as_dict else 0]  # the logits alone
    results = []
    for net, name in ((model, "tuple"), (plain, "plain")):
        torch.manual_seed(0)
        bayesify.convert(net, task={"logits" if as_dict else 0: "classification"} if net is model else "classification")
        results.append(Trainer(_config(tmp_path, name, epochs=1), net, digits).run())
    assert results[0]["nll"] == pytest.approx(results[1]["nll"], rel=1e-6)


def test_a_run_max_steps_ends_inside_an_epoch_says_the_fraction_done(tmp_path, digits, capsys):
    # --max-steps 3 of an epoch of 10 steps printed "epoch 0/2 step 3": the test line says how far the run got
    _train(_config(tmp_path, max_steps=3, progress=True), digits)
    line = next(s for s in capsys.readouterr().out.splitlines() if ": test " in s)
    assert line.startswith("epoch 0.30/2 step 3: test "), line


def test_the_kl_warm_up_spans_two_thirds_of_the_steps_a_max_steps_run_takes(tmp_path, digits):
    # --epochs 30 --max-steps 6 annealed over 2/3 of 30 epochs: the KL weight ended at ~0.01 (the MIMIC preset's
    # --epochs 10000 --max-steps 25000 never reached 1); it follows the run's real length, 4 of its 6 steps
    _train(_config(tmp_path, epochs=30, max_steps=6, log_every=1), digits)
    scales = [json.loads(line)["kl_scale"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("kind") == "train"]  # fmt: skip
    assert scales[-1] == 1.0 and scales[2] < 1.0, scales


def test_a_run_max_steps_ends_inside_an_epoch_reports_the_model_it_ends_with(tmp_path, digits):
    # --max-steps 13 with 10 steps an epoch: the results (and the last eval record) were epoch 1's, step 10
    model, results = _train(_config(tmp_path, max_steps=13, epochs=3), digits)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind") == "eval"][-1] == 13
    again = bayesify.evaluation.evaluate(model, digits.test, transform=digits.normalize, members=False)
    assert abs(again["nll"] - results["nll"]) < 1e-4, (again["nll"], results["nll"])
