"""Evaluating converted and plain models, clean and corrupted, and the report files."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesify
from bayesify.uncertainty import classification_uncertainty
from bayesify.zoo.data import InMemoryDataset
from bayesify.evaluation import (
    compare_corruptions,
    evaluate,
    evaluate_corruptions,
    markdown_report,
    predict_members,
    reliability_diagram,
    severity_plot,
)


def _net(convert: bool = True) -> nn.Module:
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))
    return bayesify.convert(net, components=2, task="classification") if convert else net


@pytest.fixture
def images() -> InMemoryDataset:
    return InMemoryDataset(torch.rand(20, 1, 8, 8), torch.randint(3, (20,)))


def test_members_are_k_times_m_component_major(images):
    net = _net()
    log_probs, labels = predict_members(net, torch.utils.data.DataLoader(images, batch_size=8), samples=3)
    assert log_probs.shape == (6, 20, 3) and torch.equal(labels, images.labels)
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(6, 20))


def test_evaluate_converted_and_plain_models(images):
    converted = evaluate(_net(), images, samples=2, batch_size=7)
    assert converted["components"] == 2 and converted["samples"] == 2 and len(converted["members"]) == 2
    plain = evaluate(_net(convert=False), images, task="classification")
    assert plain["components"] == 1 and "members" not in plain
    # evaluation does not disturb the caller's random stream
    net = _net()
    torch.manual_seed(5)
    evaluate(net, images)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), after)


def test_corruption_means_are_averages_over_types_and_severities(images):
    result = evaluate_corruptions(_net(), images, corruptions="contrast,brightness", severities=(1, 5), progress=False)
    rows = [result["results"][c][s] for c in ("contrast", "brightness") for s in (1, 5)]
    assert result["mean"]["nll"] == pytest.approx(sum(r["nll"] for r in rows) / 4)
    assert result["by_severity"][5]["accuracy"] == pytest.approx(
        (result["results"]["contrast"][5]["accuracy"] + result["results"]["brightness"][5]["accuracy"]) / 2
    )


def test_report_files(tmp_path, images):
    clean = evaluate(_net(), images)
    probs = torch.rand(20, 3).softmax(-1)
    assert reliability_diagram(probs, images.labels, tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    by_severity = {s: {"nll": 1.0 * s, "accuracy": 0.9 - 0.1 * s, "ece": 0.01 * s} for s in (1, 2, 3)}
    assert severity_plot(by_severity, tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    text = markdown_report(clean, {"mean": by_severity[2], "by_severity": by_severity, "results": {"fog": by_severity}})
    assert "| NLL | accuracy | ECE | Brier | cNLL | cA | cECE |" in text and "| fog |" in text


def _before_the_speed_up(model, data, corruptions, severities, samples, batch_size, min_size, monkeypatch):
    # the evaluator as it was: corrupt-tta image by image, inside predict_members, seed 0 per set
    from bayesify.evaluation import _corrupt_batch
    from bayesify.evaluation.corruptions import corrupt_images, corruption_seed
    from bayesify.evaluation.metrics import compute_metrics

    monkeypatch.setattr(_corrupt_batch, "fast_corruptions", lambda: {})
    results = {}
    for name in corruptions:
        for severity in severities:

            def corrupt(x, index, name=name, severity=severity):
                seeds = [corruption_seed(0, name, severity, index * batch_size + i) for i in range(len(x))]
                return corrupt_images(x, name, severity, seed=seeds, min_size=min_size)

            with torch.random.fork_rng():
                torch.manual_seed(0)
                loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
                log_probs, labels = predict_members(model, loader, samples=samples, corrupt=corrupt)
            metrics = compute_metrics(log_probs, labels, components=bayesify.num_components(model), members=False)
            results.setdefault(name, {})[severity] = {k: float(metrics[k]) for k in ("nll", "accuracy", "ece")}
    monkeypatch.undo()
    return results


def test_corrupted_results_are_those_of_the_evaluator_before_the_speed_up(images, monkeypatch):
    net, plain = _net(), _net(convert=False)
    names, severities = ("frost", "glass_blur", "zoom_blur", "gaussian_noise"), (1, 5)
    settings = {"severities": severities, "batch_size": 8, "min_size": 16}
    before = _before_the_speed_up(net, images, names, severities, 2, 8, 16, monkeypatch)
    alone = evaluate_corruptions(net, images, corruptions=",".join(names), samples=2, progress=False, **settings)
    assert alone["results"] == before
    # several models on the same corrupted batches: each gets the numbers it gets alone
    plain_alone = evaluate_corruptions(plain, images, corruptions=names, progress=False, **settings)
    together = compare_corruptions([(net, 2), (plain, 1)], images, corruptions=names, progress=False, **settings)
    assert together == [alone, plain_alone]


def test_ood_scores_come_from_the_sampled_predictive(images):
    """At conversion (init="preserve") the K posterior means are the same network: their mutual information is 0
    everywhere and tells nothing. The OOD scores are those of bayesify.uncertainty's K x 4 sampled members."""
    torch.manual_seed(0)
    net = _net()
    ood = InMemoryDataset(3 * torch.rand(20, 1, 8, 8), torch.zeros(20, dtype=torch.long))
    results = evaluate(net, images, ood=ood)  # samples=1: the metrics at the posterior means
    assert results["samples"] == 1
    scoring = results["ood_scoring"]
    assert (scoring["components"], scoring["samples"], scoring["sampled"]) == (2, 4, True)
    assert "mutual_information" not in scoring["notes"]
    assert results["ood"]["mutual_information"]["auroc"] != 0.5  # 0.5 exactly: the means' MI, 0 everywhere

    # point-mass posteriors (BatchEnsemble) at conversion: every member is the network, sampled or not
    ensemble = bayesify.convert(nn.Sequential(nn.Flatten(), nn.Linear(64, 3)), components=2, posterior="delta",
                                task="classification")  # fmt: skip
    notes = evaluate(ensemble, images, ood=ood)["ood_scoring"]["notes"]
    assert notes["mutual_information"] == (
        "uninformative: 0 on every example (the members agree), so its AUROC tells nothing about them"
    )


