"""The trainer: set up, restore in one place, then one loop that reads top to bottom (nanoGPT / minGPT style).

    # one process (CPU or GPU), the tiled route of the paper, 4 components
    bayesify train --model resnet18 --data digits --epochs 2 --route tile --out runs/a
    # two processes on this machine (gloo on CPU, nccl on GPUs); --batch-size is the global batch
    torchrun --standalone --nproc-per-node 2 -m bayesify train --model cnn --data digits --out runs/ddp
    # TPU (or the XLA CPU backend: PJRT_DEVICE=CPU)
    bayesify train --model cnn --data digits --device xla --out runs/xla

From Python::

    config = TrainConfig(model="cnn", data="digits", epochs=5, out="runs/x")
    bundle = load_data(config.data)
    results = Trainer(config, build_model(config, bundle), bundle).run()

Each step: route the batch (``sample``: one random component per example; ``tile``: every
example through all K components, labels tiled to match), compute the
:class:`~bayesify.training.objective.Objective`, step the optimizer and the schedule. Every
``log_every`` steps a line goes to ``OUT/metrics.jsonl``; at the end of each epoch the test set
is evaluated and ``OUT/checkpoint.pt`` is written atomically (also every ``checkpoint_every``
steps). ``resume=True`` restores model, optimizer, schedule, grad scaler, step, epoch, position
in the epoch and the RNG states, and continues as if never interrupted (bitwise on the CPU,
with ``num_workers=0`` or augmentations that draw no randomness in the workers). A run resumed
with more ``epochs`` keeps its learning-rate schedule and its KL annealing (unless it sets
``kl_annealing_epochs``).
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader

import bayesify
from bayesify.evaluation.evaluator import evaluate
from bayesify.inspection import num_components
from bayesify.options import Route
from bayesify.training.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from bayesify.training.config import Precision, Strategy, TrainConfig
from bayesify.training.distributed import Distributed, setup
from bayesify.training.fsdp import shard
from bayesify.training.objective import Objective, unwrap
from bayesify.training.optim import WarmupStepDecay, build_optimizer, param_groups
from bayesify.training.run import CHECKPOINT, METRICS, build_model, load_model_state, run_task, without_start_weights
from bayesify.training.sampler import ResumableBatchSampler
from bayesify.training.sharded_checkpoint import load_sharded, save_sharded
from bayesify.zoo.data import DataBundle, load_data

__all__ = ["Precision", "TrainConfig", "Trainer", "build_model", "train"]

SHARDED_CHECKPOINT = "checkpoint.dcp"  # beside checkpoint.pt, with --strategy fsdp
_AUTOCAST = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
# the metrics logged and printed after each evaluation (those the task has)
_HEADLINE = ("nll", "accuracy", "ece", "brier", "rmse", "calibration_error")


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


@dataclass
class _Run:
    """What the loop works with, built once by :meth:`Trainer._setup`."""

    dist: Distributed
    model: nn.Module  # the model as given (on the device)
    train_model: nn.Module  # what the loop calls: DDP- and / or torch.compile-wrapped
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    objective: Objective
    sampler: ResumableBatchSampler
    loader: DataLoader
    loader_generator: torch.Generator
    log: MetricsLog
    checkpoint: Path
    steps_per_epoch: int
    total_steps: int
    converted: bool

    def epochs_done(self, step: int) -> float:
        """The epochs ``step`` steps make (a log line's ``epoch``: 1.0 at the first epoch's end, 0.33 a third into
        it), as the progress line says them."""
        return round(step / self.steps_per_epoch, 4)


def _kl_annealing_steps(said: float | None, epochs: int, max_steps: int | None, steps_per_epoch: int) -> int:
    """The steps over which the KL weight rises to 1: ``said`` epochs of them, else 2/3 of the run's steps (its
    epochs', or ``max_steps`` where that ends it sooner: 2/3 of ``--epochs 10000 --max-steps 25000`` never reached 1)."""
    if said is not None:
        return round(said * steps_per_epoch)
    total = epochs * steps_per_epoch if max_steps is None else min(epochs * steps_per_epoch, max_steps)
    return round(2 / 3 * total)


