"""Uncertainty quality of rank-1 BNNs against what a user would do instead, and what it costs.

    python benchmarks/quality.py                       # everything, 5 seeds (hours on 2 CPU cores)
    python benchmarks/quality.py --quick --out /tmp/q  # a smoke test: tiny sets, 1 epoch, 2 seeds (~1 min)
    python benchmarks/quality.py --tasks digits mnist1d-conv --methods deterministic rank1 --seeds 3
    python benchmarks/quality.py --merge /tmp/a/quality.json /tmp/b/quality.json   # runs side by side -> one report
    python benchmarks/quality.py --seed-start 3 --seeds 2 --tuned benchmarks/results/quality.json --out /tmp/more
                                                       # two more seeds with the same settings; then --merge both
    python benchmarks/quality.py --tasks fashion-mnist-all --data-dir data --seeds 3   # Fashion-MNIST (make data)
    python benchmarks/quality.py --tasks fashion-mnist-all --data-dir data --device cuda   # the same on a GPU (auto: if any)
    python benchmarks/quality.py --tasks finetune-all --data-dir data --seeds 3   # pre-trained ResNet-8, new head, 2000 labels
    python benchmarks/quality.py --split val --tasks digits --methods rank1 rank1-sampled --budget 1
                                                       # on the validation split: the study of benchmarks/eval_default.py

Every method is trained by the one loop below (:func:`train`): Adam, minibatches in an order
drawn from a generator seeded by the seed alone (so every method sees the same batches), the
same epochs, a cosine learning-rate decay, and for the variational methods the KL / N term with
a linear warm-up of its weight over the first 2/3 of the steps. Methods and tasks are listed in
``_quality_methods.py`` and ``_quality_tasks.py``.

Tuning budget (validation split carved from the training set; the test set is never used):
each method gets the same number of training runs (``--budget``, default 4; tuning seed 100). A
method without a knob of its own picks the learning rate from the task's 4-value grid; MC
dropout spends its 4 runs on 2 learning rates (the grid's 2nd and 4th) x 2 dropout rates. With
``--budget 2``: the grid's 2nd and 4th learning rates, or the 3rd with the 2 dropout rates. The choice minimises the validation
NLL of the method's own predictive.

The plain loop (the ``*-plain`` tasks): what a new user writes. Adam at a constant 1e-3, no
tuning (MC dropout at its first rate, 0.1), the same batches; rank-1 is the README's drop-in
recipe, ``convert(net, task="classification")`` and ``F.cross_entropy(net(x), y) +
bayesify.kl_loss(net, N, step=step, warmup_steps=2 * steps // 3)``, evaluated at ``model.eval()``
(the K posterior means, as the tuned loop's ``rank1``). Temperature scaling and the deep ensemble are made of the
deterministic run (its learning rate; T is fitted on the validation split). ``--budget 1``
skips tuning (every method at the grid's 3rd learning rate).

Evaluation is uniform: every method gives member predictions ``[S, B, out]`` (rank-1 at the
library's default, the K posterior means: ``bayesify.predict(model.eval(), x)``, K = 4; the
``*-sampled`` rows, the same nets: ``bayesify.predict(model.eval(), x, samples=4)``, K x M = 16; MC
dropout and bayesian-torch: 16 stochastic passes; ensembles: their members; Laplace: its predictive
probabilities; deterministic: one), and the metrics are computed
from them (``_quality_evaluation.py``). Times are ratios to the deterministic run of the same
task and seed in the same process; they include what else ran on the machine (see the report).

Fine-tuning tasks (``digits-finetune`` and the image tasks ``finetune-all``: a pre-trained ResNet-8 with a new
head, 2000 labels; see ``_quality_tasks.py``): every method starts from the same pre-trained net of the
seed. It is pre-trained once per (pre-training set, seed) in a process, in the tuned loop whatever the
task's loop (the plain and the tuned task share it), and with ``--pretrained-dir`` kept on disk, so that
processes side by side (``benchmarks/gpu_fashion.sh finetune``) start from the very same weights
(``--pretrain-only`` makes them and stops). Laplace (laplace-torch) is post hoc on the deterministic
fine-tune; its training time is the fine-tune's plus its fit.

``--split val`` evaluates on the validation split instead of the test set (the test set is not used);
``benchmarks/eval_default.py`` uses it to compare evaluation at the K means with sampled evaluation.

``--device`` (cpu, cuda, auto): where the models train and predict; the training split is moved there
once, evaluation sets go there a chunk at a time and the members come back to the CPU, where every
metric is computed (the same code on either device). ``benchmarks/gpu_fashion.sh`` runs the Fashion-MNIST
tasks on one GPU machine as processes side by side (by task and group of methods), then ``--merge``.

Writes ``quality.md``, ``quality.json`` and one ``quality_<task>.png`` per task to ``--out``
(default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

if __package__ in (None, ""):  # run as a script: python benchmarks/quality.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bayesify.evaluation.metrics import member_log_probs_from_logits, negative_log_likelihood  # noqa: E402
from benchmarks._quality_evaluation import evaluate_members, gaussian_head_metrics, ood_evaluation  # noqa: E402
from benchmarks._quality_methods import (  # noqa: E402
    FINETUNE_METHODS, METHODS, OPTIONAL_METHODS, STUDY_METHODS, Method, device, set_device,
)  # fmt: skip
from benchmarks._quality_report import write_report  # noqa: E402
from benchmarks._quality_tasks import DEFAULT_TASKS, GROUPS, REGRESSION, TASKS, Scale, Task, build_task  # noqa: E402
from benchmarks._quality_tasks import head_name, task_names, validation_view  # noqa: E402

KL_WARMUP = 2 / 3  # fraction of the steps over which the KL weight rises linearly from 0 to 1
BUDGET = 4  # validation runs per method
TUNING_SEED = 100
DEFAULT_CACHE = Path.home() / ".cache" / "bayesify" / "quality"
PLAIN_LR = 1e-3  # the plain loop's Adam learning rate (constant, untuned)
DEFAULT_DATA = Path(__file__).resolve().parents[1] / "data"  # where `make data` puts Fashion-MNIST and MNIST


def train(
    method: Method, part: nn.Module, task: Task, x: Tensor, y: Tensor, *, epochs: int, lr: float, seed: int
) -> float:
    """The one training loop of the benchmark; returns the seconds it took.

    Adam; minibatches in an order drawn from ``torch.Generator().manual_seed(seed)`` (the same
    for every method); cosine decay of the learning rate to 0 over all steps (the plain loop:
    constant); the method's loss with the KL weight ``min(1, step / (KL_WARMUP * steps))`` (the
    plain loop: ``bayesify.kl_loss`` warmed up over ``2 * steps // 3``).
    """
    groups = method.param_groups(part)
    optimizer = torch.optim.Adam([{"params": g["params"], "lr": lr * g["lr_scale"]} for g in groups])
    n, batch = len(y), task.batch_size
    steps = epochs * math.ceil(n / batch)
    plain = task.loop == "plain"
    decay = (lambda s: 1.0) if plain else (lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    order = torch.Generator().manual_seed(seed)
    warmup = max(1, 2 * steps // 3 if plain else round(KL_WARMUP * steps))
    part.train()
    step = 0
    start = time.perf_counter()
    for _ in range(epochs):
        permutation = torch.randperm(n, generator=order)
        for i in range(0, n, batch):
            index = permutation[i : i + batch]
            loss = method.loss(
                part, x[index], y[index], task, kl_weight=min(1.0, (step + 1) / warmup), step=step, warmup=warmup
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
    if x.is_cuda:
        torch.cuda.synchronize(x.device)  # the time of the work, not of its launch
    return time.perf_counter() - start


def fit(
    method: Method, task: Task, config: dict[str, Any], seed: int, trained: dict[str, tuple[nn.Module, float]],
    x: Tensor, y: Tensor,
) -> tuple[nn.Module, float]:
    """Build and train one method for one seed (reusing the run it builds on); returns (model, train seconds)."""
    torch.manual_seed(seed)  # the network's initialisation (and the method's noise) follow the seed
    if method.post_hoc:
        base, seconds = trained[method.builds_on]
        model = copy.deepcopy(base)
        start = time.perf_counter()
        method.after_training(model, task)  # its fit (Laplace's Hessian and prior) counts with the base's training
        return model, seconds + time.perf_counter() - start
    model = method.build(task, config.get("knob"), seed).to(device())
    seconds = 0.0
    if method.trains:
        for k, part in enumerate(method.parts(model)):
            if k == 0 and method.builds_on is not None:  # deep ensemble: member 0 is the deterministic run
                base, base_seconds = trained[method.builds_on]
                part.load_state_dict(base.state_dict())
                seconds += base_seconds
                continue
            seconds += train(method, part, task, x, y, epochs=task.epochs, lr=config["lr"], seed=seed + 1000 * k)
    method.after_training(model, task)
    return model, seconds


def validation_nll(method: Method, model: nn.Module, task: Task) -> float:
    """NLL of the method's own predictive (the mixture of its members) on the validation split."""
    members = method.members(model, task.x_val, task)
    if task.kind == REGRESSION:
        return gaussian_head_metrics(members, task.y_val)["nll"]
    return float(negative_log_likelihood(member_log_probs_from_logits(members), task.y_val))


