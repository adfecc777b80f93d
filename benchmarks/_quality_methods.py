"""The methods compared by ``benchmarks/quality.py``, each through bayesify's public API only.

A method says how to build its model from the task's network, which loss the shared training
loop minimises, which parameters it trains, and how to get member predictions ``[S, B, out]``
for evaluation. Every method is evaluated the same way: from its members.

| key | model | training loss | members at evaluation |
|---|---|---|---|
| ``deterministic`` | the network | NLL | 1 |
| ``temperature`` | the deterministic run, T fitted on the validation split (regression: a variance scale) | - | 1 |
| ``mc-dropout`` | the network with ``nn.Dropout(p)`` after each hidden activation | NLL | 16 stochastic passes |
| ``batchensemble`` | ``bayesify.convert(net, posterior="delta")`` | NLL (sample route) | K = 4 |
| ``rank1`` | ``bayesify.convert(net)``, library defaults | NLL + w(t) KL / N (sample route) | the library's: ``model.eval()``, the K posterior means |
| ``rank1-sampled`` | the ``rank1`` run itself | - | K x M = 4 x 4 samples (``eval_noise=True``) |
| ``rank1-tiled`` | ``bayesify.convert(net)`` | mean over K of NLL (tile route) + w(t) KL / N | K |
| ``rank1-component`` | ``convert(net, sampling="component")``: one draw per component per step, every layer | as ``rank1`` | K |
| ``rank1-example`` | ``convert(net, sampling="example")``: one draw per example, every layer | as ``rank1`` | K |
| ``rank1-reference`` | ``convert(net, prior_std=0.1, init_dropout=1e-3)``: release 0.1's defaults, the reference's values | as ``rank1`` | 4 x 4 samples, as the reference |
| ``rank1-cauchy`` | ``convert(net, posterior="cauchy", prior="cauchy")`` | as ``rank1`` | K |
| ``deep-ensemble`` | K = 4 networks (member 0 is the deterministic run) | NLL each, own init and data order | 4 |
| ``bayesian-torch`` | ``dnn_to_bnn`` mean-field (Reparameterization), prior N(0, 1) | NLL + w(t) KL / N | 16 passes |

w(t) is the linear KL warm-up of the loop (0 to 1 over the first 2/3 of the steps).

Fine-tuning methods (``ft-*``) start from the task's pre-trained network (on the image fine-tuning
tasks: with its new head, the same weights for every method of a seed):

| key | model | training | members at evaluation |
|---|---|---|---|
| ``pretrained`` | the pre-trained net as it is (tasks that keep their head: ``digits-finetune``) | - | 1 |
| ``ft-deterministic`` | the network, every parameter fine-tuned | NLL | 1 |
| ``ft-temperature`` | ``ft-deterministic``'s run, T fitted on the validation split | - | 1 |
| ``ft-laplace`` | laplace-torch's documented default on ``ft-deterministic``'s run: ``Laplace(net, "classification", subset_of_weights="last_layer", hessian_structure="kron")``, ``.fit`` on the fine-tuning split, ``.optimize_prior_precision(method="marglik")`` | - | 1: ``la(x, pred_type="glm", link_approx="probit")`` |
| ``ft-laplace-all`` | the same with ``subset_of_weights="all"`` (full-network KFAC; BatchNorm's scale and shift stay at the fine-tuned values: curvlinops' KFAC has no BatchNorm) | - | 1, the same GLM probit predictive (in chunks of 2 examples: its Jacobians grow with the square of the chunk) |
| ``ft-mc-dropout`` | the pre-trained weights in the network with ``nn.Dropout(p)`` | NLL | 16 stochastic passes |
| ``ft-batchensemble`` | ``bayesify.convert(pretrained, posterior="delta")`` | NLL | K = 4 |
| ``ft-ensemble`` | 4 fine-tunes of the pre-trained net (member 0: ``ft-deterministic``'s run; the others: their own new head and data order) | NLL each | 4 |
| ``ft-rank1`` | ``bayesify.convert(pretrained)``, defaults (identity at init), everything fine-tuned | as ``rank1`` | the library's: ``model.eval()``, the K means |
| ``ft-rank1-spread`` | ``bayesify.convert(pretrained, init="normal", init_mean_std=0.1)``: the K components' means spread N(1, 0.1) at conversion (issue 29's study), everything fine-tuned | as ``rank1`` | K |
| ``ft-rank1-headsign`` | ``ft-rank1``, then only the new head's factor means (``rank1_r.loc``, ``rank1_s.loc``) set to random signs +-1 (p = 0.5, the reference's ``random_sign_init``): K different heads, as an ensemble's (head study) | as ``rank1`` | K |
| ``ft-rank1-headnormal`` | ``ft-rank1``, then only the new head's factor means drawn N(1, 0.5) (head study) | as ``rank1`` | K |
| ``ft-rank1-headsign-initprior`` | ``ft-rank1-headsign``, with each factor's Normal prior centred on its own means after the re-draw (+-1 for the head, 1 elsewhere; the library's is centred on 1): the heads are not pulled back towards 1 (prior study) | NLL + w(t) KL(to those priors) / N | K |
| ``ft-rank1-headnormal-initprior`` | the same for ``ft-rank1-headnormal`` (N(1, 0.5)) | as above | K |
| ``ft-rank1-flr10`` | ``ft-rank1`` with the rank-1 parameters (``bayesify.rank1_parameters``) at 10x the learning rate (lever study) | as ``rank1`` | K |
| ``ft-rank1-prior0.3`` | ``bayesify.convert(pretrained, prior_std=0.3)`` (the default's depth rule gives about 0.13 for the ResNet-8), everything fine-tuned (lever study) | as ``rank1`` | K |
| ``ft-rank1-flr10-prior0.3`` | both: ``prior_std=0.3`` and the rank-1 parameters at 10x the learning rate (lever study) | as ``rank1`` | K |
| ``ft-rank1-tiled`` | ``ft-rank1`` trained in the tiled route (every member on every example, the mean per-component NLL; the reference's layout; K x the step) | mean over K of NLL (tile route) + w(t) KL / N | K |
| ``ft-rank1-sampled`` | the ``ft-rank1`` run itself | - | K x M = 4 x 4 samples |
| ``ft-rank1-factors`` | the adapter: ``convert`` + ``bayesify.freeze_base`` (and the new head trains, where there is one) | as ``rank1`` | K |
| ``ft-rank1-factors-sampled`` | the ``ft-rank1-factors`` run itself | - | 4 x 4 samples |
| ``ft-rank1-factors-x10`` | the adapter with its rank-1 parameters at 10x the learning rate (1e-2 in the plain loop, ``examples/finetune.py``'s rate) | as ``rank1`` | K |

The Laplace rows need ``laplace-torch`` (the ``bench`` extra); where it is missing they are skipped
with a note, as bayesian-torch's are.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import bayesify
from benchmarks._quality_tasks import REGRESSION, Task, head_name

__all__ = [
    "FINETUNE_METHODS", "METHODS", "OPTIONAL_METHODS", "STUDY_METHODS", "Method", "Rank1", "device", "likelihood_loss", "set_device",
]  # fmt: skip

EVAL_SAMPLES = 16  # stochastic passes of MC dropout and bayesian-torch; K x M of rank-1 (4 x 4)
COMPONENTS = 4
LOG_VAR_RANGE = (-12.0, 8.0)
_DEVICE = torch.device("cpu")  # where models train and predict (``--device``); metrics are computed on the CPU


def set_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` (or ``cuda:N``), or ``auto`` (CUDA where available): where models train and predict."""
    global _DEVICE
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = torch.device(name)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here (use --device cpu or auto)")
    _DEVICE = chosen
    return _DEVICE


