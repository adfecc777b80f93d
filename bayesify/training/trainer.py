"""The trainer: one loop, top to bottom, in the style of nanoGPT / minGPT.

    # one process (CPU or GPU), the tiled route of the paper, 4 components
    bayesify train --model resnet18 --data digits --epochs 2 --route tile --out runs/a
    # two processes on this machine (gloo on CPU, nccl on GPUs); --batch-size is the global batch
    torchrun --standalone --nproc-per-node 2 -m bayesify train --model cnn --data digits --out runs/ddp
    # TPU (or the XLA CPU backend: PJRT_DEVICE=CPU)
    bayesify train --model cnn --data digits --device xla --out runs/xla

From Python::

    config = TrainConfig(model="cnn", data="digits", epochs=5, out="runs/x")
    bundle = load_data(config.data)
    model = build_model(config, bundle)
    results = Trainer(config, model, bundle).run()

Each step: route the batch (``sample``: one random component per example; ``tile``: every
example through all K components, labels tiled to match), compute the
:class:`~bayesify.training.objective.Objective`, step the optimizer and the schedule. Every
``log_every`` steps a line goes to ``OUT/metrics.jsonl``; at the end of each epoch the test set
is evaluated and ``OUT/checkpoint.pt`` is written atomically (also every ``checkpoint_every``
steps). ``resume=True`` restores model, optimizer, schedule, grad scaler, step, epoch, position
in the epoch and the RNG states, and continues as if never interrupted (bitwise on the CPU,
with ``num_workers=0`` or augmentations that draw no randomness in the workers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

import bayesify
from bayesify.zoo.data import DataBundle
from bayesify.evaluation.evaluator import evaluate
from bayesify.zoo.models import create_model
from bayesify.inspection import num_components
from bayesify.options import Route
from bayesify.training.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from bayesify.training.distributed import setup
from bayesify.training.objective import Likelihood, Objective, unwrap
from bayesify.training.optim import WarmupStepDecay, build_optimizer, param_groups
from bayesify.training.sampler import ResumableBatchSampler

__all__ = ["Precision", "TrainConfig", "Trainer", "build_model"]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"


class Precision(str, Enum):
    """Numeric precision of the forward pass."""

    FP32 = "32"
    """float32 throughout."""
    BF16 = "bf16"
    """bfloat16 autocast (CPU, recent GPUs, TPU); no loss scaling needed."""
    FP16 = "fp16"
    """float16 autocast with a GradScaler (GPUs)."""

    def __str__(self) -> str:
        return self.value


@dataclass
class TrainConfig:
    """Everything a run needs; saved in the checkpoint so ``bayesify evaluate`` can rebuild it."""

    # what to train (names resolved by bayesify.models.create_model / bayesify.data.load_data)
    model: str = "cnn"
    data: str = "digits"
    data_dir: str | None = None
    pretrained: bool = False
    # rank-1 conversion; components=0 trains the deterministic network as it is (baseline)
    components: int = 4
    prior: str = "normal"
    prior_std: float = 0.1  # paper: 0.1 CIFAR, 0.05 ImageNet
    posterior: str = "normal"
    # means ~ Normal(1, init_mean_std): the reference's random_sign_init < 0 mode. Random signs ("random_sign",
    # the CIFAR/ImageNet presets) cost 2/prior_std^2 nats of KL per -1 entry, which swamps small data sets;
    # "preserve" keeps a pretrained network's function
    init: str = "normal"
    init_mean_std: float = 0.1
    init_sign_p: float = 0.5  # for init="random_sign"; paper: 0.5 CIFAR, 0.75 ImageNet
    init_dropout: float = 1e-3  # initial std sqrt(p / (1 - p)) ~ 0.032
    init_jitter: float = 0.0  # reference: 0.1 truncated-normal jitter on the raw std
    # objective
    route: str = "sample"  # "sample": one component per example (~1x cost); "tile": all K (paper, Kx cost)
    likelihood: str = "average"  # "average" per-component NLL, or "mixture" (needs route="tile")
    l2: float = 1e-4  # L2 prior on point-estimated weights
    l2_norm_layers: bool = True  # include normalisation layers in the L2 term (CIFAR reference)
    kl_annealing_epochs: float | None = None  # None: 2/3 of training
    train_noise: bool = True  # sample r, s during training (False: posterior means, e.g. for tests)
    # optimisation
    optimizer: str = "adam"  # "sgd" (Nesterov momentum; CIFAR/ImageNet recipe), "adam" (MIMIC), "adamw"
    lr: float = 1e-3
    momentum: float = 0.9
    nesterov: bool = True
    fast_weight_lr_multiplier: float = 1.0  # lr multiplier of the rank-1 r/s parameters
    warmup_epochs: float = 0.0
    decay_epochs: tuple[float, ...] = ()
    decay_ratio: float = 0.2
    grad_clip: float | None = None  # max global gradient norm
    epochs: int = 10
    max_steps: int | None = None  # stop after this many optimizer steps (e.g. MIMIC's 25k)
    batch_size: int = 64  # unique examples per step, all processes together (tiled K times by route="tile")
    # evaluation during training
    eval_samples: int = 1  # posterior samples per component at evaluation
    eval_every: int = 1  # epochs between test-set evaluations (0: only at the end)
    # system
    device: str = "auto"  # auto, cpu, cuda, cuda:N, xla
    precision: str = "32"  # "32", "bf16", "fp16"
    compile: bool = False  # torch.compile the model
    num_workers: int = 0
    seed: int = 0
    log_every: int = 10  # steps between lines in metrics.jsonl
    checkpoint_every: int = 0  # steps between checkpoints (0: at the end of each epoch only)
    out: str = "runs/default"
    resume: bool = False
    progress: bool | None = None  # tqdm bars (None: only on a terminal)

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in known}
        if "decay_epochs" in kwargs:
            kwargs["decay_epochs"] = tuple(kwargs["decay_epochs"])
        return cls(**kwargs)

    def validate(self) -> None:
        """Raise a ValueError naming the first bad value and its fix."""
        if self.components < 0:
            raise ValueError(f"components={self.components} must be >= 0 (0: the deterministic network; paper: 4).")
        try:
            route = Route(self.route)
        except ValueError:
            raise ValueError(f"route={self.route!r} must be 'sample' or 'tile'.") from None
        if route not in (Route.SAMPLE, Route.TILE):
            raise ValueError(f"route={self.route!r} must be 'sample' or 'tile' for training.")
        try:
            likelihood = Likelihood(self.likelihood)
        except ValueError:
            raise ValueError(f"likelihood={self.likelihood!r} must be 'average' or 'mixture'.") from None
        if likelihood is Likelihood.MIXTURE and route is Route.SAMPLE and self.components > 1:
            raise ValueError(
                "likelihood='mixture' needs every example through all components: use --route tile "
                "(or --likelihood average with --route sample)."
            )
        if str(self.precision) not in {p.value for p in Precision}:
            raise ValueError(f"precision={self.precision!r} must be one of: 32, bf16, fp16.")
        for name in ("epochs", "batch_size", "log_every", "eval_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1.")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps!r} must be >= 1 (or None: run all epochs).")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0.")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip={self.grad_clip!r} must be > 0 (or None: no clipping).")


def build_model(config: TrainConfig, bundle: DataBundle) -> nn.Module:
    """``create_model`` for the data, converted to rank-1 unless ``components == 0``; seeded."""
    torch.manual_seed(config.seed)
    model = create_model(
        config.model,
        in_channels=bundle.in_channels,
        num_classes=bundle.num_classes,
        input_shape=bundle.input_shape,
        kind=bundle.kind,
        pretrained=config.pretrained,
    )
    if config.components > 0:
        bayesify.convert(
            model,
            components=config.components,
            prior=config.prior,
            prior_std=config.prior_std,
            posterior=config.posterior,
            init=config.init,
            init_mean_std=config.init_mean_std,
            init_sign_p=config.init_sign_p,
            init_dropout=config.init_dropout,
            init_jitter=config.init_jitter,
        )
    return model


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, appended and flushed (main process only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records newer than ``step`` (written after the checkpoint a resumed run starts from)."""
        if not (self.enabled and self.path.exists()):
            return
        kept = [
            line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
        ]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)


