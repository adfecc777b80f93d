"""``benchmarks/quality.py``: the ``--quick`` run's report structure, and the regression metrics it uses."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._quality_methods import FINETUNE_METHODS, METHODS, STUDY_METHODS  # noqa: E402
from benchmarks._quality_tasks import DEFAULT_TASKS  # noqa: E402
from benchmarks._quality_evaluation import gaussian_head_metrics  # noqa: E402

pytest.importorskip("sklearn")
pytest.importorskip("mnist1d")
pytest.importorskip("corrupt_tta")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quality")
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--quick", "--device", "cpu", "--out", str(out)],
        cwd=ROOT, check=True, timeout=600, capture_output=True,
    )  # fmt: skip
    return out


def _expected(task: str) -> list[str]:
    pool = FINETUNE_METHODS if task.endswith("finetune") else METHODS
    return [m.key for m in pool if m.key not in STUDY_METHODS]  # (a study runs only when named)


@pytest.mark.slow
def test_quick_run_reports_every_method_of_every_task(quick_run: Path) -> None:
    report = json.loads((quick_run / "quality.json").read_text())
    assert [t["task"] for t in report["tasks"]] == list(DEFAULT_TASKS)  # what the command runs by default
    markdown = (quick_run / "quality.md").read_text()
    for task in report["tasks"]:
        name = task["task"]
        assert list(task["methods"]) == _expected(name), name
        assert f"## {name}" in markdown
        assert (quick_run / f"quality_{name}.png").stat().st_size > 0
        for key, method in task["methods"].items():
            assert [r["seed"] for r in method["runs"]] == [0, 1], (name, key)
            assert f"(`{key}`) |" in markdown, (name, key)
        for key, row in report["summary"][name].items():
            for metric, (mean, std) in row.items():
                assert math.isfinite(mean) and math.isfinite(std), (name, key, metric)


@pytest.mark.slow
def test_quick_run_has_the_task_metrics(quick_run: Path) -> None:
    summary = json.loads((quick_run / "quality.json").read_text())["summary"]
    classification = {"nll", "accuracy", "ece", "brier", "c_nll", "c_accuracy", "c_ece", "train_x", "eval_x", "params_x"}
    assert classification <= set(summary["digits"]["rank1"])
    assert {"auc_pr", "auc_roc"} <= set(summary["breast-cancer"]["rank1"])
    assert {"nll", "rmse", "coverage", "width", "c_nll", "c_rmse", "c_coverage"} <= set(summary["diabetes"]["rank1"])
    # ratios against the deterministic run of the same seed; a deep ensemble holds K = 4 networks
    assert summary["digits"]["deterministic"]["train_x"][0] == 1.0
    assert summary["digits"]["deep-ensemble"]["params_x"][0] == 4.0


@pytest.mark.slow
def test_runs_over_different_tasks_or_seeds_merge_into_one_report(quick_run: Path, tmp_path: Path) -> None:
    report = json.loads((quick_run / "quality.json").read_text())
    halves = []
    for i, tasks in enumerate((report["tasks"][:1], report["tasks"][1:])):
        halves.append(tmp_path / f"run{i}.json")
        halves[-1].write_text(json.dumps({**report, "tasks": tasks, "command": f"run {i}"}))
    merged = tmp_path / "merged"
    quality = [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--merge"]
    subprocess.run([*quality, *map(str, halves), "--out", str(merged)], cwd=ROOT, check=True, timeout=300)
    again = json.loads((merged / "quality.json").read_text())
    assert [t["task"] for t in again["tasks"]] == [t["task"] for t in report["tasks"]]
    assert again["summary"] == report["summary"]
    assert "`run 0` ; `run 1`" in (merged / "quality.md").read_text()
    # more seeds of the same tasks: one run per seed merges back into the whole
    by_seed = []
    for seed in (0, 1):
        tasks = [{**t, "methods": {k: {**m, "runs": [r for r in m["runs"] if r["seed"] == seed]}
                                   for k, m in t["methods"].items()}} for t in report["tasks"]]  # fmt: skip
        by_seed.append(tmp_path / f"seed{seed}.json")
        by_seed[-1].write_text(json.dumps({**report, "tasks": tasks}))
    subprocess.run([*quality, *map(str, reversed(by_seed)), "--out", str(merged)], cwd=ROOT, check=True, timeout=300)
    assert json.loads((merged / "quality.json").read_text())["summary"] == report["summary"]
    # the same seed twice is refused, not counted twice
    twice = subprocess.run([*quality, str(halves[0]), str(halves[0]), "--out", str(merged)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert twice.returncode != 0 and "seed(s) in more than one run" in twice.stderr


@pytest.mark.slow
def test_runs_over_different_methods_of_a_task_merge_into_one_report(quick_run: Path, tmp_path: Path) -> None:
    # as benchmarks/gpu_fashion.sh runs them side by side: each part holds its methods and the deterministic baseline
    report = json.loads((quick_run / "quality.json").read_text())
    task = next(t for t in report["tasks"] if t["task"] == "digits")
    keys = list(task["methods"])
    parts = []
    for i, chosen in enumerate((keys[:4], keys[:1] + keys[4:])):
        methods = {k: m for k, m in task["methods"].items() if k in chosen}
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps({**report, "tasks": [{**task, "methods": methods}]}))
    merged = tmp_path / "merged"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--merge", *map(str, reversed(parts)),
                    "--out", str(merged)], cwd=ROOT, check=True, timeout=300)  # fmt: skip
    again = json.loads((merged / "quality.json").read_text())
    assert list(again["tasks"][0]["methods"]) == keys  # the pool's order, the baseline once
    assert again["summary"]["digits"] == report["summary"]["digits"]


@pytest.mark.slow
def test_tuned_settings_are_taken_from_an_earlier_report(quick_run: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--quick", "--tasks", "breast-cancer",
         "--tuned", str(quick_run / "quality.json"), "--out", str(tmp_path)],
        cwd=ROOT, check=True, timeout=600, capture_output=True, text=True,
    )  # fmt: skip
    earlier = {t["task"]: t for t in json.loads((quick_run / "quality.json").read_text())["tasks"]}["breast-cancer"]
    again = json.loads((tmp_path / "quality.json").read_text())["tasks"][0]
    assert done.stdout.count("(from --tuned)") == len(earlier["methods"])
    assert {k: m["config"] for k, m in again["methods"].items()} == {k: m["config"] for k, m in earlier["methods"].items()}


def test_gaussian_head_metrics_match_the_formulas() -> None:
    generator = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 50, generator=generator, dtype=torch.float64)
    log_var = 0.3 * torch.randn(3, 50, generator=generator, dtype=torch.float64)
    y = torch.randn(50, generator=generator, dtype=torch.float64)
    members = torch.stack([mean, log_var], dim=-1)
    out = gaussian_head_metrics(members, y, y_std=2.0)

    normal = torch.distributions.Normal(mean, (0.5 * log_var).exp())
    mixture_density = normal.log_prob(y).exp().mean(0)
    assert out["nll"] == pytest.approx(float(-mixture_density.log().mean() + math.log(2.0)), rel=1e-10)
    assert out["rmse"] == pytest.approx(float(((mean.mean(0) - y) ** 2).mean().sqrt() * 2.0), rel=1e-10)
    cdf = normal.cdf(y).mean(0)
    assert out["coverage"] == pytest.approx(float(((cdf >= 0.05) & (cdf <= 0.95)).double().mean()))


def test_one_gaussian_interval_is_the_textbook_one() -> None:
    # N(0, 1): the central 90% interval is +-1.6449; 3 of these 4 targets fall inside it
    members = torch.zeros(1, 4, 2, dtype=torch.float64)
    out = gaussian_head_metrics(members, torch.tensor([0.0, 1.0, -1.6, 1.7], dtype=torch.float64))
    assert out["width"] == pytest.approx(2 * 1.6448536269514722, rel=1e-9)
    assert out["coverage"] == pytest.approx(0.75)


@pytest.mark.slow
def test_fashion_mnist_tasks_report_ood_and_the_plain_loop(tmp_path: Path) -> None:
    """The Fashion-MNIST tasks on tiny idx files in torchvision's layout (no downloaded data)."""
    from tests.zoo.test_data import _tiny_set, _write

    data = tmp_path / "data"
    _write(data / "FashionMNIST" / "raw", _tiny_set(n_train=200, n_test=40, seed=5))
    _write(data / "MNIST" / "raw", _tiny_set(n_train=10, n_test=30, seed=6))
    out = tmp_path / "out"
    methods = ["deterministic", "temperature", "mc-dropout", "rank1", "deep-ensemble"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--quick", "--tasks", "fashion-mnist",
         "fashion-mnist-plain", "--methods", *methods, "--data-dir", str(data), "--out", str(out)],
        cwd=ROOT, check=True, timeout=600, capture_output=True, text=True,
    )  # fmt: skip
    report = json.loads((out / "quality.json").read_text())
    assert [t["task"] for t in report["tasks"]] == ["fashion-mnist", "fashion-mnist-plain"]
    tuned, plain = report["tasks"]
    assert (tuned["loop"], plain["loop"]) == ("tuned", "plain")
    assert tuned["num_train"] == 128 and tuned["num_val"] == 40 and tuned["num_test"] == 40 and tuned["num_ood"] == 30
    # the plain loop is not tuned: Adam at 1e-3 for every method, MC dropout at its first rate
    assert {k: (m["config"]["lr"], m["config"]["knob"]) for k, m in plain["methods"].items()} == {
        "deterministic": (1e-3, None), "temperature": (1e-3, None), "mc-dropout": (1e-3, 0.1), "rank1": (1e-3, None),
        "deep-ensemble": (1e-3, None),
    }  # fmt: skip
    for task in report["tasks"]:
        for key, method in task["methods"].items():
            for run in method["runs"]:
                for score in ("max_probability", "entropy", "mutual_information"):
                    for metric in ("auroc", "aupr_out", "fpr95"):
                        assert 0.0 <= run[f"ood_{score}_{metric}"] <= 1.0, (key, score, metric)
                assert 0.0 <= run["aurc"] <= 1.0
                # the library's evaluator for the methods it can run; their members for the others
                assert run["ood_via_evaluate"] == (0.0 if key in ("mc-dropout", "deep-ensemble") else 1.0), key
            if key == "deterministic":  # one member: no disagreement, MI cannot rank anything
                assert all(r["ood_mutual_information_auroc"] == 0.5 for r in method["runs"])
    markdown = (out / "quality.md").read_text()
    assert "## fashion-mnist-plain" in markdown and "Out-of-distribution detection, mnist test" in markdown
    assert "| `rank1`* |" in markdown and "| `mc-dropout` |" in markdown
    assert "OOD AUROC (entropy)" in done.stdout