def device() -> torch.device:
    """The device models train and predict on (see :func:`set_device`)."""
    return _DEVICE


def log_likelihood(outputs: Tensor, y: Tensor, task: Task) -> Tensor:
    """Per-row log-likelihood: log softmax of the label, or a Gaussian (mean, log variance) head's density."""
    if task.kind == REGRESSION:
        mean, log_var = outputs[:, 0], outputs[:, 1].clamp(*LOG_VAR_RANGE)
        return -0.5 * (log_var + (y - mean) ** 2 / log_var.exp() + math.log(2 * math.pi))
    return -F.cross_entropy(outputs, y, reduction="none")


def likelihood_loss(outputs: Tensor, y: Tensor, task: Task) -> Tensor:
    """Mean NLL of a batch: cross-entropy, or Gaussian NLL of a (mean, log variance) head."""
    return -log_likelihood(outputs, y, task).mean()


def _batched(model_fn: Any, x: Tensor, chunk: int = 500) -> Tensor:
    # members [S, B, out], evaluated in chunks of examples to bound memory (tiled batches are S x larger);
    # each chunk runs on the model's device, the members come back to the CPU (where the metrics are computed)
    return torch.cat([model_fn(x[i : i + chunk].to(_DEVICE)).cpu() for i in range(0, len(x), chunk)], dim=1)