def test_ood_scores_of_a_plain_model_say_its_mutual_information_is_uninformative(images):
    ood = InMemoryDataset(3 * torch.rand(20, 1, 8, 8), torch.zeros(20, dtype=torch.long))
    results = evaluate(_net(convert=False), images, ood=ood, task="classification")
    assert results["ood_scoring"]["sampled"] is False and results["ood"]["mutual_information"]["auroc"] == 0.5
    assert results["ood_scoring"]["notes"]["mutual_information"] == (
        "uninformative: 0 on every example (one member, none to disagree), so its AUROC tells nothing about them"
    )


def test_segmentation_is_scored_per_pixel_on_its_out_leaving_out_an_ignore_index_when_told():
    """torchvision's FCN returns {"out", "aux"}: evaluate() scores "out" (what bayesify.uncertainty decomposes), every
    labelled pixel an example; a mask's 255 is refused unless ignore_index says what it marks."""
    import math

    from torch.utils.data import TensorDataset
    from torchvision.models.segmentation import fcn_resnet50

    torch.manual_seed(0)
    model = bayesify.convert(fcn_resnet50(weights=None, weights_backbone=None, num_classes=3, aux_loss=True), components=2)
    x, y = torch.randn(3, 3, 16, 16), torch.randint(3, (3, 16, 16))
    y[:, :5] = 255  # (a border the annotators left out)
    data = TensorDataset(x, y)
    with pytest.raises(ValueError, match=r"label 255 is not a class of the 3-class output .* ignore_index=255\)\.$"):
        evaluate(model, data)
    results = evaluate(model, data, ignore_index=255, batch_size=2)
    assert (results["output"], results["task"], results["ignored"]) == ("out", "classification (class axis 1)", 3 * 5 * 16)
    with torch.no_grad():
        members = bayesify.predict(model.eval(), x, noise=False)["out"]  # [K, B, C, H, W]: the posterior means
    log_p = torch.logsumexp(members.log_softmax(2), 0) - math.log(2)  # the mixture, per pixel
    labelled = y != 255
    picked = log_p.gather(1, y.clamp(max=2)[:, None]).squeeze(1)
    assert results["nll"] == pytest.approx(float(-picked[labelled].mean()), rel=1e-5)
    assert results["accuracy"] == pytest.approx(float((log_p.argmax(1) == y)[labelled].float().mean()))
    aux = evaluate(model, data, ignore_index=255, output="aux", members=False)
    assert aux["output"] == "aux" and aux["nll"] != results["nll"]
    # the OOD table scores the test set's labelled pixels only, and an OOD set of images with a dummy label each (no
    # mask) at every pixel. (A delta posterior: the sampled scores are the means', so they can be computed here.)
    from bayesify.evaluation import ood_metrics
    from bayesify.predictive.decompositions import classification_uncertainty

    torch.manual_seed(0)
    fixed = bayesify.convert(fcn_resnet50(weights=None, weights_backbone=None, num_classes=3, aux_loss=True),
                             components=2, posterior="delta", init="normal", init_mean_std=0.3).eval()  # fmt: skip
    images = torch.randn(2, 3, 16, 16)
    table = evaluate(fixed, data, ignore_index=255, ood=TensorDataset(images, torch.zeros(2)), batch_size=2)["ood"]
    with torch.no_grad():
        inside = classification_uncertainty(bayesify.predict(fixed, x)["out"], class_axis=1).predictive_entropy[labelled]
        outside = classification_uncertainty(bayesify.predict(fixed, images)["out"], class_axis=1).predictive_entropy.flatten()
    assert table["entropy"]["auroc"] == pytest.approx(ood_metrics(inside, outside)["auroc"], abs=1e-6)