def test_plain_loop_loss_is_the_readme_recipe_and_equals_the_loop_formula() -> None:
    """The plain loop's rank-1 loss is F.cross_entropy + bayesify.kl_loss(step, warmup); same value as the tuned loop's."""
    import dataclasses

    import torch.nn.functional as F

    import bayesify
    from benchmarks._quality_methods import Rank1
    from benchmarks._quality_tasks import CLASSIFICATION, Task

    torch.manual_seed(0)
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    make = lambda p: torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))  # noqa: E731
    tuned = Task("t", CLASSIFICATION, make, x, y, x, y, x, y, lambda v: [], epochs=1, batch_size=8, lr_grid=(1e-3,) * 4,
                 description="")  # fmt: skip
    plain = dataclasses.replace(tuned, loop="plain")
    method = Rank1()
    net = method.build(plain, None, 0)
    assert bayesify.is_converted(net)
    with torch.no_grad():  # move the posterior off the prior: at conversion the KL is ~0 and would test nothing
        for p in bayesify.rank1_parameters(net):
            p.add_(0.3 * torch.randn(p.shape))
    assert float(bayesify.kl_divergence(net).detach()) / 16 > 0.05
    for step, warmup in ((0, 6), (3, 6), (10, 6)):
        torch.manual_seed(1)
        got = method.loss(net, x, y, plain, kl_weight=min(1.0, (step + 1) / warmup), step=step, warmup=warmup)
        torch.manual_seed(1)
        recipe = F.cross_entropy(net(x), y) + bayesify.kl_loss(net, 16, step=step, warmup_steps=warmup)
        torch.manual_seed(1)
        formula = method.loss(net, x, y, tuned, kl_weight=min(1.0, (step + 1) / warmup))
        assert torch.equal(got, recipe)
        assert torch.allclose(got, formula, rtol=1e-6, atol=1e-7)