@dataclass
class Method:
    """A deterministic network trained on the likelihood (the base for the others)."""

    key: str = "deterministic"
    label: str = "deterministic"
    knob: str | None = None  # the method's own tuning knob (it shares the tuning budget with lr)
    knob_values: tuple[Any, ...] = ()
    builds_on: str | None = None  # a method whose run (and learning rate) this one starts from
    post_hoc: bool = False  # True: fitted after ``builds_on``'s training, no training of its own
    trains: bool = True

    # -- building -----------------------------------------------------------------------------
    def build(self, task: Task, knob: Any, seed: int) -> nn.Module:
        return task.make_net(0.0)

    def parts(self, model: nn.Module) -> list[nn.Module]:
        """The networks the loop trains one after another (a deep ensemble's members)."""
        return [model]

    def param_groups(self, part: nn.Module) -> list[dict[str, Any]]:
        return [{"params": [p for p in part.parameters() if p.requires_grad], "lr_scale": 1.0}]

    def after_training(self, model: nn.Module, task: Task) -> None:
        """Post-hoc fitting on the validation split (temperature scaling)."""

    # -- training and prediction --------------------------------------------------------------
    def loss(
        self, part: nn.Module, x: Tensor, y: Tensor, task: Task, kl_weight: float, step: int = 0, warmup: int = 0
    ) -> Tensor:
        """The training loss of one batch; ``kl_weight`` is the loop's warm-up weight at ``step`` of ``warmup``."""
        return likelihood_loss(part(x), y, task)

    def evaluator_model(self, model: nn.Module) -> tuple[nn.Module, int] | None:
        """``(module, samples)`` whose ``bayesify.evaluation.evaluate`` gives this method's members, or None
        where it cannot (several stochastic passes or networks: MC dropout, ensembles, bayesian-torch)."""
        return model, 1

    def members(self, model: nn.Module, x: Tensor, task: Task) -> Tensor:
        model.eval()
        with torch.no_grad():
            return _batched(lambda v: model(v).unsqueeze(0), x)

    def components(self, model: nn.Module) -> int:
        """Groups of members for the diversity metric (1: none)."""
        return 1

    def num_parameters(self, model: nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())


@dataclass
class Temperature(Method):
    """Temperature scaling (regression: one scale on the predicted std), fitted on the validation split."""

    key: str = "temperature"
    label: str = "deterministic + temperature scaling (regression: std scaling)"
    builds_on: str | None = "deterministic"
    post_hoc: bool = True

    def after_training(self, model: nn.Module, task: Task) -> None:
        with torch.no_grad():
            out = _batched(lambda v: model.eval()(v).unsqueeze(0), task.x_val)[0]
        log_t = torch.zeros((), requires_grad=True)
        optimizer = torch.optim.LBFGS([log_t], lr=0.1, max_iter=200, line_search_fn="strong_wolfe")

        def closure() -> Tensor:
            optimizer.zero_grad()
            loss = likelihood_loss(self._scaled(out, log_t, task), task.y_val, task)
            loss.backward()
            return loss

        optimizer.step(closure)
        model.register_buffer("benchmark_log_temperature", log_t.detach().clone())

    @staticmethod
    def _scaled(out: Tensor, log_t: Tensor, task: Task) -> Tensor:
        if task.kind == REGRESSION:  # the std times T: the log variance plus 2 log T
            return torch.stack([out[:, 0], out[:, 1] + 2 * log_t], dim=1)
        return out / log_t.exp()

    def members(self, model: nn.Module, x: Tensor, task: Task) -> Tensor:
        log_t = model.benchmark_log_temperature
        out = super().members(model, x, task)
        if task.kind == REGRESSION:
            return torch.stack([out[..., 0], out[..., 1] + 2 * log_t], dim=-1)
        return out / log_t.exp()

    def num_parameters(self, model: nn.Module) -> int:
        return super().num_parameters(model) + 1

    def evaluator_model(self, model: nn.Module) -> tuple[nn.Module, int] | None:
        return _Tempered(model, model.benchmark_log_temperature), 1