def test_a_structured_output_without_a_primary_part_is_refused_naming_output():
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 2)

        def forward(self, x):
            return {"first": self.a(x), "second": self.b(x), "features": x, "steps": 3}

    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(10, 4), torch.randint(2, (10,)))
    model = bayesify.convert(TwoHeads(), components=2, task={"first": "classification", "second": "classification"})
    with pytest.raises(ValueError, match=r"cannot tell which part of TwoHeads's output \(a dict with keys 'first', "
                                         r"'second', 'features', 'steps'\) it is about; say it with output=, one of: "
                                         r"'first', 'second', 'features'\.$"):  # fmt: skip
        evaluate(model, data)
    ood = TensorDataset(5 * torch.randn(6, 4), torch.zeros(6, dtype=torch.long))
    second = evaluate(model, data, output="second", ood=ood)
    assert second["output"] == "second" and 0 <= second["accuracy"] <= 1 and "auc_roc" in second  # two classes
    assert set(second["ood"]) == {"max_probability", "entropy", "mutual_information"}  # of the same output
    with pytest.raises(ValueError, match=r"output='third' is not a part of TwoHeads's output .* one of: 'first', "):
        evaluate(model, data, output="third")
    x = data.tensors[0][:5]
    model.eval()
    with pytest.raises(ValueError, match=r"^bayesify.uncertainty cannot tell which part of TwoHeads's output .* output=, one of"):
        bayesify.uncertainty(model, x)
    torch.manual_seed(1)
    u = bayesify.uncertainty(model, x, output="second", samples=2)
    torch.manual_seed(1)
    members = bayesify.predict(model, x, samples=2)["second"]
    torch.testing.assert_close(u.mutual_information, classification_uncertainty(members).mutual_information)
    assert u.probs.shape == (5, 2)
    with pytest.raises(ValueError, match=r"output='third' is not a part of TwoHeads's output"):
        bayesify.uncertainty(model, x, output="third")
    with pytest.raises(ValueError, match=r"output='steps' is not a tensor of predictions \(int\)"):
        evaluate(model, data, output="steps")
    with pytest.raises(ValueError, match=r"names no task for the output 'features'"):  # at the first batch
        evaluate(model, data, output="features")
    with pytest.raises(ValueError, match=r"ignore_index=0.5 must be the integer label"):
        evaluate(model, data, output="second", ignore_index=0.5)
    plain = evaluate(TwoHeads(), data, output="first", task="classification")  # a plain model: the same choice
    assert plain["output"] == "first" and plain["components"] == 1


def test_a_language_model_is_scored_as_its_own_loss_scores_it():
    """GPT-2's logits at t predict the token at t + 1: evaluate() shifts its labels as the model's loss does, so its
    NLL is the mixture's per-token loss (the converted model's own in model.eval())."""
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)  # fmt: skip
    model = bayesify.convert(transformers.GPT2LMHeadModel(config), components=2, init="normal")
    ids = torch.randint(30, (6, 10))
    results = evaluate(model, TensorDataset(ids, ids), batch_size=4)
    assert results["output"] == "logits" and results["task"] == "classification (class axis -1)"
    with torch.no_grad():
        loss = model.eval()(ids, labels=ids).loss  # the mixture's NLL of each next token
    assert results["nll"] == pytest.approx(float(loss), rel=1e-5)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel predicts the next token: .* of shape \(4, 10\) .* got \(4,\)"):
        evaluate(model, TensorDataset(ids, ids[:, 0]), batch_size=4)