def test_head_study_redraws_only_the_new_heads_factor_means() -> None:
    """``ft-rank1-headsign`` / ``-headnormal``: only the new head's means are re-drawn (seeded), the body kept."""
    import dataclasses

    from benchmarks._quality_methods import Rank1
    from benchmarks._quality_tasks import CLASSIFICATION, Task

    make = lambda p: torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))  # noqa: E731
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    task = Task("t", CLASSIFICATION, make, x, y, x, y, x, y, lambda v: [], epochs=1, batch_size=8, lr_grid=(1e-3,) * 4,
                description="", loop="plain", new_head=True, pretrained={0: make(0.0)})  # fmt: skip
    sign = Rank1(from_pretrained=True, head_means="sign")
    net = sign.build(task, None, 0)
    for loc in (net[2].rank1_r.loc, net[2].rank1_s.loc):
        assert set(loc.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(net[2].rank1_r.loc, sign.build(task, None, 0)[2].rank1_r.loc)  # the seed's draw
    assert all(bool((p.loc == 1).all()) for p in (net[0].rank1_r, net[0].rank1_s))  # the body: the identity
    normal = Rank1(from_pretrained=True, head_means="normal").build(task, None, 0)[2].rank1_s.loc.detach()
    assert 0.2 < float(normal.std()) < 1.0 and not (normal == 1).any()
    kept = Rank1(from_pretrained=True, head_means="sign").build(dataclasses.replace(task, new_head=False), None, 0)
    assert bool((kept[2].rank1_r.loc == 1).all())  # a kept (pre-trained) head is not re-drawn


def test_prior_study_centres_each_factors_prior_on_its_own_initial_means() -> None:
    """``Rank1(prior_at_init=True)``: the KL is 0 at build (the posterior at the prior: its own means and scale),
    the library's where the means start at the identity, and the head's +-1 means are not pulled towards 1."""
    import bayesify
    from benchmarks._quality_methods import Rank1, _kl_to_initial_means
    from benchmarks._quality_tasks import CLASSIFICATION, Task

    def make(p: float) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    task = Task("t", CLASSIFICATION, make, x, y, x, y, x, y, lambda v: [], epochs=1, batch_size=8, lr_grid=(1e-3,) * 4,
                description="", loop="plain", new_head=True, pretrained={0: make(0.0)})  # fmt: skip
    method = Rank1(from_pretrained=True, head_means="sign", prior_at_init=True)
    net = method.build(task, None, 0)
    assert float(_kl_to_initial_means(net)) == pytest.approx(0.0, abs=1e-4)
    assert float(bayesify.kl_divergence(net)) > 1.0  # the library's prior at 1: the -1 means far from it
    grads = torch.autograd.grad(_kl_to_initial_means(net), [net[2].rank1_r.loc])
    assert float(grads[0].abs().max()) < 1e-4  # no pull on the head's means at build
    plain = Rank1(from_pretrained=True, prior_at_init=True).build(task, None, 0)
    with torch.no_grad():
        for p in bayesify.rank1_parameters(plain):
            p.add_(0.1)
    torch.testing.assert_close(_kl_to_initial_means(plain), bayesify.kl_divergence(plain))


def test_device_option_resolves_auto_and_refuses_a_missing_gpu() -> None:
    from benchmarks._quality_methods import device, set_device

    try:
        assert set_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
        assert set_device("cpu") == device() == torch.device("cpu")
        if not torch.cuda.is_available():
            with pytest.raises(SystemExit, match="no CUDA device"):
                set_device("cuda")
    finally:
        set_device("cpu")


# ---- the image fine-tuning tasks (issue 29): a pre-trained ResNet-8, a new head, few labels ----------------------


def _tiny_image_sets(root: Path) -> Path:
    """Fashion-MNIST and MNIST as tiny idx files in torchvision's layout (labels cycle through the 10 classes)."""
    from tests.zoo.test_data import _tiny_set, _write

    data = root / "data"
    _write(data / "FashionMNIST" / "raw", _tiny_set(n_train=400, n_test=40, seed=5))
    _write(data / "MNIST" / "raw", _tiny_set(n_train=300, n_test=20, seed=6))
    return data


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("finetune")
    out = root / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--quick", "--tasks", "fashion-split-finetune",
         "mnist-to-fashion-finetune-plain", "--data-dir", str(_tiny_image_sets(root)), "--out", str(out)],
        cwd=ROOT, check=True, timeout=300, capture_output=True, text=True,
    )  # fmt: skip
    return out, done.stdout