class Trainer:
    """Train a (converted) model on a :class:`~bayesify.data.DataBundle` as ``config`` says.

    Args:
        config: the run's settings.
        model: the model to train (see :func:`build_model`); trained in place.
        data: training and test sets.

    Callbacks (minGPT style): ``trainer.add_callback("on_batch_end", fn)`` /
    ``"on_epoch_end"``; ``fn(trainer)`` sees ``trainer.step``, ``trainer.epoch`` and
    ``trainer.last`` (the last step's loss parts as floats, on logging steps).
    """

    def __init__(self, config: TrainConfig, model: nn.Module, data: DataBundle) -> None:
        config.validate()
        self.config, self.model, self.data = config, model, data
        self.callbacks: dict[str, list[Callable[["Trainer"], None]]] = {}
        self.step = self.epoch = 0
        self.last: dict[str, float] = {}
        self.results: dict[str, Any] = {}

    def add_callback(self, event: str, fn: Callable[["Trainer"], None]) -> None:
        self.callbacks.setdefault(event, []).append(fn)

    def trigger(self, event: str) -> None:
        for fn in self.callbacks.get(event, []):
            fn(self)

    # ---- the run -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train, evaluate each epoch, checkpoint; return the final test metrics (main process)."""
        cfg, data = self.config, self.data
        out = Path(cfg.out)
        checkpoint_path = out / CHECKPOINT
        if checkpoint_path.exists() and not cfg.resume:
            raise ValueError(
                f"{out} already holds a checkpoint of an earlier run; pass --resume to continue it, or choose another "
                "--out directory (nothing was overwritten)."
            )
        state = load_checkpoint(checkpoint_path) if cfg.resume else None  # CheckpointError names the fix

        self.dist = dist = setup(cfg.device)
        device = dist.device
        if dist.is_main:
            out.mkdir(parents=True, exist_ok=True)
        log = MetricsLog(out / METRICS, dist.is_main)

        # the global batch is split over processes; every process steps in lockstep
        if cfg.batch_size % dist.world_size:
            raise ValueError(
                f"batch_size={cfg.batch_size} cannot be split over {dist.world_size} processes; use a multiple of "
                f"{dist.world_size} (e.g. --batch-size {cfg.batch_size // dist.world_size * dist.world_size or dist.world_size})."
            )
        per_process = cfg.batch_size // dist.world_size
        model = self.model.to(device)
        converted = bayesify.is_converted(model)
        route = Route(cfg.route)
        self._check_batch_fits_route(model, per_process, route, converted)
        sampler = ResumableBatchSampler(
            len(data.train), per_process, seed=cfg.seed, rank=dist.rank, world_size=dist.world_size
        )
        steps_per_epoch = sampler.batches_per_epoch
        total_steps = cfg.epochs * steps_per_epoch
        if cfg.max_steps is not None:
            total_steps = min(total_steps, cfg.max_steps)

        # optimizer over two parameter groups (weights, rank-1 factors); schedule; fp16 scaler
        optimizer = build_optimizer(
            cfg.optimizer,
            param_groups(model, lr=cfg.lr, fast_weight_lr_multiplier=cfg.fast_weight_lr_multiplier),
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
        )
        schedule = WarmupStepDecay(steps_per_epoch, cfg.warmup_epochs, cfg.decay_epochs, cfg.decay_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        scaler = torch.amp.GradScaler(
            "cpu" if dist.xla else device.type, enabled=str(cfg.precision) == "fp16" and not dist.xla
        )
        kl_epochs = cfg.kl_annealing_epochs if cfg.kl_annealing_epochs is not None else 2 / 3 * cfg.epochs
        objective = Objective(
            num_train=len(data.train),
            l2=cfg.l2,
            kl_annealing_steps=round(kl_epochs * steps_per_epoch),
            likelihood=cfg.likelihood,
            l2_norm_layers=cfg.l2_norm_layers,
        )
        autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(cfg.precision))

        # where to start: fresh, or exactly where the checkpoint left off
        start_batch = 0
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            scaler.load_state_dict(state["scaler"])
            self.step, self.epoch, start_batch = state["step"], state["epoch"], state["batch"]
            log.truncate_after(self.step)
        else:
            torch.manual_seed(cfg.seed + dist.rank)  # posterior noise and component draws differ per process

        train_model = dist.wrap(model)
        if cfg.compile:
            if dist.xla:
                raise ValueError("compile=True is not supported with device='xla' (XLA compiles graphs itself).")
            train_model = torch.compile(train_model)
        # a dedicated generator: creating a loader iterator must not draw from the global RNG
        loader_generator = torch.Generator()
        loader = DataLoader(
            data.train,
            batch_sampler=sampler,
            num_workers=cfg.num_workers,
            pin_memory=device.type == "cuda",
            generator=loader_generator,
        )
        if state is not None:
            # last thing before the loop: nothing may draw in between. One state per process.
            states = state["rng"]
            set_rng_state(states[dist.rank % len(states)])

        from tqdm.auto import tqdm

        show = dist.is_main and cfg.progress is not False
        sums: dict[str, Tensor] = {}
        window_start, window_steps = time.perf_counter(), 0
        done = self.step >= total_steps
        while not done and self.epoch < cfg.epochs:
            sampler.set_epoch(self.epoch, start=start_batch)
            loader_generator.manual_seed(cfg.seed * 1_000_003 + self.epoch)
            model.train()
            bar = tqdm(
                loader,
                desc=f"epoch {self.epoch + 1}/{cfg.epochs}",
                initial=start_batch,
                total=steps_per_epoch,
                disable=(None if cfg.progress is None else False) if show else True,
                leave=False,
            )
            for x, y in bar:
                x = data.normalize(x.to(device, non_blocking=True))
                y = y.to(device, non_blocking=True)
                # forward: route the batch through the components, in mixed precision if asked
                routing = (
                    bayesify.mode(train_model, route, noise=cfg.train_noise) if converted else contextlib.nullcontext()
                )
                precision = (
                    torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
                )
                with routing, precision:
                    logits = train_model(x)
                loss, parts = objective(model, logits, y, self.step)  # labels tiled inside for route="tile"

                # backward and update (fp16: scaled loss; XLA: average gradients across replicas)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                dist.reduce_gradients(optimizer)
                if cfg.grad_clip is not None:
                    scaler.unscale_(optimizer)
                    parts["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).detach()
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                dist.mark_step()
                self.step += 1
                start_batch += 1

                # logging: accumulate on the device, sync only every log_every steps
                for key, value in parts.items():
                    sums[key] = sums.get(key, 0) + value.float().to(device)
                window_steps += 1
                if self.step % cfg.log_every == 0 or self.step == total_steps:
                    seconds = time.perf_counter() - window_start
                    self._log_train(log, sums, window_steps, window_steps * cfg.batch_size / seconds, optimizer)
                    bar.set_postfix(loss=f"{self.last['loss']:.4f}", refresh=False)
                    sums, window_start, window_steps = {}, time.perf_counter(), 0
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self._save(checkpoint_path, model, optimizer, scheduler, scaler, start_batch, steps_per_epoch)
                self.trigger("on_batch_end")
                if self.step >= total_steps:
                    done = True
                    break
            bar.close()

            epoch_complete = start_batch >= steps_per_epoch
            if epoch_complete:
                self.epoch, start_batch = self.epoch + 1, 0
            last = done or self.epoch >= cfg.epochs
            if epoch_complete and ((cfg.eval_every and self.epoch % cfg.eval_every == 0) or last):
                self._evaluate(log, model)
            self._save(checkpoint_path, model, optimizer, scheduler, scaler, start_batch, steps_per_epoch)
            self.trigger("on_epoch_end")

        if not self.results:
            self._evaluate(log, model)
        dist.barrier()
        return self.results

    # ---- pieces of the loop --------------------------------------------------------------------

    def _check_batch_fits_route(self, model: nn.Module, per_process: int, route: Route, converted: bool) -> None:
        # training-mode batch norm needs > 1 row per batch; the tiled route has K rows per example
        rows = per_process * (num_components(model) if converted and route is Route.TILE else 1)
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        if has_bn and rows < 2:
            raise ValueError(
                f"batch_size={self.config.batch_size} gives {per_process} example(s) per process and route="
                f"{route.value!r} runs {rows} row(s) through the model, but its batch norm layers need at least 2 "
                "rows in training; use --batch-size 2 or more per process, or --route tile."
            )

    def _log_train(
        self, log: MetricsLog, sums: dict[str, Tensor], steps: int, examples_per_s: float, optimizer: Any
    ) -> None:
        # means over the last `steps` steps and over processes; .item() here is a device sync point
        means = {key: float(self.dist.all_reduce_mean(value)) / steps for key, value in sums.items()}
        self.last = means
        record = {"kind": "train", "step": self.step, "epoch": self.epoch, **means}
        record["lr"] = optimizer.param_groups[0]["lr"]
        record["examples_per_s"] = round(examples_per_s, 2)
        log.write(record)

    def _evaluate(self, log: MetricsLog, model: nn.Module) -> None:
        if self.dist.is_main:
            results = evaluate(
                model,
                self.data.test,
                samples=self.config.eval_samples,
                device=self.dist.device,
                transform=self.data.normalize,
                members=False,
            )
            self.results = results
            log.write({"kind": "eval", "split": "test", "step": self.step, "epoch": self.epoch,
                       **{k: results[k] for k in ("nll", "accuracy", "ece", "brier")}})  # fmt: skip
        else:
            self.results = {"rank": self.dist.rank}
        self.dist.barrier()

    def _save(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: torch.amp.GradScaler,
        batch: int,
        steps_per_epoch: int,
    ) -> None:
        epoch = self.epoch
        if batch >= steps_per_epoch:  # saved after an epoch's last step: the next one starts fresh
            epoch, batch = epoch + 1, 0
        rng = self._gather_rng()
        if self.dist.is_main:
            state = {
                "model": unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "step": self.step,
                "epoch": epoch,
                "batch": batch,
                "config": self.config.to_dict(),
                "data": {
                    "name": self.data.name,
                    "num_classes": self.data.num_classes,
                    "input_shape": list(self.data.input_shape),
                },  # fmt: skip
                "rng": rng,
            }
            # device-independent file: every tensor on the CPU (GPU / XLA states included)
            state = tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, state)
            save_checkpoint(state, path)
        self.dist.barrier()

    def _gather_rng(self) -> list[dict[str, Any]]:
        """Every process's RNG states (rank order), so that each resumes its own streams."""
        state = rng_state()
        if not self.dist.ddp:
            return [state]
        import torch.distributed as torch_dist

        states: list[Any] = [None] * self.dist.world_size
        torch_dist.all_gather_object(states, state)
        return states