@dataclass
class MixtureTemperature(Temperature):
    """Temperature scaling of a rank-1 fine-tune's predictive: T on the log of the K members' mixture
    (``model.eval()``'s output; pool, then calibrate), fitted on the validation split."""

    key: str = "ft-rank1-temperature"
    label: str = "rank-1 fine-tune + temperature scaling of its mixture"
    builds_on: str | None = "ft-rank1"

    def evaluator_model(self, model: nn.Module) -> tuple[nn.Module, int] | None:
        return None  # the mixture, tempered, is one member: the benchmark's own metrics


class _Tempered(nn.Module):
    """The network's logits divided by the fitted temperature: a plain classifier for ``evaluate``."""

    def __init__(self, net: nn.Module, log_t: Tensor) -> None:
        super().__init__()
        self.net, self.log_t = net, log_t

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) / self.log_t.exp()


@dataclass
class MCDropout(Method):
    key: str = "mc-dropout"
    label: str = "MC dropout (16 samples)"
    knob: str | None = "p"
    knob_values: tuple[Any, ...] = (0.1, 0.2)

    def build(self, task: Task, knob: Any, seed: int) -> nn.Module:
        return task.make_net(float(knob))

    def members(self, model: nn.Module, x: Tensor, task: Task) -> Tensor:
        model.eval()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.train()  # dropout stays on at evaluation
        with torch.no_grad():
            return _batched(lambda v: torch.stack([model(v) for _ in range(EVAL_SAMPLES)]), x)

    def evaluator_model(self, model: nn.Module) -> tuple[nn.Module, int] | None:
        return None


def _reinit_head_means(head: nn.Module, how: str, seed: int) -> None:
    """Re-draw a converted head's factor means (its K components: K different functions, as an ensemble's heads).

    ``"sign"``: +-1 with probability 0.5 each (the reference's ``random_sign_init``); ``"normal"``: N(1, 0.5).
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for loc in (head.rank1_r.loc, head.rank1_s.loc):
            if how == "sign":
                draw = torch.randint(0, 2, loc.shape, generator=generator).mul(2).sub(1)
            elif how == "normal":
                draw = torch.randn(loc.shape, generator=generator).mul(0.5).add(1)
            else:
                raise ValueError(f"head_means={how!r}: 'sign' or 'normal'")
            loc.copy_(draw.to(loc))


def _kl_to_initial_means(net: nn.Module) -> Tensor:
    """The KL of every Normal factor of ``net`` to a Normal prior of its scale centred on the factor's own means at
    build (``Rank1(prior_at_init=True)``), where the library's prior is centred on the identity for every component."""
    from bayesify.variational.divergence import kl_normal_normal

    return sum(
        kl_normal_normal(factor.loc, factor.scale, initial, factor.options.prior_std).sum()
        for factor, initial in net.__dict__["_prior_locs"]
    )