@pytest.mark.slow
def test_image_finetune_tasks_report_every_method_with_finite_numbers(finetune_run: tuple[Path, str]) -> None:
    from benchmarks._quality_tasks import FINETUNE_TASK_METHODS

    out, stdout = finetune_run
    report = json.loads((out / "quality.json").read_text())
    assert [t["task"] for t in report["tasks"]] == ["fashion-split-finetune", "mnist-to-fashion-finetune-plain"]
    available = {m.key for m in FINETUNE_METHODS}
    expected = [k for k in FINETUNE_TASK_METHODS if k in available]
    for key in set(FINETUNE_TASK_METHODS) - available:  # laplace-torch missing: skipped, and said so
        assert f"{key}: skipped" in stdout
    markdown = (out / "quality.md").read_text()
    split, transfer = report["tasks"]
    assert "new 5-class head" in split["description"] and "new 10-class head" in transfer["description"]
    assert (split["loop"], transfer["loop"]) == ("tuned", "plain")
    # --quick: 128 labels and a quarter of that again for validation; test: Fashion-MNIST classes 5-9 only
    assert (split["num_train"], split["num_val"], split["num_test"], split["num_ood"]) == (128, 32, 20, 20)
    assert (transfer["num_train"], transfer["num_test"]) == (128, 40)
    for task in report["tasks"]:
        assert list(task["methods"]) == expected, task["task"]  # not the pre-trained net: its head is new, untrained
        assert f"## {task['task']}" in markdown and (out / f"quality_{task['task']}.png").stat().st_size > 0
        for key, method in task["methods"].items():
            assert [r["seed"] for r in method["runs"]] == [0, 1], (task["task"], key)
            for run in method["runs"]:
                for metric in ("nll", "ece", "accuracy", "c_nll", "c_accuracy", "aurc", "ood_entropy_auroc", "train_s"):
                    assert math.isfinite(run[metric]), (task["task"], key, metric)
                assert 0.0 <= run["accuracy"] <= 1.0 and 0.0 <= run["ood_entropy_auroc"] <= 1.0
        for key, row in report["summary"][task["task"]].items():
            for metric, (mean, std) in row.items():
                assert math.isfinite(mean) and math.isfinite(std), (task["task"], key, metric)
    # the plain loop is not tuned: Adam at 1e-3 for every method, MC dropout at its first rate
    assert {(m["config"]["lr"], m["config"]["knob"]) for m in transfer["methods"].values()} == {(1e-3, None), (1e-3, 0.1)}
    # the ensemble holds 4 networks; the post-hoc methods count their fit on top of the fine-tune they start from
    summary = report["summary"]["fashion-split-finetune"]
    assert summary["ft-ensemble"]["params_x"][0] == 4.0
    assert summary["ft-temperature"]["train_x"][0] >= 1.0