def grid(method: Method, task: Task, budget: int) -> list[dict[str, Any]]:
    """The configurations a method tries within the budget (see the module docstring).

    4 runs: a method without a knob tries the 4 learning rates of the task's grid; one with a knob
    tries the 2nd and 4th learning rates x its 2 knob values. 2 runs: the 2nd and 4th learning
    rates; or the 3rd x 2 knob values. 1 run: the 3rd learning rate (and the first knob value).
    """
    lrs = task.lr_grid
    knobs = method.knob_values if method.knob else (None,)
    if budget < len(knobs) or budget <= 1:
        return [{"lr": lrs[2], "knob": knobs[0]}]
    per_knob = budget // len(knobs)
    chosen = {1: [lrs[2]], 2: [lrs[1], lrs[3]]}.get(per_knob, list(lrs[:per_knob]))
    return [{"lr": lr, "knob": v} for lr in chosen for v in knobs]


def tune(method: Method, task: Task, budget: int, trained_tuning: dict, log: Any) -> dict[str, Any]:
    """Pick a configuration on the validation split with ``budget`` runs (tuning seed)."""
    configs = grid(method, task, budget)
    if not method.trains:
        return {"lr": None, "knob": None}
    if method.builds_on is not None:
        return dict(trained_tuning[method.builds_on]["config"])
    if task.loop == "plain":  # no tuning: the constant learning rate, the method's first knob value
        return {"lr": PLAIN_LR, "knob": method.knob_values[0] if method.knob else None}
    scores = []
    for config in configs:
        if len(configs) == 1:
            scores.append(float("nan"))
            break
        model, _ = fit(method, task, config, TUNING_SEED, {}, task.x_train, task.y_train)
        scores.append(validation_nll(method, model, task))
        log(f"  tune {task.name:<16} {method.key:<16} {config} val NLL {scores[-1]:.4f}")
    best = min(range(len(scores)), key=lambda i: scores[i] if not math.isnan(scores[i]) else math.inf)
    return {**configs[best], "val_nll": scores, "grid": configs}