@dataclass
class Rank1(Method):
    """A converted network trained in the plain loop (public API only).

    ``convert_kwargs`` go to ``bayesify.convert``; ``route="tile"`` trains the paper's layout
    (labels tiled K times, the mean per-component NLL); ``kl_mean_over_components`` divides the
    KL by K as well (the bound on the KL of the uniform mixture, instead of the reference's sum);
    ``factor_lr`` multiplies the learning rate of ``bayesify.rank1_parameters``; ``samples`` is M;
    ``likelihood="mixture"`` (tile route only) trains ``-log mean_k p(y | x, k)`` instead of the
    mean over components of ``-log p(y | x, k)``; ``kl_warmup`` is the KL warm-up's length as a fraction
    of the steps (None: the loop's 2/3); ``head_means`` re-draws a new head's factor means after conversion
    (:func:`_reinit_head_means`; the head study).
    """

    key: str = "rank1"
    label: str = "rank-1 Normal (defaults, sample route)"
    convert_kwargs: dict[str, Any] = field(default_factory=dict)
    route: str = "sample"
    likelihood: str = "average"
    kl_mean_over_components: bool = False
    kl_scale: float = 1.0
    factor_lr: float = 1.0
    samples: int = 4  # M, per component, when evaluation samples
    eval_noise: bool | None = None  # None: the library's default (the K posterior means); True: M samples each
    from_pretrained: bool = False
    factors_only: bool = False
    kl_warmup: float | None = None  # the KL warm-up as a fraction of the steps (None: the loop's, 2/3)
    head_means: str | None = None  # the new head's factor means after conversion: "sign" (+-1), "normal" (N(1, 0.5))
    prior_at_init: bool = False  # each factor's Normal prior centred on its own means after build (the prior study)

    def build(self, task: Task, knob: Any, seed: int) -> nn.Module:
        net = copy.deepcopy(task.pretrained[seed]) if self.from_pretrained else task.make_net(0.0)
        kwargs = dict(self.convert_kwargs)
        if task.loop == "plain":  # the README's drop-in recipe: a custom network says what its output is
            kwargs.setdefault("task", "classification")
        bayesify.convert(net, **kwargs)
        if self.head_means is not None and task.new_head:
            _reinit_head_means(net.get_submodule(head_name(net)), self.head_means, seed)
        if self.prior_at_init:  # the means the prior is centred on: each component's own, as built
            net.__dict__["_prior_locs"] = [
                (factor, factor.loc.detach().clone())
                for module in net.modules() if hasattr(module, "rank1_factors")
                for _, factor in module.rank1_factors()
            ]  # fmt: skip
        if self.factors_only:
            bayesify.freeze_base(net)  # the README's adapter: only the rank-1 parameters train
            if task.new_head:  # a new head was never trained: a frozen random head would predict nothing
                for p in net.get_submodule(head_name(net)).parameters():
                    p.requires_grad_(True)
        return net

    def param_groups(self, part: nn.Module) -> list[dict[str, Any]]:
        factors = {id(p) for p in bayesify.rank1_parameters(part)}
        trainable = [p for p in part.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in trainable if id(p) not in factors], "lr_scale": 1.0},
            {"params": [p for p in trainable if id(p) in factors], "lr_scale": self.factor_lr},
        ]
        return [g for g in groups if g["params"]]

    def loss(
        self, part: nn.Module, x: Tensor, y: Tensor, task: Task, kl_weight: float, step: int = 0, warmup: int = 0
    ) -> Tensor:
        if self.kl_warmup is not None:  # the loop warms up over 2/3 of its steps: rescale to this fraction
            warmup = max(1, round(warmup * 1.5 * self.kl_warmup))
            kl_weight = min(1.0, (step + 1) / warmup)
        plain_kl = self.kl_scale == 1.0 and not self.kl_mean_over_components and not self.prior_at_init
        if task.loop == "plain" and self.route == "sample" and plain_kl:
            # the README's two lines: the plain loss + bayesify.kl_loss with its own warm-up over `warmup` steps
            return F.cross_entropy(part(x), y) + bayesify.kl_loss(part, task.num_train, step=step, warmup_steps=warmup)
        if self.route == "tile":
            k = bayesify.num_components(part)
            with bayesify.mode(part, route="tile"):
                out = part(x)  # [K*B, ...], member-major
            log_lik = log_likelihood(out, y.repeat(k), task).view(k, -1)
            if self.likelihood == "mixture":
                nll = -(torch.logsumexp(log_lik, 0) - math.log(k)).mean()
            else:
                nll = -log_lik.mean()
        else:
            nll = likelihood_loss(part(x), y, task)
        kl = (_kl_to_initial_means(part) if self.prior_at_init else bayesify.kl_divergence(part)) / task.num_train
        if self.kl_mean_over_components:
            kl = kl / bayesify.num_components(part)
        return nll + kl_weight * self.kl_scale * kl

    def members(self, model: nn.Module, x: Tensor, task: Task) -> Tensor:
        samples = self.samples if self.eval_noise and self.convert_kwargs.get("posterior") != "delta" else 1
        return _batched(lambda v: bayesify.predict(model.eval(), v, samples=samples, noise=self.eval_noise), x)

    def components(self, model: nn.Module) -> int:
        return bayesify.num_components(model)

    def evaluator_model(self, model: nn.Module) -> tuple[nn.Module, int] | None:
        if self.eval_noise is False:
            return None  # evaluate() samples when samples > 1 and uses the model's default otherwise
        sampled = self.eval_noise and self.convert_kwargs.get("posterior") != "delta"
        return model, (self.samples if sampled else 1)


