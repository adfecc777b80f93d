"""The rank-1 BNN training objective, usable on its own in any training loop.

    loss = NLL + kl_scale(t) * sum_layers KL / N_train + l2 * sum ||w||^2

* NLL: the average per-component negative log-likelihood (what works best in the paper;
  ``likelihood="average"``), or the negative log-likelihood of the mixture
  ``-log mean_k p(y | x, k)`` (a tighter bound that generalises worse; ``"mixture"``, needs the
  tiled route). With the tiled route the outputs are ``[K * B, ...]`` member-major and the
  labels are tiled K times to match; with the sampled route (one component per example) the
  outputs are ``[B, ...]``.
* KL of all rank-1 layers, summed over components (reference semantics), divided by the
  number of training examples, scaled by ``kl_scale(t) = min(1, (t + 1) / annealing_steps)``.
* L2 prior on the point-estimated weights (reference ``compute_l2_loss``): kernels, biases and
  (optionally) normalisation-layer parameters; the rank-1 r / s variational parameters are
  excluded. The reference gives each component k its own bias ``b_k``; bayesify stores it as
  ``b + delta_k`` (the shared original bias plus a declared per-component offset, see
  :meth:`~bayesify.layers.ConvertedLayer.rank1_bias_offset`), and the penalty is taken on the
  effective ``b_k``: ``sum_k ||b + delta_k||^2``, exactly the reference's term. That holds for
  every layer family: attention's ``in_proj_bias`` and ``out_proj.bias``, a recurrent layer's
  ``bias_ih + bias_hh`` (one effective bias per component), a GRU's recurrent bias apart.

Example:
    >>> objective = Objective(num_train=len(train_set), l2=1e-4, kl_annealing_steps=1000)
    >>> with bayesify.mode(model, route="tile"):
    ...     logits = model(x)                          # [K*B, classes]
    >>> loss, parts = objective(model, logits, y, step)  # y: [B]; tiled inside

References:
    Dusenberry et al., ICML 2020, Eq. 3-4; reference ``baselines/cifar/rank1_bnn.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bayesify.inspection import NORM_LAYERS, is_converted, model_task, num_components, rank1_layers, rank1_parameters
from bayesify.kl import kl_divergence, kl_scale
from bayesify.mixture import logmeanexp
from bayesify.options import StrOption
from bayesify.predictive.outputs import primary_output
from bayesify.predictive.tasks import Auto, Task, TaskMap, TaskName, resolve_task
from bayesify.sharding import whole

__all__ = [
    "Likelihood",
    "Objective",
    "kl_scale",
    "l2_penalty",
    "training_nll",
    "unwrap",
]


class Likelihood(StrOption):
    """Which likelihood term the objective uses."""

    AVERAGE = "average"
    """mean over components of each component's NLL (reference default; what works best)."""
    MIXTURE = "mixture"
    """-log mean_k p(y | x, k): the mixture's NLL (tighter bound; needs the tiled route)."""


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP / FSDP-style ``.module`` wrappers and ``torch.compile``'s ``_orig_mod``."""
    while True:
        inner = getattr(model, "_orig_mod", None) or (
            model.module if isinstance(getattr(model, "module", None), nn.Module) else None
        )
        if inner is None:
            return model
        model = inner


def training_nll(
    logits: Tensor,
    labels: Tensor,
    *,
    components: int = 1,
    likelihood: Likelihood | str = Likelihood.AVERAGE,
    task: Task | str = TaskName.CLASSIFICATION,
) -> Tensor:
    """The training objective's NLL term for outputs of the tiled (``[K*B, ...]``) or sampled (``[B, ...]``) route.

    (The NLL of the *predictive* mixture, an evaluation metric, is
    :func:`bayesify.evaluation.metrics.negative_log_likelihood`.)

    Args:
        logits: model outputs; ``K * B`` rows member-major (tiled route) or ``B`` rows.
        labels: the ``B`` labels of the batch (tiled here when the outputs are).
        components: K.
        likelihood: ``"average"`` or ``"mixture"``.
        task: what the outputs mean (:mod:`bayesify.predictive.tasks`), which gives ``log p(y | output)``;
            default: class logits (the loss of ``F.cross_entropy``; a one-logit output refuses, naming
            ``task="binary"``).

    Raises:
        ValueError: outputs whose rows are neither B nor K * B, or the mixture likelihood on
            outputs that are not tiled.
    """
    likelihood = Likelihood.parse(likelihood, "likelihood")
    task = resolve_task(task, needed_by="training_nll")
    rows, batch = logits.shape[0], labels.shape[0]
    if rows == batch and not (likelihood is Likelihood.MIXTURE and components > 1):
        return -task.log_likelihood(logits, labels).mean()
    if rows == batch:  # mixture likelihood asked for on a [B] output (before the row check: B rows are right rows)
        raise ValueError(
            f"likelihood='mixture' needs every example through all K={components} components: run the forward pass "
            "with route='tile' (outputs [K*B, ...]), or use likelihood='average' with route='sample'."
        )
    if rows != components * batch:
        raise ValueError(
            f"the model returned {rows} rows for a batch of {batch} labels; with K={components} components the "
            f"sampled route gives {batch} rows and the tiled route {components * batch} (K x B). Run the forward "
            "pass inside bayesify.mode(model, route='tile') or route='sample', or pass the matching labels."
        )
    log_lik = task.log_likelihood(logits, labels.repeat(components, *([1] * (labels.dim() - 1))))  # member-major
    if likelihood is Likelihood.AVERAGE:
        return -log_lik.mean()
    per_member = log_lik.view(components, batch)
    return -logmeanexp(per_member, 0).mean()