_PRETRAINED: dict[tuple[Any, ...], nn.Module] = {}  # (pre-training set and size, epochs, lr, seed, device) -> net
PRETRAINED_DIR: Path | None = None  # --pretrained-dir: pre-trained nets kept on disk (shared by processes)


def pretrain(task: Task, seed: int, lr: float) -> nn.Module:
    """The fine-tuning task's starting point: a deterministic net trained on the pre-training split.

    Trained once per (pre-training set, seed) and kept (in memory, and in ``PRETRAINED_DIR``), in the tuned
    loop (cosine decay) whatever the task's loop: the plain and the tuned task start from the same net.
    With ``task.new_head`` the last linear layer is then replaced by a fresh one for the target's classes,
    initialised from the seed (the same head for every method of the seed).
    """
    key = (task.pretrain_key or task.name, len(task.y_pretrain), task.pretrain_epochs, lr, seed, str(device()))
    if key not in _PRETRAINED:
        torch.manual_seed(seed)
        net = (task.make_pretrain_net or task.make_net)(0.0).to(device())
        path = None if PRETRAINED_DIR is None else PRETRAINED_DIR / ("-".join(map(str, key[:5])).replace("/", "_") + ".pt")
        if path is not None and path.exists():
            net.load_state_dict(torch.load(path, map_location=device()))
        else:
            setup = dataclasses.replace(task, loop="tuned", batch_size=task.pretrain_batch_size or task.batch_size)
            train(Method(), net, setup, task.x_pretrain, task.y_pretrain, epochs=task.pretrain_epochs, lr=lr, seed=seed + 7)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(net.state_dict(), path)
        _PRETRAINED[key] = net
    net = copy.deepcopy(_PRETRAINED[key])
    return with_new_head(net, task, seed) if task.new_head else net