@dataclass
class DeepEnsemble(Method):
    key: str = "deep-ensemble"
    label: str = "deep ensemble of 4"
    builds_on: str | None = "deterministic"  # member 0 is the deterministic run of the same seed

    def build(self, task: Task, knob: Any, seed: int) -> nn.Module:
        nets = []
        for k in range(COMPONENTS):
            torch.manual_seed(seed + 1000 * k)  # each member its own initialisation (and data order)
            nets.append(task.make_net(0.0))
        return nn.ModuleList(nets)

    def parts(self, model: nn.Module) -> list[nn.Module]:
        return list(model)

    def members(self, model: nn.Module, x: Tensor, task: Task) -> Tensor:
        model.eval()
        with torch.no_grad():
            return _batched(lambda v: torch.stack([net(v) for net in model]), x)

    def components(self, model: nn.Module) -> int:
        return len(model)

    def evaluator_model(self, model: nn.Module) -> tuple[nn.Module, int] | None:
        return None


@dataclass
class BayesianTorch(Method):
    """bayesian-torch's mean-field conversion (its README's prior: N(0, 1), rho init -3).

    It converts Linear, Conv and LSTM layers; a GRU stays deterministic (only the head is converted).
    """

    key: str = "bayesian-torch"
    label: str = "bayesian-torch mean-field"

    def build(self, task: Task, knob: Any, seed: int) -> nn.Module:
        from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn

        net = task.make_net(0.0)
        for m in net.modules():
            if isinstance(m, nn.Conv1d):  # bayesian-torch 0.5 builds a Conv1d kernel from an int kernel_size only
                m.kernel_size = m.kernel_size[0]
        prior = {
            "prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": -3.0,
            "type": "Reparameterization", "moped_enable": False, "moped_delta": 0.5,
        }  # fmt: skip
        dnn_to_bnn(net, prior)
        return net

    def loss(
        self, part: nn.Module, x: Tensor, y: Tensor, task: Task, kl_weight: float, step: int = 0, warmup: int = 0
    ) -> Tensor:
        from bayesian_torch.models.dnn_to_bnn import get_kl_loss

        return likelihood_loss(part(x), y, task) + kl_weight * get_kl_loss(part) / task.num_train

    def members(self, model: nn.Module, x: Tensor, task: Task) -> Tensor:
        model.eval()
        with torch.no_grad():
            return _batched(lambda v: torch.stack([model(v) for _ in range(EVAL_SAMPLES)]), x)

    def evaluator_model(self, model: nn.Module) -> tuple[nn.Module, int] | None:
        return None


@dataclass
class Pretrained(Method):
    key: str = "pretrained"
    label: str = "pre-trained net, no fine-tuning"
    trains: bool = False

    def build(self, task: Task, knob: Any, seed: int) -> nn.Module:
        return copy.deepcopy(task.pretrained[seed])


@dataclass
class FineTuned(Method):
    key: str = "ft-deterministic"
    label: str = "fine-tuned deterministically"

    def build(self, task: Task, knob: Any, seed: int) -> nn.Module:
        return copy.deepcopy(task.pretrained[seed])


@dataclass
class FineTunedMCDropout(MCDropout):
    """The pre-trained weights in the network with dropout (``nn.Dropout`` and ``nn.Identity`` hold no
    parameters: the state dicts match), fine-tuned with dropout on and evaluated with it on."""

    key: str = "ft-mc-dropout"
    label: str = "fine-tuned with MC dropout (16 samples)"

    def build(self, task: Task, knob: Any, seed: int) -> nn.Module:
        net = task.make_net(float(knob))
        net.load_state_dict(task.pretrained[seed].state_dict())
        return net