def _primary(model: nn.Module, output: object, task: Task) -> tuple[Tensor, Task]:
    """The primary tensor of a model's tuple or dict output (a tuple's first element, a dict's ``logits`` or
    ``out``: as ``bayesify.uncertainty`` reads it) and its task (a task mapping's entry for it)."""
    try:
        tensor, key = primary_output(output)
    except ValueError:
        raise ValueError(
            f"{type(model).__name__} returned a {type(output).__name__}, in which the objective finds no output to "
            "train on (a tensor, a tuple whose first element is the logits, a dict with 'logits'); return the "
            "logits first, or write the training step yourself with bayesify.kl_loss."
        ) from None
    if isinstance(task, TaskMap):
        named = task.for_output(key)
        if named is None:
            raise ValueError(
                f"task={task} names no task for the output {key!r} of {type(model).__name__} that the objective "
                f"trains on; add {key!r} to it."
            )
        task = named
    return tensor, task


def _wide(t: Tensor) -> Tensor:
    # squares summed over millions of entries: at least float32 (a float64 model stays float64)
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def l2_penalty(model: nn.Module, *, norm_layers: bool = True) -> Tensor:
    """``sum ||w||^2`` over the point-estimated parameters (no coefficient).

    Covers every parameter that is not a rank-1 variational parameter (r / s locations and
    scales); normalisation-layer parameters only with ``norm_layers``. The per-component
    biases enter as the effective ``b_k = sum(biases) + delta_k`` of every declared bias offset
    (see the module doc).
    """
    model = unwrap(model)
    skip: set[int] = {id(p) for p in rank1_parameters(model)}
    if not norm_layers:
        for module in model.modules():
            if isinstance(module, NORM_LAYERS):
                skip.update(id(p) for p in module.parameters(recurse=False))
    terms: list[Tensor] = []
    for _, layer in rank1_layers(model):
        for offset, biases in layer.rank1_bias_offsets():
            effective = whole(offset)  # sharded (FSDP): a bias of [out] and a [K, out] offset, gathered
            for bias in biases:
                effective = effective + whole(bias).unsqueeze(0)
            terms.append(_wide(effective).pow(2).sum())
            skip.update(id(b) for b in biases)
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in skip or id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        terms.append(whole(_wide(p).pow(2).sum()))  # sharded: each rank's sum of squares, summed over the ranks
    if not terms:
        p = next(model.parameters(), None)
        return torch.zeros((), device=None if p is None else p.device)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in terms))
    return torch.stack([t.to(terms[0].device, dtype) for t in terms]).sum()


@dataclass
class Objective:
    """``loss = NLL + kl_scale(step) * KL / num_train + l2 * L2``.

    Args:
        num_train: N, the number of training examples (the KL is per example).
        l2: coefficient of the L2 prior on the point-estimated weights (reference 1e-4 / 3e-4).
        kl_annealing_steps: steps over which the KL weight rises linearly to 1 (0: no annealing).
        likelihood: ``"average"`` (per-component NLL, default) or ``"mixture"``.
        l2_norm_layers: include normalisation-layer parameters in the L2 term (CIFAR reference).
        task: what the outputs mean (``log p(y | output)``); default: the model's task
            (:func:`bayesify.inspection.model_task`), else class logits (as :func:`training_nll`).
    """

    num_train: int
    l2: float = 0.0
    kl_annealing_steps: int = 0
    likelihood: Likelihood | str = Likelihood.AVERAGE
    l2_norm_layers: bool = True
    task: Task | str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_train, bool) or not isinstance(self.num_train, int) or self.num_train < 1:
            raise ValueError(f"num_train={self.num_train!r} must be the number of training examples (an int >= 1).")
        if self.l2 < 0:
            raise ValueError(f"l2={self.l2!r} must be >= 0 (reference: 1e-4 CIFAR-10, 3e-4 CIFAR-100).")
        self.likelihood = Likelihood.parse(self.likelihood, "likelihood")
        if self.task is not None:
            self.task = resolve_task(self.task)

    def __call__(
        self, model: nn.Module, logits: Tensor | tuple | dict, labels: Tensor, step: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss and its parts (``nll``, ``kl``, ``kl_scale``, ``l2``, ``loss``; detached).

        Args:
            model: the model (or its DDP / compiled wrapper) that produced ``logits``.
            logits: its output for the batch (``[B, ...]`` or ``[K*B, ...]``; of a tuple or dict output, the first
                element or ``logits``).
            labels: the ``[B]`` labels.
            step: the optimizer step about to be taken (0-based), for the KL annealing.
        """
        inner = unwrap(model)
        k = num_components(inner)
        task = self.task if self.task is not None else model_task(inner)  # (no walk of the model when given)
        if not isinstance(logits, Tensor):  # (logits, features), {"logits": ...}: the output the task is about
            logits, task = _primary(inner, logits, task)
        if isinstance(task, Auto):  # nobody said: the loss users write, F.cross_entropy (refuses a one-logit output)
            task = TaskName.CLASSIFICATION
        nll = training_nll(logits, labels, components=k, likelihood=self.likelihood, task=task)
        loss = nll
        parts: dict[str, Tensor] = {"nll": nll.detach()}
        if k > 1 or is_converted(inner):
            kl = kl_divergence(inner).to(nll.device).float() / self.num_train
            scale = kl_scale(step, self.kl_annealing_steps)
            loss = loss + scale * kl
            parts.update(kl=kl.detach(), kl_scale=torch.tensor(scale))
        if self.l2 > 0:
            l2 = self.l2 * l2_penalty(inner, norm_layers=self.l2_norm_layers).to(nll.device)
            loss = loss + l2
            parts["l2"] = l2.detach()
        parts["loss"] = loss.detach()
        return loss, parts