class Trainer:
    """Train a (converted) model on a :class:`~bayesify.zoo.data.DataBundle` as ``config`` says.

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
        self.task = run_task(config, data, model)
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
        cfg = self.config
        state = self._checkpoint_to_resume()
        run = self._setup()
        batch = self._restore(run, state) if state is not None else self._start_fresh(run)

        from tqdm.auto import tqdm

        show = run.dist.is_main and cfg.progress is not False
        sums: dict[str, Tensor] = {}
        window_start, window_steps = time.perf_counter(), 0
        done = self.step >= run.total_steps
        while not done and self.epoch < cfg.epochs:
            run.sampler.set_epoch(self.epoch, start=batch)
            run.loader_generator.manual_seed(cfg.seed * 1_000_003 + self.epoch)
            run.model.train()
            bar = tqdm(
                run.loader,
                desc=f"epoch {self.epoch + 1}/{cfg.epochs}",
                initial=batch,
                total=run.steps_per_epoch,
                disable=(None if cfg.progress is None else False) if show else True,
                leave=False,
            )
            for x, y in bar:
                parts = self._train_step(run, x, y)
                self.step += 1
                batch += 1

                # logging: accumulate on the device, sync only every log_every steps
                for key, value in parts.items():
                    sums[key] = sums.get(key, 0) + value.float().to(run.dist.device)
                window_steps += 1
                if self.step % cfg.log_every == 0 or self.step == run.total_steps:
                    seconds = time.perf_counter() - window_start
                    self._log_train(run, sums, window_steps, window_steps * cfg.batch_size / seconds)
                    bar.set_postfix(loss=f"{self.last['loss']:.4f}", refresh=False)
                    sums, window_start, window_steps = {}, time.perf_counter(), 0
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self._save(run, batch)
                self.trigger("on_batch_end")
                if self.step >= run.total_steps:
                    done = True
                    break
            bar.close()

            if batch >= run.steps_per_epoch:  # the epoch is complete
                self.epoch, batch = self.epoch + 1, 0
                if (cfg.eval_every and self.epoch % cfg.eval_every == 0) or done or self.epoch >= cfg.epochs:
                    self._evaluate(run)
            elif done:  # --max-steps ended the run inside an epoch: its results are the model it ends with's
                self._evaluate(run)
            self._save(run, batch)
            self.trigger("on_epoch_end")

        if not self.results:
            self._evaluate(run)
        run.dist.barrier()
        return self.results

    # ---- set-up and restore ------------------------------------------------------------------

    def _checkpoint_to_resume(self) -> dict[str, Any] | None:
        path = Path(self.config.out) / CHECKPOINT
        if path.exists() and not self.config.resume:
            raise ValueError(
                f"{self.config.out} already holds a checkpoint of an earlier run; pass --resume to continue it, or "
                "choose another --out directory (nothing was overwritten)."
            )
        return load_checkpoint(path) if self.config.resume else None  # CheckpointError names the fix

    def _setup(self) -> _Run:
        cfg, data = self.config, self.data
        out = Path(cfg.out)
        self.dist = dist = setup(cfg.device)
        if dist.is_main:
            out.mkdir(parents=True, exist_ok=True)

        per_process = self._per_process_batch(dist)
        model, converted = self._place_model(dist, per_process)
        sampler = ResumableBatchSampler(
            len(data.train), per_process, seed=cfg.seed, rank=dist.rank, world_size=dist.world_size
        )
        steps_per_epoch = sampler.batches_per_epoch
        total_steps = cfg.epochs * steps_per_epoch
        if cfg.max_steps is not None:
            total_steps = min(total_steps, cfg.max_steps)

        optimizer, schedule = self._optimizer(model, steps_per_epoch)
        scaler_device = "cpu" if dist.xla else dist.device.type
        objective = self._objective(steps_per_epoch)
        # a dedicated generator: creating a loader iterator must not draw from the global RNG
        loader_generator = torch.Generator()
        loader = DataLoader(
            data.train,
            batch_sampler=sampler,
            num_workers=cfg.num_workers,
            pin_memory=dist.device.type == "cuda",
            generator=loader_generator,
        )
        return _Run(
            dist=dist,
            model=model,
            train_model=model,  # wrapped once the starting state is in place (see _wrap)
            optimizer=optimizer,
            scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
            scaler=torch.amp.GradScaler(scaler_device, enabled=cfg.precision is Precision.FP16 and not dist.xla),
            objective=objective,
            sampler=sampler,
            loader=loader,
            loader_generator=loader_generator,
            log=MetricsLog(out / METRICS, dist.is_main),
            checkpoint=out / CHECKPOINT,
            steps_per_epoch=steps_per_epoch,
            total_steps=total_steps,
            converted=converted,
        )

    def _per_process_batch(self, dist: Distributed) -> int:
        # the global batch is split over processes; every process steps in lockstep
        cfg = self.config
        if cfg.batch_size % dist.world_size:
            raise ValueError(
                f"batch_size={cfg.batch_size} cannot be split over {dist.world_size} processes; use a multiple of "
                f"{dist.world_size} (e.g. --batch-size {cfg.batch_size // dist.world_size * dist.world_size or dist.world_size})."
            )
        return cfg.batch_size // dist.world_size

    def _place_model(self, dist: Distributed, per_process: int) -> tuple[nn.Module, bool]:
        """The model on this process's device (sharded with FSDP), and whether it is converted."""
        model = self.model.to(dist.device)
        converted = bayesify.is_converted(model)
        if not converted and not self.config.deterministic:
            warnings.warn(
                f"Trainer got a {type(model).__name__} that is not converted: it trains as it is, a deterministic "
                f"network (the config's K={self.config.components} is not used); pass bayesify.convert(model) for a "
                "rank-1 BNN, or deterministic=True to say you mean a baseline.",
                stacklevel=3,
            )
        self._check_batch_fits_route(model, per_process, converted)
        if self.config.strategy is Strategy.FSDP:
            if not dist.ddp:
                raise ValueError(
                    "strategy='fsdp' shards the model over several processes: start with `torchrun --nproc-per-node N "
                    "-m bayesify train ... --strategy fsdp` (one process: drop --strategy fsdp)."
                )
            shard(model)  # before the optimizer: it must hold the sharded Parameters
        return model, converted

    def _optimizer(self, model: nn.Module, steps_per_epoch: int) -> tuple[torch.optim.Optimizer, WarmupStepDecay]:
        # optimizer over param_groups' groups (weights, no-decay, rank-1 factors, other rank-1), and its schedule
        cfg = self.config
        optimizer = build_optimizer(
            cfg.optimizer,
            param_groups(model, lr=cfg.lr, fast_weight_lr_multiplier=cfg.fast_weight_lr_multiplier),
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
        )
        schedule = WarmupStepDecay(steps_per_epoch, cfg.warmup_epochs, cfg.decay_epochs, cfg.decay_ratio)
        return optimizer, schedule

    def _objective(self, steps_per_epoch: int) -> Objective:
        cfg = self.config
        return Objective(
            num_train=len(self.data.train),
            l2=cfg.l2,
            kl_annealing_steps=_kl_annealing_steps(cfg.kl_annealing_epochs, cfg.epochs, cfg.max_steps, steps_per_epoch),
            likelihood=cfg.likelihood,
            l2_norm_layers=cfg.l2_norm_layers,
            task=self.task,
        )

    def _start_fresh(self, run: _Run) -> int:
        torch.manual_seed(self.config.seed + run.dist.rank)  # posterior noise and component draws differ per process
        self._wrap(run)
        return 0

    def _restore(self, run: _Run, state: dict[str, Any]) -> int:
        """Everything a checkpoint holds, back in place; returns the batch to continue from."""
        sharded = self.config.strategy is Strategy.FSDP
        if sharded != ("sharded" in state):
            saved = "fsdp" if "sharded" in state else "ddp"
            raise ValueError(
                f"{run.checkpoint} was written with --strategy {saved}; resume it with --strategy {saved} "
                f"(its optimizer state is {'in ' + state['sharded'] if saved == 'fsdp' else 'one whole state'})."
            )
        if not sharded:  # (a model whose code changed since the run trained: named in one line, before the optimizer)
            load_model_state(run.model, state["model"], self.config, run.checkpoint)
        try:
            if sharded:  # model and optimizer from the distributed checkpoint, resharded to this run's processes
                load_sharded(run.checkpoint.with_name(state["sharded"]), run.model, run.optimizer)
            else:
                run.optimizer.load_state_dict(state["optimizer"])
        except ValueError as error:  # other groups: a checkpoint of an earlier release, or --adapter changed
            groups = ", ".join(g["name"] for g in run.optimizer.param_groups)
            raise ValueError(
                f"the optimizer state in {run.checkpoint} does not fit this run's parameter groups ({groups}): "
                f"{error}; it was written by an earlier bayesify release or with other trainable parameters "
                "(--adapter); resume with the run's own settings, or start a new run in another --out."
            ) from None
        run.scheduler.load_state_dict(state["scheduler"])  # the run's learning-rate schedule (its epochs) comes back
        run.scaler.load_state_dict(state["scaler"])
        saved = state.get("config") or {}
        if self.config.kl_annealing_epochs is None and "epochs" in saved:
            # and so does its KL annealing, unless this run sets one: 2/3 of a longer --epochs would take the weight
            # of a run already at 1 back down (a 2-epoch run resumed with --epochs 4: 1.0 -> 0.77)
            run.objective.kl_annealing_steps = _kl_annealing_steps(
                saved.get("kl_annealing_epochs"), saved["epochs"], saved.get("max_steps"), run.steps_per_epoch
            )
        self.step, self.epoch = state["step"], state["epoch"]
        run.log.truncate_after(self.step)
        self._wrap(run)
        # last thing before the loop: nothing may draw in between. One state per process.
        states = state["rng"]
        set_rng_state(states[run.dist.rank % len(states)])
        return state["batch"]

    def _wrap(self, run: _Run) -> None:
        # a sharded model is its own data-parallel wrapper (FSDP averages the gradients)
        run.train_model = run.model if self.config.strategy is Strategy.FSDP else run.dist.wrap(run.model)
        if self.config.compile:
            if run.dist.xla:
                raise ValueError("compile=True is not supported with device='xla' (XLA compiles graphs itself).")
            run.train_model = torch.compile(run.train_model)
        elif self.config.compile is None and _compiles_by_default(run.dist.device, self.config.strategy):
            run.train_model = torch.compile(run.train_model)

    def _check_batch_fits_route(self, model: nn.Module, per_process: int, converted: bool) -> None:
        # training-mode batch norm needs > 1 row per batch; the tiled route has K rows per example
        route = self.config.route
        rows = per_process * (num_components(model) if converted and route is Route.TILE else 1)
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        if has_bn and rows < 2:
            raise ValueError(
                f"batch_size={self.config.batch_size} gives {per_process} example(s) per process and route="
                f"{route.value!r} runs {rows} row(s) through the model, but its batch norm layers need at least 2 "
                "rows in training; use --batch-size 2 or more per process, or --route tile."
            )

    # ---- pieces of the loop --------------------------------------------------------------------

    def _train_step(self, run: _Run, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """One optimizer step on a batch; returns the loss parts (detached, on the device)."""
        cfg, device = self.config, run.dist.device
        x = self.data.normalize(x.to(device, non_blocking=True))
        y = y.to(device, non_blocking=True)
        # forward: route the batch through the components, in mixed precision if asked
        routing = bayesify.mode(run.train_model, cfg.route, noise=cfg.train_noise) if run.converted else contextlib.nullcontext()
        dtype = _AUTOCAST.get(cfg.precision)
        precision = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with routing, precision:
            logits = run.train_model(x)
        loss, parts = run.objective(run.model, logits, y, self.step)  # labels tiled inside for route="tile"

        # backward and update (fp16: scaled loss; XLA: average gradients across replicas)
        run.optimizer.zero_grad(set_to_none=True)
        run.scaler.scale(loss).backward()
        run.dist.reduce_gradients(run.optimizer)
        if cfg.grad_clip is not None:
            run.scaler.unscale_(run.optimizer)
            parts["grad_norm"] = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip).detach()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.scheduler.step()
        run.dist.mark_step()
        return parts

    def _log_train(self, run: _Run, sums: dict[str, Tensor], steps: int, examples_per_s: float) -> None:
        # means over the last `steps` steps and over processes; .item() here is a device sync point
        means = {key: float(run.dist.all_reduce_mean(value)) / steps for key, value in sums.items()}
        self.last = means
        # "steps": how many steps the means are over (log_every, fewer for the first line after a --resume that did
        # not stop on a multiple of it)
        record = {"kind": "train", "step": self.step, "epoch": run.epochs_done(self.step), "steps": steps, **means}
        group = run.optimizer.param_groups[0]  # the base rate now (group 0 may have a multiplier, e.g. an adapter's)
        record["lr"] = self.config.lr * group["lr"] / group["initial_lr"]
        record["examples_per_s"] = round(examples_per_s, 2)
        run.log.write(record)

    def _evaluate(self, run: _Run) -> None:
        # a sharded model runs only with every process (each forward pass gathers the shards): all evaluate
        sharded = self.config.strategy is Strategy.FSDP
        if run.dist.is_main or sharded:
            results = evaluate(
                run.model,
                self.data.test,
                samples=self.config.eval_samples,
                device=run.dist.device,
                transform=self.data.normalize,
                members=False,
                task=self.task,
            )
            if not run.dist.is_main:
                self.results = {"rank": run.dist.rank}
                run.dist.barrier()
                return
            self.results = results
            metrics = {k: results[k] for k in _HEADLINE if isinstance(results.get(k), float)}
            run.log.write({"kind": "eval", "split": "test", "step": self.step, "epoch": run.epochs_done(self.step), **metrics})
            if self.config.progress is not False:
                shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
                # a run that --max-steps ends inside an epoch has done a fraction of it: say so, not "epoch 0"
                done = self.step / run.steps_per_epoch
                epochs = f"{done:.0f}" if done == int(done) else f"{done:.2f}"
                print(f"epoch {epochs}/{self.config.epochs} step {self.step}: test {shown}", flush=True)
        else:
            self.results = {"rank": run.dist.rank}
        run.dist.barrier()

    def _save(self, run: _Run, batch: int) -> None:
        epoch = self.epoch
        if batch >= run.steps_per_epoch:  # saved after an epoch's last step: the next one starts fresh
            epoch, batch = epoch + 1, 0
        rng = self._gather_rng(run.dist)
        sharded: dict[str, Any] = {}
        if self.config.strategy is Strategy.FSDP:
            # model and optimizer as a distributed checkpoint (each process its shards); the whole model also
            # in checkpoint.pt, gathered on the CPU of process 0, for `bayesify evaluate`, merge and export
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            save_sharded(run.checkpoint.with_name(SHARDED_CHECKPOINT), run.model, run.optimizer)
            full = get_model_state_dict(run.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            sharded = {"model": full, "optimizer": {}, "sharded": SHARDED_CHECKPOINT}
        if run.dist.is_main:
            whole = sharded or {"model": unwrap(run.model).state_dict(), "optimizer": run.optimizer.state_dict()}
            state = {
                **whole,
                "scheduler": run.scheduler.state_dict(),
                "scaler": run.scaler.state_dict(),
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
            save_checkpoint(state, run.checkpoint)
        run.dist.barrier()

    @staticmethod
    def _gather_rng(dist: Distributed) -> list[dict[str, Any]]:
        """Every process's RNG states (rank order), so that each resumes its own streams."""
        state = rng_state()
        if not dist.ddp:
            return [state]
        import torch.distributed as torch_dist

        states: list[Any] = [None] * dist.world_size
        torch_dist.all_gather_object(states, state)
        return states


def train(config: TrainConfig, *, download: bool = False) -> dict[str, Any]:
    """Load the data, build the model and train it (a resumed run takes its weights from the checkpoint)."""
    bundle = load_data(config.data, config.data_dir, download=download, seed=0)
    model = build_model(without_start_weights(config) if config.resume else config, bundle)
    try:
        return Trainer(config, model, bundle).run()
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _compiles_by_default(device: torch.device, strategy: Strategy) -> bool:
    """``compile=None``: the training step is compiled on CUDA, where fusion pays (the rank-1 step's extra work is
    elementwise passes over activations and small launches); not on the CPU (measured: within a few percent of
    eager), XLA (compiles its own graphs) or under FSDP2 (not tested compiled here)."""
    return device.type == "cuda" and strategy is not Strategy.FSDP