def with_new_head(pretrained: nn.Module, task: Task, seed: int) -> nn.Module:
    """``task.make_net``'s network (the target's classes) with every pre-trained weight but the head's."""
    torch.manual_seed(seed + 11)
    net = task.make_net(0.0).to(device())
    head = head_name(net) + "."
    state = {k: v for k, v in pretrained.state_dict().items() if not k.startswith(head)}
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith(head) for k in missing):
        raise RuntimeError(f"{task.name}: the pre-trained net does not fit the target's: {missing}, {unexpected}")
    return net


def run_task(
    task: Task, methods: list[Method], seeds: list[int], budget: int, log: Any, tuned: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Tune every method (or take ``tuned``: ``{method: config}`` of an earlier run), then train and test each seed."""
    start = time.perf_counter()
    on_device(task)
    task.shifts()  # corrupt once, before any timing
    log(f"[{task.name}] {len(task.shifts())} shifted sets ready in {time.perf_counter() - start:.1f} s")
    tuned = tuned or {}
    if task.finetune:
        t0 = time.perf_counter()
        for s in pretrain_seeds(task, seeds, budget, tuned=bool(tuned)):
            task.pretrained[s] = pretrain(task, s, lr=task.pretrain_lr)
        log(f"[{task.name}] pre-trained nets ready in {time.perf_counter() - t0:.1f} s")
    configs: dict[str, dict[str, Any]] = {}
    for method in methods:
        if method.key in tuned:
            configs[method.key] = tuned[method.key]
        else:
            configs[method.key] = tune(method, task, budget, {k: {"config": c} for k, c in configs.items()}, log)
        log(f"[{task.name}] {method.key}: {({k: v for k, v in configs[method.key].items() if k in ('lr', 'knob')})}"
            + (" (from --tuned)" if method.key in tuned else ""))  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {m.key: [] for m in methods}
    for seed in seeds:
        trained: dict[str, tuple[nn.Module, float]] = {}
        for method in methods:
            model, seconds = fit(method, task, configs[method.key], seed, trained, task.x_train, task.y_train)
            trained[method.key] = (model, seconds)
            t0 = time.perf_counter()
            clean = method.members(model, task.x_test, task)
            eval_seconds = time.perf_counter() - t0

            def predict(v: Tensor, model: nn.Module = model, method: Method = method, clean: Tensor = clean) -> Tensor:
                # the clean test set's members once (the timed pass); every other set through the method
                return clean if v is task.x_test else method.members(model, v, task)

            metrics = evaluate_members(predict, task, method.components(model))
            if task.x_ood is not None:
                metrics.update(ood_evaluation(method, model, task, metrics, predict))
            record = {"seed": seed, "train_s": seconds, "eval_s": eval_seconds,
                      "params": method.num_parameters(model), **metrics}  # fmt: skip
            runs[method.key].append(record)
            extra = f" cNLL {metrics['c_nll']:.4f}"
            if task.x_ood is not None:
                extra += f" OOD AUROC (entropy) {metrics['ood_entropy_auroc']:.4f}"
            log(f"  {task.name:<16} seed {seed} {method.key:<16} NLL {metrics['nll']:.4f}{extra} train {seconds:.1f} s")
    return {
        "task": task.name, "kind": task.kind, "description": task.description, "epochs": task.epochs,
        "batch_size": task.batch_size, "lr_grid": list(task.lr_grid), "num_train": task.num_train,
        "num_val": len(task.y_val), "num_test": len(task.y_test), "shifted_sets": len(task.shifts()),
        "shift_examples": len(task.y_shift), "loop": task.loop, "ood": task.ood_name,
        "num_ood": None if task.x_ood is None else len(task.x_ood),
        "methods": {m.key: {"label": m.label, "config": configs[m.key], "runs": runs[m.key]} for m in methods},
    }  # fmt: skip


def pretrain_seeds(task: Task, seeds: list[int], budget: int, tuned: bool) -> list[int]:
    """The seeds a fine-tuning task needs pre-trained nets for: its seeds, and the tuning seed where it tunes."""
    tunes = not tuned and task.loop != "plain" and budget > 1
    return [*([TUNING_SEED] if tunes else []), *seeds]


def on_device(task: Task) -> Task:
    """Put the training split(s) on ``--device`` (the loop indexes them there); evaluation sets stay on the CPU
    (each chunk goes to the device in ``Method.members``, the members come back for the metrics)."""
    for name in ("x_train", "y_train", "x_pretrain", "y_pretrain"):
        value = getattr(task, name)
        if value is not None:
            setattr(task, name, value.to(device()))
    return task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=[*TASKS, *GROUPS],
                        help="fashion-mnist-all: the CNN and the ResNet, each in the tuned and the plain loop; "
                        "finetune-all: the two image fine-tuning tasks, each in the tuned and the plain loop")  # fmt: skip
    every = list(dict.fromkeys([m.key for m in METHODS + FINETUNE_METHODS] + list(OPTIONAL_METHODS)))
    parser.add_argument("--methods", nargs="+", default=None, choices=every, help="default: all of a task's")
    parser.add_argument("--seeds", type=int, default=5, help="how many seeds: S .. S+N-1 (S: --seed-start)")
    parser.add_argument("--seed-start", type=int, default=0, help="the first seed (more seeds for an earlier run)")
    parser.add_argument("--tuned", type=Path, metavar="JSON",
                        help="take each method's tuned settings from this quality.json instead of tuning again")  # fmt: skip
    parser.add_argument("--budget", type=int, default=BUDGET, help="validation runs per method (1: no tuning)")
    parser.add_argument("--quick", action="store_true", help="tiny sets, 1 epoch, 2 seeds, no tuning: a smoke test")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="corrupted image sets are kept here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda (cuda:N) or auto: where the models train and predict (metrics: on the CPU)")  # fmt: skip
    parser.add_argument("--data-dir", type=Path, default=None,
                        help=f"Fashion-MNIST / MNIST in torchvision's layout (default: $BAYESIFY_DATA_DIR or {DEFAULT_DATA})")
    parser.add_argument("--max-train", type=int,
                        help="Fashion-MNIST: train on the first N of the training split; image fine-tuning: N labels (2000)")  # fmt: skip
    parser.add_argument("--epochs", type=int, help="Fashion-MNIST: epochs (default 10); image fine-tuning: its epochs (10)")
    parser.add_argument("--max-test", type=int, help="the first N test images (Fashion-MNIST, fine-tuning tasks)")
    parser.add_argument("--max-pretrain", type=int, help="image fine-tuning: pre-train on the first N images (all)")
    parser.add_argument("--pretrain-epochs", type=int, help="image fine-tuning: pre-training epochs (default 10)")
    parser.add_argument("--pretrained-dir", type=Path,
                        help="keep the pre-trained nets here (loaded when there): processes side by side share them")  # fmt: skip
    parser.add_argument("--pretrain-only", action="store_true", help="pre-train the tasks' nets (--pretrained-dir), stop")
    parser.add_argument("--split", choices=("test", "val"), default="test",
                        help="val: evaluate on the validation split instead of the test set (choosing settings)")  # fmt: skip
    parser.add_argument("--corruptions", help="Fashion-MNIST: comma-separated ImageNet-C corruptions (default: all 15)")
    parser.add_argument("--max-ood", type=int, help="Fashion-MNIST: the first N MNIST test images as OOD (default: all)")
    parser.add_argument("--shift-examples", type=int,
                        help="Fashion-MNIST: make the shifted sets from the first N test images (default: all)")  # fmt: skip
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="one report from the quality.json files of runs over different tasks or seeds")  # fmt: skip
    args = parser.parse_args(argv)
    if args.merge:
        merge_reports(args.merge, args.out)
        print(f"wrote {args.out / 'quality.md'}")
        return
    torch.set_num_threads(args.threads)
    set_device(args.device)
    global PRETRAINED_DIR
    PRETRAINED_DIR = args.pretrained_dir

    import os

    data_dir = args.data_dir or Path(os.environ.get("BAYESIFY_DATA_DIR") or DEFAULT_DATA)
    corruptions = None if args.corruptions is None else tuple(c.strip() for c in args.corruptions.split(",") if c.strip())
    if args.quick:
        scale = Scale(
            epochs=0.01, max_train=128, max_test=64, image_corruptions=("gaussian_noise", "brightness"), max_shifts=3,
            data_dir=data_dir, max_pretrain=512,
        )  # fmt: skip
        seeds, budget = [0, 1], 1
    else:
        scale = Scale(
            cache_dir=args.cache_dir, data_dir=data_dir, max_train=args.max_train, fixed_epochs=args.epochs,
            image_corruptions=corruptions, shift_examples=args.shift_examples, max_ood=args.max_ood,
            max_test=args.max_test, max_pretrain=args.max_pretrain, pretrain_epochs=args.pretrain_epochs,
        )  # fmt: skip
        budget = args.budget
        seeds = list(range(args.seed_start, args.seed_start + args.seeds))
    tuned: dict[str, dict[str, Any]] = {}
    if args.tuned is not None:
        earlier = json.loads(args.tuned.read_text())
        if earlier["budget"] != budget:
            raise SystemExit(f"--tuned {args.tuned} was tuned with --budget {earlier['budget']}, this run has {budget}")
        tuned = {t["task"]: {k: m["config"] for k, m in t["methods"].items()} for t in earlier["tasks"]}
    started = time.time()
    command = ("python benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    results = []
    for name in [n for group in args.tasks for n in task_names(group)]:
        task = build_task(name, scale)
        if args.split == "val":
            task = validation_view(task)
        if args.pretrain_only:
            _pretrain_only(task, pretrain_seeds(task, seeds, budget, tuned=args.tuned is not None))
            continue
        pool = FINETUNE_METHODS if task.finetune else METHODS
        wanted = args.methods if args.methods is not None else task.methods
        chosen = [m for m in pool if (m.key not in STUDY_METHODS if wanted is None else m.key in wanted)]
        optional = {k for k in OPTIONAL_METHODS if k.startswith("ft-") == task.finetune}
        for key in sorted((set(wanted or ()) & optional) - {m.key for m in pool}):
            print(f"[{name}] {key}: skipped, {OPTIONAL_METHODS[key]} is not installed (the bench extra)", flush=True)
        chosen = _with_dependencies(chosen, pool)
        if args.tuned is not None and name not in tuned:
            raise SystemExit(f"--tuned {args.tuned} has no task {name!r}; it has {sorted(tuned)}")
        log = lambda s: print(s, flush=True)  # noqa: E731
        results.append(run_task(task, chosen, seeds, budget, log=log, tuned=tuned.get(name)))
        # the report so far after every task: a long run that stops keeps what it measured
        write_report(results, args.out, command=command, seconds=time.time() - started, budget=budget)
    if not args.pretrain_only:
        print(f"wrote {args.out / 'quality.md'}")


def _pretrain_only(task: Task, seeds: list[int]) -> None:
    """``--pretrain-only``: the task's pre-trained nets of these seeds into ``--pretrained-dir``."""
    if not task.finetune:
        return
    on_device(task)
    for seed in seeds:
        start = time.perf_counter()
        pretrain(task, seed, lr=task.pretrain_lr)
        print(f"[{task.name}] pre-trained seed {seed} in {time.perf_counter() - start:.1f} s", flush=True)


def merge_reports(paths: list[Path], out: Path) -> None:
    """One report from several runs: over different tasks (run side by side), over more seeds of a task
    with the same settings (``--tuned``), or over different methods of a task (``--methods``, run side by side:
    a deterministic run both hold, the same settings and seeds, is kept once, from the first)."""
    runs = [json.loads(path.read_text()) for path in paths]
    budgets = {run["budget"] for run in runs}
    if len(budgets) != 1:
        raise SystemExit(f"--merge: the runs used different tuning budgets {sorted(budgets)}; merge like with like")
    tasks: dict[str, dict[str, Any]] = {}
    for task in (task for run in runs for task in run["tasks"]):
        if task["task"] not in tasks:
            tasks[task["task"]] = copy.deepcopy(task)
            continue
        # the same task in another run: more seeds of the same methods with the same settings, or other methods
        into = tasks[task["task"]]
        by_method = set(task["methods"]) != set(into["methods"])  # split by --methods, not by seeds
        for key, method in task["methods"].items():
            have = into["methods"].get(key)
            if have is None:  # a method run in another process (its own deterministic baseline of the same seeds)
                into["methods"][key] = copy.deepcopy(method)
                continue
            if by_method and _same_runs(have, method):  # a baseline both runs hold (the time ratios' deterministic)
                continue
            if _settings(have["config"]) != _settings(method["config"]):
                raise SystemExit(f"--merge: {task['task']}/{key} has other settings or is missing in one run; "
                                 "merge runs made with --tuned from the same report")  # fmt: skip
            seeds = [r["seed"] for r in have["runs"]] + [r["seed"] for r in method["runs"]]
            if len(set(seeds)) != len(seeds):
                raise SystemExit(f"--merge: {task['task']}/{key} has seed(s) in more than one run ({sorted(seeds)})")
            have["runs"] = sorted(have["runs"] + method["runs"], key=lambda r: r["seed"])
    order = [m.key for m in METHODS + FINETUNE_METHODS]
    for task in tasks.values():  # the pool's order, whichever run a method came from
        rank = {key: order.index(key) if key in order else len(order) for key in task["methods"]}
        task["methods"] = dict(sorted(task["methods"].items(), key=lambda item: rank[item[0]]))
    command = " ; ".join(f"`{run['command']}`" for run in runs).strip("`")
    seconds = sum(run["seconds"] for run in runs)  # the runs' times added (some may have run side by side)
    date = " and ".join(dict.fromkeys(run["date"] for run in runs))  # the runs' own machine and dates
    write_report(list(tasks.values()), out, command=command, seconds=seconds, budget=budgets.pop(), info=runs[0]["machine"], date=date)


def _same_runs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same method with the same settings and seeds in two runs split by method (each with its baseline)."""
    return _settings(a["config"]) == _settings(b["config"]) and [r["seed"] for r in a["runs"]] == [
        r["seed"] for r in b["runs"]
    ]


def _settings(config: dict[str, Any]) -> tuple[Any, Any]:
    return config.get("lr"), config.get("knob")


def _with_dependencies(chosen: list[Method], pool: list[Method]) -> list[Method]:
    """Add the runs a chosen method builds on (and the time baseline: ``ft-deterministic`` in the fine-tuning
    pool, else the pool's first), in pool order."""
    baseline = "ft-deterministic" if any(m.key == "ft-deterministic" for m in pool) else pool[0].key
    keys = {m.key for m in chosen} | {baseline} | {m.builds_on for m in chosen if m.builds_on}
    return [m for m in pool if m.key in keys]


if __name__ == "__main__":
    main()