def test_unbatched_examples_are_evaluated_as_batches_of_one(images):
    """A DataLoader with batch_size=None gives one example and a 0-d label at a time: each is a batch of one (the
    converted model took the example's first dimension as a batch of K*B rows, and torch's shape error followed)."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    mlp = bayesify.convert(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), components=2, task="classification")
    tables = TensorDataset(torch.randn(12, 5), torch.randint(3, (12,)))  # 1-d examples: [features]
    for net, data in ((mlp, tables), (_net(), images)):
        batched = evaluate(net, data, members=False)
        one_by_one = evaluate(net, DataLoader(data, batch_size=None), members=False)
        assert one_by_one.keys() == batched.keys()
        for key in ("nll", "accuracy", "ece", "brier"):
            assert one_by_one[key] == pytest.approx(batched[key], rel=1e-5, abs=1e-7), key


def test_the_corruption_benchmark_refuses_what_is_not_a_classifier_naming_evaluate() -> None:
    # it scores [B, C] class logits: a regression ended in a label-shape error, a segmentation model in an
    # AttributeError on its dict output
    import torchvision
    from torch.utils.data import TensorDataset

    from bayesify.evaluation import evaluate_corruptions

    regression = bayesify.convert(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1)), task="regression")
    with pytest.raises(ValueError, match=r"scores image classifiers .* output is regression.*corrupt_images.*evaluate\(\)"):
        evaluate_corruptions(regression, TensorDataset(torch.rand(4, 3, 32, 32), torch.randn(4)), corruptions="fog", severities=[1])
    segmentation = bayesify.convert(torchvision.models.segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3))
    with pytest.raises(ValueError, match=r"scores image classifiers .*class axis 1"):
        evaluate_corruptions(segmentation, TensorDataset(torch.rand(2, 3, 32, 32), torch.randint(3, (2, 32, 32))), corruptions="fog", severities=[1])
    plain = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1), nn.Flatten(0))  # unconverted: its output is checked
    with pytest.raises(ValueError, match=r"returned \(4,\)"):
        evaluate_corruptions(plain, TensorDataset(torch.rand(4, 3, 32, 32), torch.randint(2, (4,))), corruptions="fog", severities=[1])


def test_corrupted_results_do_not_depend_on_the_batch_size(images):
    """Each image is corrupted under a seed of its own place in the set: the corrupted set, and so cNLL, is the
    same at any batch size (seeded per batch, the cNLL moved by ~0.2% with the batch size)."""
    net = _net()
    settings = {"corruptions": "gaussian_noise,frost,impulse_noise", "severities": (3,), "min_size": 16, "progress": False}
    by_batch = [evaluate_corruptions(net, images, batch_size=size, **settings)["results"] for size in (7, 20)]
    for name, by_severity in by_batch[0].items():
        for key, value in by_severity[3].items():
            assert by_batch[1][name][3][key] == pytest.approx(value, rel=1e-6), (name, key)


def test_an_empty_set_is_named_in_the_error(images):
    # an empty OOD set was reported as an empty test set
    empty = InMemoryDataset(images.inputs[:0], images.labels[:0])
    with pytest.raises(ValueError, match=r"^the OOD set \(ood=\) is empty"):
        evaluate(_net(), images, ood=empty)
    with pytest.raises(ValueError, match="^the test set is empty"):
        evaluate(_net(), empty)


class _TimeMajorTagger(nn.Module):
    """[T, B, 5] -> [T, B, C]: every position of every sequence scored."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.rnn, self.fc = nn.GRU(5, 8), nn.Linear(8, classes)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


