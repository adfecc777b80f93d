"""Evaluating a run directory: the report, its configuration section, plots, a baseline, errors."""

import json
from pathlib import Path

import pytest
import torch

from bayesify.zoo.data import DataBundle, InMemoryDataset, load_data
from bayesify.training.evaluate_run import evaluate_run, open_run
from bayesify.training import TrainConfig, Trainer, build_model

FAST = {"corruptions": "contrast,frost", "severities": (1, 3), "max_examples": 24, "batch_size": 16, "min_size": 16}


def _train(directory, data: DataBundle, **overrides) -> str:
    config = TrainConfig(
        model="mlp", data=data.name, epochs=1, max_steps=2, batch_size=32, out=str(directory), progress=False,
        **overrides,
    )  # fmt: skip
    Trainer(config, build_model(config, data), data).run()
    return str(directory)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    """A rank-1 run and a deterministic run on digits, and a run on tabular data."""
    root = tmp_path_factory.mktemp("runs")
    digits = load_data("digits")
    small = DataBundle(
        "digits", InMemoryDataset(digits.train.inputs[:64], digits.train.labels[:64]), digits.test,
        10, digits.input_shape, digits.kind, digits.mean, digits.std,
    )  # fmt: skip
    return {
        "rank1": _train(root / "rank1", small, components=2, eval_samples=2),
        "det": _train(root / "det", small, deterministic=True),
        "tabular": _train(root / "tabular", load_data("breast-cancer")),
    }