@dataclass
class FineTunedEnsemble(DeepEnsemble):
    """4 fine-tunes of the one pre-trained net: what a user with one pre-trained network can ensemble.

    Member 0 is ``ft-deterministic``'s run; the others start from the same weights with a new head of
    their own (where the task has a new head) and their own data order.
    """

    key: str = "ft-ensemble"
    label: str = "ensemble of 4 fine-tunes"
    builds_on: str | None = "ft-deterministic"

    def build(self, task: Task, knob: Any, seed: int) -> nn.Module:
        nets = []
        for k in range(COMPONENTS):
            net = copy.deepcopy(task.pretrained[seed])
            if task.new_head and k > 0:
                torch.manual_seed(seed + 1000 * k)
                net.get_submodule(head_name(net)).reset_parameters()
            nets.append(net)
        return nn.ModuleList(nets)


@dataclass
class Laplace(Method):
    """laplace-torch on the deterministic fine-tune, post hoc: KFAC Hessian on the fine-tuning split, the prior
    precision by marginal likelihood, the GLM predictive with the probit approximation (its documented default).

    ``subset="all"`` is full-network KFAC: BatchNorm's affine parameters are left out (``requires_grad=False``
    on the copy; curvlinops' KFAC supports linear and convolution layers only). Its GLM predictive takes
    the Jacobians of every parameter for a whole chunk at once, so its memory grows with the square of the
    chunk (a chunk of 100 ResNet-8 inputs took 23 GB): ``chunk`` keeps it small.
    """

    key: str = "ft-laplace"
    label: str = "fine-tuned + Laplace (last layer, KFAC, marglik prior; GLM probit)"
    builds_on: str | None = "ft-deterministic"
    post_hoc: bool = True
    subset: str = "last_layer"
    chunk: int = 500

    def after_training(self, model: nn.Module, task: Task) -> None:
        from laplace import Laplace as LaplaceTorch
        from torch.utils.data import DataLoader, TensorDataset

        model.eval()
        if self.subset == "all":
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.requires_grad_(False)
        la = LaplaceTorch(model, "classification", subset_of_weights=self.subset, hessian_structure="kron")
        la.fit(DataLoader(TensorDataset(task.x_train, task.y_train), batch_size=task.batch_size))
        with warnings.catch_warnings():  # "By default `link_approx` is `probit`": it is what members() uses
            warnings.filterwarnings("ignore", message="By default `link_approx`")
            la.optimize_prior_precision(method="marglik")
        model.benchmark_laplace = la  # a plain attribute: the model's parameters are la's

    def members(self, model: nn.Module, x: Tensor, task: Task) -> Tensor:
        la = model.benchmark_laplace

        def predict(v: Tensor) -> Tensor:
            with torch.no_grad():
                probs = la(v, pred_type="glm", link_approx="probit")
            return probs.clamp_min(1e-12).log().unsqueeze(0)  # log-probabilities: their log-softmax is themselves

        return _batched(predict, x, chunk=self.chunk)

    def evaluator_model(self, model: nn.Module) -> tuple[nn.Module, int] | None:
        return None


def _available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _bayesian_torch_available() -> bool:
    return _available("bayesian_torch")


# methods that need a package of the bench extra: key -> the package (skipped with a note where it is missing)
OPTIONAL_METHODS = {"bayesian-torch": "bayesian-torch", "ft-laplace": "laplace-torch", "ft-laplace-all": "laplace-torch"}
# run only when named (--methods): one-off questions, answered in benchmarks/results/
STUDY_METHODS = (
    "ft-rank1-spread", "ft-rank1-headsign", "ft-rank1-headnormal", "ft-rank1-headsign-initprior",
    "ft-rank1-headnormal-initprior",
    "ft-rank1-flr10", "ft-rank1-prior0.3", "ft-rank1-flr10-prior0.3", "ft-rank1-tiled", "ft-rank1-temperature",
)  # fmt: skip


METHODS: list[Method] = [
    Method(),
    Temperature(),
    MCDropout(),
    Rank1(key="batchensemble", label="BatchEnsemble (posterior='delta')", convert_kwargs={"posterior": "delta"}),
    Rank1(),
    Rank1(key="rank1-sampled", label="rank-1 Normal, the same nets evaluated with 4 samples per component",
          eval_noise=True, builds_on="rank1", post_hoc=True),
    Rank1(key="rank1-tiled", label="rank-1 Normal, tiled route (paper)", route="tile"),
    Rank1(key="rank1-component", label="rank-1 Normal, one draw per component per step (sampling='component')",
          convert_kwargs={"sampling": "component"}),
    Rank1(key="rank1-example", label="rank-1 Normal, one draw per example (sampling='example')",
          convert_kwargs={"sampling": "example"}),
    Rank1(key="rank1-reference", label="rank-1 Normal, release 0.1's defaults (prior 0.1, init 0.03, sampled)",
          convert_kwargs={"prior_std": 0.1, "init_dropout": 1e-3}, eval_noise=True),
    Rank1(key="rank1-cauchy", label="rank-1 Cauchy", convert_kwargs={"posterior": "cauchy", "prior": "cauchy"}),
    DeepEnsemble(),
    *([BayesianTorch()] if _bayesian_torch_available() else []),
]