def test_a_time_major_output_joins_its_batches_at_their_examples_not_their_positions():
    # batches of a [T, B, C] output (batch_dim=1) were joined at T: right while every batch had one size, and a
    # smaller last batch failed in torch.cat; the metrics do not depend on how the set is cut into batches
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x, y = torch.randn(10, 7, 5), torch.randint(3, (10, 7))  # 10 sequences of 7 steps, made time-major per batch

    def collate(items):
        return torch.stack([a for a, _ in items], 1), torch.stack([b for _, b in items], 1)

    sets = {"set": TensorDataset(x, y)}
    model = bayesify.convert(_TimeMajorTagger(3), components=2, task="classification", class_axis=-1, batch_dim=1)
    one = evaluate(model, DataLoader(sets["set"], batch_size=10, collate_fn=collate), ood=DataLoader(TensorDataset(x * 3, y), batch_size=10, collate_fn=collate))
    for size in (4, 3):  # 4 + 4 + 2, 3 + 3 + 3 + 1 (a last batch of 1 has T != B and B == 1)
        loader = DataLoader(sets["set"], batch_size=size, collate_fn=collate)
        ood = DataLoader(TensorDataset(x * 3, y), batch_size=size, collate_fn=collate)
        cut = evaluate(model, loader, ood=ood)
        for key in ("nll", "accuracy", "ece"):
            assert cut[key] == pytest.approx(one[key], rel=1e-5), (size, key)
        assert 0 <= cut["ood"]["entropy"]["auroc"] <= 1  # (sampled scores: each batch draws its own noise)
    members, targets = bayesify.evaluation.collect_members(model, DataLoader(sets["set"], batch_size=4, collate_fn=collate))
    assert members.shape == (2, 7, 10, 3) and targets.shape == (7, 10)
    assert torch.equal(targets, y.T)


def test_a_time_major_models_last_step_joins_at_its_examples_when_the_batch_is_the_number_of_classes():
    # [B, C] with B == C (batch_dim=1): the batches were joined at the class axis (refused: targets do not fit)
    from torch.utils.data import DataLoader, TensorDataset

    class LastStep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.fc = nn.GRU(5, 8), nn.Linear(8, 4)

        def forward(self, x):  # [T, B, 5] -> [B, 4]
            return self.fc(self.rnn(x)[0][-1])

    def collate(items):
        return torch.stack([a for a, _ in items], 1), torch.stack([b for _, b in items])

    torch.manual_seed(0)
    x, y = torch.randn(12, 6, 5), torch.randint(4, (12,))
    model = bayesify.convert(LastStep(), task="classification", batch_dim=1, components=2)
    nll = [evaluate(model, DataLoader(TensorDataset(x, y), batch_size=size, collate_fn=collate))["nll"] for size in (3, 4, 8)]
    assert nll[1] == pytest.approx(nll[0], rel=1e-5) and nll[2] == pytest.approx(nll[0], rel=1e-5)


def test_a_one_logit_head_said_to_be_a_softmax_classifier_is_refused_in_evaluate():
    # a softmax over one column is 1: evaluate() of labels all 0 (a negatives-only slice) reported NLL 0, accuracy 1,
    # ECE 0 for a converted and a plain model alike, where the forward pass refused; mixed labels asked for
    # ignore_index=1 (which would drop every positive)
    torch.manual_seed(0)
    x = torch.randn(20, 5)
    for convert in (True, False):
        net = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
        if convert:
            bayesify.convert(net, task="classification")
        for y in (torch.zeros(20, dtype=torch.long), torch.arange(20) % 2):
            with pytest.raises(ValueError, match="single class column .* use task='binary'"):
                evaluate(net, torch.utils.data.TensorDataset(x, y), task=None if convert else "classification")


def test_binary_outputs_that_are_probabilities_already_are_refused():
    # a head ending in nn.Sigmoid under task='binary': its probabilities went through a sigmoid again (every
    # prediction 1, accuracy the share of positives), silently; as a final softmax is, refused in one line
    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.arange(64) % 2
    head = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())
    net = bayesify.convert(head, task="binary", init="normal", init_mean_std=0.3).eval()
    with pytest.raises(ValueError, match=r"binary outputs of Sequential are probabilities \(it ends in a sigmoid"):
        net(x)
    with pytest.raises(ValueError, match=r"binary outputs of Sequential are probabilities"):
        evaluate(net, torch.utils.data.TensorDataset(x, y))
    with pytest.raises(ValueError, match=r"binary outputs of Sequential are probabilities"):
        bayesify.uncertainty(net, x)
    logits = bayesify.convert(nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1)), task="binary").eval()
    assert evaluate(logits, torch.utils.data.TensorDataset(x, y))["nll"] > 0  # (logits of both signs: scored)
    # a head whose bias starts at the class prior (log 0.7 / 0.3) and tiny weights: logits all in [0, 1], not refused
    prior = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        prior[2].weight.mul_(1e-3), prior[2].bias.fill_(0.85)
    prior = bayesify.convert(prior, task="binary").eval()
    assert bool((prior(x) >= 0).all() & (prior(x) <= 1).all())
    assert evaluate(prior, torch.utils.data.TensorDataset(x, y))["nll"] > 0
    bayesify.uncertainty(prior, x)


