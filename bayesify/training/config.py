"""``TrainConfig``: everything a training run needs, saved in its checkpoint.

A ``TrainConfig`` *is* a :class:`~bayesify.Rank1Config` (the conversion options, declared once
there) plus the training options below; ``config.rank1`` is the conversion part alone. Every
field has a one-line help, from which ``bayesify train`` generates its flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bayesify.config import Rank1Config
from bayesify.options import Route, StrOption, option
from bayesify.training.objective import Likelihood
from bayesify.training.optim import OptimizerName

__all__ = ["Precision", "Strategy", "TrainConfig"]


class Precision(StrOption):
    """Numeric precision of the forward pass."""

    FP32 = "32"
    """float32 throughout."""
    BF16 = "bf16"
    """bfloat16 autocast (CPU, recent GPUs, TPU); no loss scaling needed."""
    FP16 = "fp16"
    """float16 autocast with a GradScaler (GPUs)."""


class Strategy(StrOption):
    """How many processes (``torchrun --nproc-per-node N``) share the model."""

    DDP = "ddp"
    """Every process holds the whole model; gradients are averaged (DistributedDataParallel)."""
    FSDP = "fsdp"
    """The model is sharded over the processes (FSDP2 ``fully_shard`` of its blocks and root): for models larger
    than one device. Checkpoints are distributed (``checkpoint.dcp``) and resume on any number of processes."""


# conversion options a checkpoint of release 0.1 stored flat, and how they read now
_LEGACY_DETERMINISTIC = 0  # components=0 meant "train the network as it is"


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Rank1Config):
    """The settings of one run: the conversion options (inherited from ``Rank1Config``) and these.

    Example:
        >>> config = TrainConfig(model="cnn", data="digits", epochs=5, out="runs/x", prior_std=0.05)
        >>> bundle = load_data(config.data)
        >>> results = Trainer(config, build_model(config, bundle), bundle).run()
    """

    # what to train (names resolved by bayesify.zoo.models.create_model / bayesify.zoo.data.load_data)
    model: str = option("cnn", "built-in (cnn, cnn1d, mlp), timm or torchvision name, or package.module:factory")
    data: str = option("digits", "digits, mnist1d, breast-cancer, diabetes, fashion-mnist, mnist, cifar10, cifar100, or folder:PATH")
    data_dir: str | None = option(None, "where torchvision data sets are ((Fashion-)MNIST: make data; CIFAR)")
    pretrained: bool = option(False, "start from the library's pretrained weights (offline: --weights FILE)")
    weights: str | None = option(None, "start from the weights in FILE (a torch.save'd state_dict or .safetensors)")
    adapter: bool = option(False, "train only the rank-1 parameters on the frozen (pretrained) network")
    deterministic: bool = option(False, "train the network as it is, without converting it (a baseline)")
    # objective
    route: Route = option(Route.SAMPLE, "sample: one component per example (~1x cost); tile: every example through all K (the paper)")
    likelihood: Likelihood = option(Likelihood.AVERAGE, "average: per-component NLL; mixture: -log mean_k p (needs --route tile)")
    l2: float = option(1e-4, "L2 prior coefficient on the point-estimated weights (reference 1e-4)")
    l2_norm_layers: bool = option(True, "include normalisation layers in the L2 term (CIFAR reference)")
    kl_annealing_epochs: float | None = option(
        None, "epochs over which the KL weight rises to 1 (default: 2/3 of training, of --max-steps where that ends it "
        "sooner; a resumed run keeps its own)"
    )
    train_noise: bool = option(True, "sample r, s during training (off: posterior means, e.g. for tests)")
    # optimisation
    optimizer: OptimizerName = option(OptimizerName.ADAM, "sgd (Nesterov momentum; CIFAR/ImageNet), adam (MIMIC), adamw")
    lr: float = option(1e-3, "learning rate")
    momentum: float = option(0.9, "SGD momentum")
    nesterov: bool = option(True, "Nesterov momentum for SGD")
    fast_weight_lr_multiplier: float = option(1.0, "learning-rate multiplier of the rank-1 r / s parameters")
    warmup_epochs: float = option(0.0, "linear learning-rate warm-up")
    decay_epochs: tuple[float, ...] = option((), "epochs at which the learning rate decays, e.g. 80,160,180")
    decay_ratio: float = option(0.2, "learning-rate factor at each decay epoch")
    grad_clip: float | None = option(None, "max global gradient norm")
    epochs: int = option(10, "epochs")
    max_steps: int | None = option(None, "stop after this many optimizer steps (e.g. MIMIC's 25k)")
    batch_size: int = option(64, "unique examples per step, all processes together (tiled K times by --route tile)")
    # evaluation during training
    eval_samples: int = option(1, "posterior samples per component at evaluation")
    eval_every: int = option(1, "epochs between test-set evaluations (0: only at the end)")
    # system
    device: str = option("auto", "auto, cpu, cuda, cuda:N, xla")
    strategy: Strategy = option(Strategy.DDP, "with torchrun: ddp (a whole model per process) or fsdp (sharded over the processes)")
    precision: Precision = option(Precision.FP32, "32, bf16 (autocast) or fp16 (autocast + GradScaler)")
    compile: bool | None = option(
        None,
        "torch.compile the training step; default: on CUDA (where fusing the rank-1 scalings into their neighbours "
        "pays), off on the CPU (measured: barely faster) and XLA (which compiles graphs itself); --no-compile turns it off",
    )
    num_workers: int = option(0, "data loader worker processes")
    seed: int = option(0, "seed of the initialisation, the data order and the posterior noise")
    log_every: int = option(10, "steps between lines in metrics.jsonl")
    checkpoint_every: int = option(0, "steps between checkpoints (0: at the end of each epoch only)")
    out: str = option("runs/default", "run directory: metrics.jsonl, checkpoint.pt, reports")
    resume: bool = option(False, "continue the run in --out")
    progress: bool | None = option(None, "progress bars and per-epoch lines (default: bars only on a terminal)")

    def __post_init__(self) -> None:
        if self.components == _LEGACY_DETERMINISTIC and not isinstance(self.components, bool):
            raise ValueError(
                "components=0 is not a number of mixture components; to train the network as it is, pass "
                "deterministic=True (--deterministic)."
            )
        super().__post_init__()
        object.__setattr__(self, "decay_epochs", tuple(float(e) for e in self.decay_epochs))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """A config from :meth:`to_dict`'s output (a checkpoint's ``config``), earlier releases' included."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in known}
        if kwargs.get("components") == _LEGACY_DETERMINISTIC:  # release 0.1: components=0 was the baseline
            kwargs["components"], kwargs["deterministic"] = Rank1Config.components, True
        if "decay_epochs" in kwargs:
            kwargs["decay_epochs"] = tuple(kwargs["decay_epochs"])
        return cls(**kwargs)

    def validate(self) -> None:
        """Raise a ValueError naming the first bad value and its fix (beyond what construction checks)."""
        if self.route not in (Route.SAMPLE, Route.TILE):
            raise ValueError(f"route={str(self.route)!r} must be 'sample' or 'tile' for training.")
        if self.likelihood is Likelihood.MIXTURE and self.route is Route.SAMPLE and not self.deterministic:
            raise ValueError(
                "likelihood='mixture' needs every example through all components: use --route tile "
                "(or --likelihood average with --route sample)."
            )
        for name in ("epochs", "batch_size", "log_every", "eval_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1.")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps!r} must be >= 1 (or None: run all epochs).")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0.")
        if list(self.decay_epochs) != sorted(self.decay_epochs):
            fix = ",".join(f"{e:g}" for e in sorted(self.decay_epochs))
            raise ValueError(
                f"decay_epochs={self.decay_epochs!r} must be in increasing order: the k-th decays the rate to "
                f"decay_ratio**k (e.g. --decay-epochs {fix})."
            )
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip={self.grad_clip!r} must be > 0 (or None: no clipping).")
        if self.pretrained and self.weights is not None:
            raise ValueError(f"pass --pretrained or --weights {self.weights}, not both (each sets the start weights).")
        if self.strategy is Strategy.FSDP:
            if str(self.device).startswith("xla"):
                raise ValueError("strategy='fsdp' does not run on XLA (FSDP2 is CUDA / CPU); use --strategy ddp with --device xla.")
            if self.deterministic:
                raise ValueError("strategy='fsdp' shards a converted model; drop --deterministic, or use --strategy ddp.")
            if self.precision is Precision.FP16:
                raise ValueError("precision='fp16' needs a sharded grad scaler, which --strategy fsdp does not set up; use --precision bf16 (or 32).")
            if self.compile:
                raise ValueError("compile=True with strategy='fsdp' is untested here; drop --compile, or use --strategy ddp.")
        if self.adapter and self.deterministic:
            raise ValueError("--adapter trains the rank-1 parameters, which --deterministic does not add; drop one.")
        if self.adapter and not (self.pretrained or self.weights is not None):
            raise ValueError(
                "--adapter freezes the network's own weights, which here are random; start from trained ones with "
                "--pretrained or --weights FILE (or drop --adapter to train everything)."
            )