FINETUNE_METHODS: list[Method] = [
    Pretrained(),
    FineTuned(),
    Temperature(key="ft-temperature", label="fine-tuned + temperature scaling", builds_on="ft-deterministic"),
    *([Laplace(),
       Laplace(key="ft-laplace-all", label="fine-tuned + Laplace (all layers, KFAC, marglik prior; GLM probit)",
               subset="all", chunk=2)] if _available("laplace") else []),
    FineTunedMCDropout(),
    Rank1(key="ft-batchensemble", label="BatchEnsemble fine-tune (posterior='delta')",
          convert_kwargs={"posterior": "delta"}, from_pretrained=True),
    FineTunedEnsemble(),
    Rank1(key="ft-rank1", label="rank-1 conversion + fine-tuning (defaults)", from_pretrained=True),
    Rank1(key="ft-rank1-spread", label="rank-1 fine-tune, component means spread at conversion: init='normal', "
          "init_mean_std=0.1", convert_kwargs={"init": "normal", "init_mean_std": 0.1}, from_pretrained=True),
    Rank1(key="ft-rank1-headsign", label="rank-1 fine-tune, the new head's factor means random signs +-1",
          from_pretrained=True, head_means="sign"),
    Rank1(key="ft-rank1-headnormal", label="rank-1 fine-tune, the new head's factor means N(1, 0.5)",
          from_pretrained=True, head_means="normal"),
    Rank1(key="ft-rank1-headsign-initprior", label="rank-1 fine-tune, the new head's factor means random signs +-1, "
          "each factor's prior centred on its own initial means", from_pretrained=True, head_means="sign",
          prior_at_init=True),
    Rank1(key="ft-rank1-headnormal-initprior", label="rank-1 fine-tune, the new head's factor means N(1, 0.5), each "
          "factor's prior centred on its own initial means", from_pretrained=True, head_means="normal",
          prior_at_init=True),
    Rank1(key="ft-rank1-flr10", label="rank-1 fine-tune, rank-1 parameters at 10x the learning rate",
          from_pretrained=True, factor_lr=10.0),
    Rank1(key="ft-rank1-prior0.3", label="rank-1 fine-tune, prior_std=0.3", convert_kwargs={"prior_std": 0.3},
          from_pretrained=True),
    Rank1(key="ft-rank1-flr10-prior0.3", label="rank-1 fine-tune, prior_std=0.3 and rank-1 parameters at 10x the "
          "learning rate", convert_kwargs={"prior_std": 0.3}, from_pretrained=True, factor_lr=10.0),
    Rank1(key="ft-rank1-tiled", label="rank-1 fine-tune, tiled route (the reference's layout: every member sees "
          "every example)", route="tile", from_pretrained=True),
    Rank1(key="ft-rank1-sampled", label="rank-1 fine-tune, the same nets evaluated with 4 samples per component",
          from_pretrained=True, eval_noise=True, builds_on="ft-rank1", post_hoc=True),
    MixtureTemperature(),
    Rank1(key="ft-rank1-factors", label="rank-1 adapter (freeze_base; a new head trains too)", from_pretrained=True,
          factors_only=True),
    Rank1(key="ft-rank1-factors-sampled", label="rank-1 adapter, the same nets evaluated with 4 samples per component",
          from_pretrained=True, factors_only=True, eval_noise=True, builds_on="ft-rank1-factors", post_hoc=True),
    Rank1(key="ft-rank1-factors-x10", label="rank-1 adapter, rank-1 parameters at 10x the learning rate",
          from_pretrained=True, factors_only=True, factor_lr=10.0),
]  # fmt: skip


def method_keys(methods: Iterable[Method]) -> list[str]:
    return [m.key for m in methods]