def test_a_model_of_two_inputs_is_evaluated_on_pairs_of_a_tuple_of_inputs_and_a_target():
    # ((x1, x2), y) batches (a DataLoader hands the inner tuple on as a list) failed: 'list' has no attribute 'to'
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(4, 8), nn.Linear(3, 8), nn.Linear(8, 3)

        def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.a(x1) + self.b(x2)))

    class Pairs(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 20

        def __getitem__(self, i: int) -> tuple:
            return (x1[i], x2[i]), y[i]

    torch.manual_seed(0)
    x1, x2, y = torch.randn(20, 4), torch.randn(20, 3), torch.randint(3, (20,))
    net = bayesify.convert(Two(), task="classification", init="normal", init_mean_std=0.3)
    got = evaluate(net, torch.utils.data.DataLoader(Pairs(), batch_size=7))
    with torch.no_grad():
        want = F.cross_entropy(net.eval()(x1, x2), y).item()  # (eval's output: the log of the mixture)
    assert got["nll"] == pytest.approx(want, rel=1e-5)
    assert evaluate(net, Pairs(), batch_size=20)["nll"] == pytest.approx(want, rel=1e-5)

    class Masked(nn.Module):  # forward(x, mask=None): ((x, mask), y) batches are its two inputs
        def __init__(self) -> None:
            super().__init__()
            self.a, self.out = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            return self.out(h if mask is None else h * mask)

    mask = (torch.arange(20) % 2).float()[:, None]
    masked = bayesify.convert(Masked(), task="classification", init="normal", init_mean_std=0.3)
    with torch.no_grad():
        want = F.cross_entropy(masked.eval()(x1, mask), y).item()
    batches = torch.utils.data.DataLoader(list(zip(zip(x1, mask), y)), batch_size=8)  # ((x, mask), y) examples
    assert evaluate(masked, batches)["nll"] == pytest.approx(want, rel=1e-5)

    class Views(nn.Module):  # forward(views, scale=1.0): a tuple of views is its one input, not (views, scale)
        def __init__(self) -> None:
            super().__init__()
            self.a, self.out = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, views: list, scale: float = 1.0) -> torch.Tensor:
            return self.out(torch.tanh(sum(self.a(v) for v in views))) * scale

    views = bayesify.convert(Views(), task="classification", init="normal", init_mean_std=0.3)
    with torch.no_grad():
        want = F.cross_entropy(views.eval()([x1, x1.flip(0)]), y).item()
    batches = torch.utils.data.DataLoader(list(zip(zip(x1, x1.flip(0)), y)), batch_size=20)
    assert evaluate(views, batches)["nll"] == pytest.approx(want, rel=1e-5)


def test_a_time_major_model_of_two_inputs_takes_its_sequence_and_lengths_from_a_tuple():
    # ((x [T, B, F], lengths [B]), y) with batch_dim=1: read as a detector's list of examples (their sizes at
    # dimension 0 differ), the tuple went in as one input (forward() missing 'lengths')
    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.out = nn.GRU(3, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            h = self.rnn(x)[0]  # [T, B, 8]
            return self.out(h[lengths - 1, torch.arange(h.shape[1])])

    torch.manual_seed(0)
    x, lengths, y = torch.randn(5, 6, 3), torch.tensor([5, 3, 4, 5, 2, 1]), torch.randint(3, (6,))
    net = bayesify.convert(Last(), batch_dim=1, task="classification", init="normal", init_mean_std=0.3)
    with torch.no_grad():
        want = F.cross_entropy(net.eval()(x, lengths), y).item()
    batches = torch.utils.data.DataLoader([((x, lengths), y)], batch_size=None)  # (one batch as it is)
    assert evaluate(net, batches)["nll"] == pytest.approx(want, rel=1e-5)
