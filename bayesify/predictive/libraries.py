"""What the outputs of models from timm, torchvision and Hugging Face mean, asked of the model itself.

bayesify knows these libraries without importing them (a library not loaded cannot have made the
model): :func:`infer_task` reads what a model states about its output, and
:func:`huggingface_loss` recomputes a Hugging Face model's ``loss`` with the model's own loss
function. Everything bayesify knows of these libraries' outputs is in this file.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from bayesify.predictive.tasks import Classification, Members, MultiLabel, Regression, Task, TaskMap

__all__ = ["HuggingFaceTask", "huggingface_loss", "infer_task"]

def _defined_in(model: nn.Module, *packages: str) -> bool:
    module = type(model).__module__ or ""
    return any(module == p or module.startswith(p + ".") for p in packages)


def _class_named(module_name: str, *names: str) -> tuple[type, ...]:
    module = sys.modules.get(module_name)
    return tuple(c for c in (getattr(module, n, None) for n in names) if isinstance(c, type))


# torch modules whose outputs are features or states, never logits: their mixture is the members' mean
_FEATURE_MODULES = (
    nn.RNNBase,
    nn.RNNCellBase,
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.Transformer,
)


def infer_task(model: nn.Module) -> Task | None:
    """The task a model states about its own output, or None when it states nothing.

    * Hugging Face ``PreTrainedModel``: :class:`HuggingFaceTask` (``logits`` by ``config.problem_type``
      and the head; the ``loss`` recomputed from the mixture).
    * torchvision segmentation (FCN, DeepLabV3, LRASPP): ``{"out", "aux"}`` class logits at axis 1.
    * torchvision detection (Faster / Mask / Keypoint R-CNN, RetinaNet, FCOS, SSD): :class:`Members`
      (boxes of different members cannot be averaged; see :func:`bayesify.detection.fuse_detections`).
    * a timm model with ``num_classes > 0`` or a torchvision classifier: :class:`Classification` (-1).
    * a torch recurrent, attention or transformer module used as the model: :class:`Regression` (its
      outputs are features and states; the mixture is their mean).
    """
    hf = _huggingface_task(model)
    if hf is not None:
        return hf
    segmentation = _class_named("torchvision.models.segmentation.fcn", "FCN") + _class_named(
        "torchvision.models.segmentation.deeplabv3", "DeepLabV3"
    ) + _class_named("torchvision.models.segmentation.lraspp", "LRASPP")
    if segmentation and isinstance(model, segmentation):
        return TaskMap((("out", Classification(1)), ("aux", Classification(1))))
    detection = (
        _class_named("torchvision.models.detection.generalized_rcnn", "GeneralizedRCNN")
        + _class_named("torchvision.models.detection.retinanet", "RetinaNet")
        + _class_named("torchvision.models.detection.fcos", "FCOS")
        + _class_named("torchvision.models.detection.ssd", "SSD")
    )
    if detection and isinstance(model, detection):
        return Members()
    if isinstance(model, _FEATURE_MODULES):
        return Regression()  # a recurrent / attention / transformer module used as the model: its features, averaged
    if _defined_in(model, "timm.models") and isinstance(getattr(model, "num_classes", None), int):
        return Classification(-1) if model.num_classes > 0 else None
    if _defined_in(model, "torchvision.models") and not _defined_in(
        model, "torchvision.models.detection", "torchvision.models.segmentation", "torchvision.models.optical_flow"
    ):
        return Classification(-1)
    return None


@dataclass(frozen=True)
class HuggingFaceTask(TaskMap):
    """A Hugging Face model's outputs: ``logits`` by the head and ``config.problem_type``; the ``loss``
    recomputed from the mixture's logits when labels are given (the predictive NLL, not the members'
    mean loss); other floating-point outputs (hidden states, attentions) averaged; the KV cache kept
    with its K * B rows (so ``generate`` continues every member)."""

    rest: str = "mean"
    recompute_loss: bool = True

    def recomputes(self, key: Any) -> bool:
        return self.recompute_loss and key == "loss"

    def finish(self, model: Any, reduced: list[tuple[Any, object]], inputs: dict) -> list[object]:
        """The ``loss``: the model's own loss function on the mixture's logits (the predictive NLL)."""
        if not self.recompute_loss or all(key != "loss" for key, _ in reduced):
            return super().finish(model, reduced, inputs)
        logits = next((value for key, value in reduced if key == "logits"), None)
        labels = inputs.get("labels") if isinstance(inputs.get("labels"), Tensor) else None
        return [huggingface_loss(model, logits, labels) if key == "loss" else value for key, value in reduced]


def _huggingface_task(model: nn.Module) -> Task | None:
    module = sys.modules.get("transformers")
    base = getattr(module, "PreTrainedModel", None)
    if base is None or not isinstance(model, base):
        return None
    config = model.config
    kind = type(model).__name__
    problem = getattr(config, "problem_type", None)
    if problem == "multi_label_classification":
        logits: Task = MultiLabel()
    elif problem == "regression" or ("ForSequenceClassification" in kind and getattr(config, "num_labels", 2) == 1):
        logits = Regression()
    else:
        logits = Classification(-1)  # causal / masked LM, token and single-label sequence classification
    return HuggingFaceTask((("logits", logits),))


def huggingface_loss(model: nn.Module, logits: Tensor | None, labels: Tensor | None) -> Tensor | None:
    """The model's own loss function on the mixture's logits (the predictive NLL); None without labels."""
    if logits is None or labels is None:
        return None
    loss_function = getattr(model, "loss_function", None)
    if loss_function is None:
        return None
    config = model.config
    return loss_function(
        logits=logits, pooled_logits=logits, labels=labels, vocab_size=getattr(config, "vocab_size", None), config=config
    )