def test_a_run_is_evaluated_into_a_report_with_its_configuration(runs):
    results = evaluate_run(runs["rank1"], **FAST)
    files = results["files"]
    assert set(files) == {"report", "evaluation", "reliability", "corruptions"}
    report = Path(files["report"]).read_text()
    assert report.startswith("# mlp on digits, rank-1 K=2 (step 2)")
    assert "## Configuration" in report and "| components | 2 |" in report and "| route | sample |" in report
    assert "- **cNLL**: the NLL averaged over the 2 corruption types x 2 severities" in report
    saved = json.loads(Path(files["evaluation"]).read_text())
    assert saved["config"]["components"] == 2 and saved["clean"]["samples"] == 2
    assert saved["settings"]["test_examples"] == 24 and saved["baseline"] is None
    assert set(saved["corrupted"]["results"]) == {"contrast", "frost"}
    for key in ("reliability", "corruptions"):
        assert Path(files[key]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_baseline_is_evaluated_alike_and_drawn_beside_the_run(runs):
    together = evaluate_run(runs["rank1"], baseline=runs["det"], **FAST)
    alone = evaluate_run(runs["det"], **FAST)
    baseline = together["baseline"]
    assert baseline["label"] == "deterministic (det)" and baseline["config"]["deterministic"] is True
    assert baseline["clean"] == alone["clean"] and baseline["corrupted"] == alone["corrupted"]
    report = Path(together["files"]["report"]).read_text()
    assert "| deterministic (det) |" in report and "| rank-1 K=2 (rank1) |" in report
    assert "| option | deterministic (det) | rank-1 K=2 (rank1) |" in report
    # the baseline converted nothing: its rank-1 options are not shown as if they had applied
    assert "| components | - (not converted) | 2 |" in report and "| prior | - (not converted) |" in report
    for key in ("reliability", "corruptions"):
        assert Path(together["files"][key]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_same_checkpoint_gives_the_same_numbers(runs):
    first = evaluate_run(runs["rank1"], max_examples=24)
    second = evaluate_run(runs["rank1"], max_examples=24)
    assert first["clean"] == second["clean"] and first["corrupted"] is None


def test_open_run_rebuilds_the_trained_model(runs):
    run = open_run(runs["rank1"], device="cpu")
    assert run.step == 2 and run.kind == "rank-1 K=2" and not run.model.training
    saved = torch.load(f"{runs['rank1']}/checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(saved[k], v) for k, v in run.model.state_dict().items())


def test_a_run_is_called_on_its_data_sets_own_inputs(runs):
    """``run(x)`` takes the test set's inputs as they are and normalises them as training did (issue 26: the model
    alone expects normalised inputs, which nothing said)."""
    run = open_run(runs["rank1"], device="cpu")
    x = torch.stack([run.data.test[i][0] for i in range(6)])
    assert run.data.mean is not None  # digits: normalised in training
    with torch.no_grad():
        torch.testing.assert_close(run(x), run.model(run.data.normalize(x)))
        assert not torch.allclose(run(x), run.model(x))
    assert "normalised" in type(run).__doc__ and "run.data.normalize" in type(run).__doc__


def test_bad_requests_name_the_fix(runs, tmp_path):
    with pytest.raises(ValueError, match="--corruptions applies to image data; breast-cancer is tabular"):
        evaluate_run(runs["tabular"], corruptions="fog")
    with pytest.raises(ValueError, match="a baseline must be evaluated on the same test set"):
        evaluate_run(runs["rank1"], baseline=runs["tabular"], max_examples=8)
    with pytest.raises(ValueError, match="samples=0 must be a positive integer"):
        evaluate_run(runs["rank1"], samples=0)
    with pytest.raises(ValueError, match=r"severities=\[7\]: pass one or more integers from 1 to 5"):
        evaluate_run(runs["rank1"], corruptions="fog", severities=(7,))
    with pytest.raises(ValueError, match="no checkpoint at"):
        evaluate_run(tmp_path / "missing")


def test_ood_noise_is_scored_from_the_sampled_predictive_and_explained(runs):
    results = evaluate_run(runs["rank1"], baseline=runs["det"], ood="noise", samples=1, max_examples=24)
    assert results["settings"]["ood_set"].startswith("24 inputs of uniform noise in [0, 1] (seed 0), each 1 x 8 x 8")
    scoring = results["clean"]["ood_scoring"]
    assert (scoring["components"], scoring["samples"], scoring["sampled"]) == (2, 4, True)
    assert results["clean"]["samples"] == 1  # the metrics themselves stay at the posterior means
    notes = results["baseline"]["clean"]["ood_scoring"]["notes"]
    assert notes["mutual_information"].startswith("uninformative: 0 on every example (one member")
    report = Path(results["files"]["report"]).read_text()
    assert "OOD set `noise`: 24 inputs of uniform noise" in report
    assert "- rank-1 K=2 (rank1): scores from K x M = 2 x 4 = 8 members drawn from the posterior" in report


def test_the_configuration_shows_the_prior_std_the_depth_rule_chose(runs):
    from bayesify.inspection import rank1_layers

    run = open_run(runs["rank1"], device="cpu")
    depth = len(list(rank1_layers(run.model)))
    prior_std = min(0.3, 0.4 / depth**0.5)
    report = Path(evaluate_run(runs["rank1"], max_examples=8)["files"]["report"]).read_text()
    assert f"| prior_std | {prior_std:.3g} (unset: min(0.3, 0.4 / sqrt(L)) for L = {depth} rank-1 layers) |" in report
    assert f"| init_std | {prior_std:.3g} (unset: the prior's scale, so the posterior starts at the prior) |" in report


def test_max_examples_caps_an_ood_data_set_as_it_caps_the_test_set(runs):
    # --max-examples 1000 --ood mnist scored 1,000 test images against all 10,000 OOD ones (an AUPR with OOD as
    # positive inflated by the imbalance, and 4 minutes): the OOD data set is cut to the same first N
    results = evaluate_run(runs["rank1"], ood="digits", samples=1, max_examples=24)
    assert results["settings"]["ood_set"] == "the first 24 inputs of the test split of digits (each 1 x 8 x 8)"


def test_ood_noise_for_features_fills_the_box_around_the_test_inputs():
    # standardised features: uniform noise in [0, 1] lies in their bulk (an "OOD" set ranked below chance); each
    # feature is drawn over the span of the test inputs' own instead
    from bayesify.training.evaluate_run import _ood_set

    test = InMemoryDataset(torch.randn(50, 6) * torch.arange(1, 7) - 3, torch.zeros(50, dtype=torch.long))
    ood, said = _ood_set("noise", None, test, None)
    x, noise = test.inputs, torch.stack([ood[i][0] for i in range(len(ood))])
    assert (noise >= x.amin(0)).all() and (noise <= x.amax(0)).all() and noise.shape == x.shape
    assert (noise.amax(0) - noise.amin(0) > 0.8 * (x.amax(0) - x.amin(0))).all()  # the whole span, every feature
    assert said.startswith("50 inputs of uniform noise (seed 0), each feature drawn alone over the span")