def test_plain_and_tuned_finetune_tasks_start_from_one_pretrained_net(tmp_path: Path) -> None:
    """One pre-training per (set, seed), shared by the plain and the tuned task; a new head on it, from the seed."""
    from benchmarks import quality
    from benchmarks._quality_tasks import Scale, build_task, head_name

    scale = Scale(epochs=0.1, max_train=64, data_dir=_tiny_image_sets(tmp_path), max_pretrain=128)
    tuned, plain = build_task("fashion-split-finetune", scale), build_task("fashion-split-finetune-plain", scale)
    a, b = quality.pretrain(tuned, 0, tuned.pretrain_lr), quality.pretrain(plain, 0, plain.pretrain_lr)
    assert a is not b
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    head = head_name(a)
    assert a.get_submodule(head).out_features == 5
    pretrained = next(net for k, net in quality._PRETRAINED.items() if k[0] == tuned.pretrain_key and k[4] == 0)
    fresh = tuned.make_net(0.0)
    for key, value in a.state_dict().items():  # the body is the pre-trained one (not a fresh net's); the head is not
        if key.startswith(head + "."):
            assert not torch.equal(value, pretrained.state_dict()[key]), key
        elif value.is_floating_point() and value.numel() > 1:
            assert torch.equal(value, pretrained.state_dict()[key]), key
            assert not torch.equal(value, fresh.state_dict()[key]) or "running" in key, key
    other = quality.pretrain(tuned, 1, tuned.pretrain_lr)  # another seed: another pre-training and another head
    assert not torch.equal(other.get_submodule(head).weight, a.get_submodule(head).weight)


@pytest.mark.slow
def test_eval_default_compares_means_and_samples_on_the_validation_split(tmp_path: Path) -> None:
    """``eval_default.py``: ``quality.py --split val`` (the validation split as the test set), then the table."""
    out = tmp_path / "eval_default"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "eval_default.py"), "--quick", "--only", "finetune",
         "--data-dir", str(_tiny_image_sets(tmp_path)), "--out", str(out)],
        cwd=ROOT, check=True, timeout=300, capture_output=True, text=True,
    )  # fmt: skip
    report = json.loads((out / "finetune" / "quality.json").read_text())
    for task in report["tasks"]:
        assert task["num_test"] == task["num_val"] and "VALIDATION split" in task["description"]
        assert list(task["methods"]) == [
            "ft-deterministic", "ft-rank1", "ft-rank1-sampled", "ft-rank1-factors", "ft-rank1-factors-sampled"
        ]  # fmt: skip
        # the sampled rows are the same nets: the same training time, other predictions
        runs = task["methods"]
        sampled = [r["train_s"] for r in runs["ft-rank1-sampled"]["runs"]]
        assert sampled == pytest.approx([r["train_s"] for r in runs["ft-rank1"]["runs"]], abs=0.01)
    table = (tmp_path / "eval_default.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`ft-rank1" in line]
    assert len(rows) == 8  # 4 tasks x (full fine-tune, adapter)
    assert "nan" not in table and "python benchmarks/quality.py --split val" in table
