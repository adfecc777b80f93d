"""What the outputs of models from timm, torchvision and Hugging Face mean, asked of the model itself.

bayesify knows these libraries without importing them (a library not loaded cannot have made the
model): :func:`infer_task` reads what a model states about its output, and
:func:`huggingface_loss` recomputes a Hugging Face model's ``loss`` with the model's own loss
function. Everything bayesify knows of these libraries' outputs is in this file.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayesify.predictive.tasks import (
    Auto,
    Binary,
    Classification,
    CustomTask,
    Members,
    MultiLabel,
    Regression,
    Task,
    TaskMap,
)  # fmt: skip

__all__ = [
    "PAIRWISE_OUTPUTS", "WEIGHT_AS_IS", "HuggingFaceTask", "huggingface_loss", "infer_task", "padding_targets",
    "predicts_next_token", "said_of_model", "tower_batches", "with_decoder_inputs",
]

# Hugging Face outputs that pair the batch's examples with each other (a contrastive image-text model's similarity
# matrices: CLIP, SigLIP, ALIGN): [B, B] of the model, [M*B, M*B] of a tiled pass (predictive/outputs.py takes each
# member's own block)
PAIRWISE_OUTPUTS = frozenset({"logits_per_image", "logits_per_text"})

# forwards of other libraries' layer subclasses known to apply their weight as it is, so that a folded weight is the
# member (merge), by (module, qualified name), not imported: timm's Conv2dSame pads the input as TensorFlow's "SAME"
# does, then F.conv2d(x, self.weight, ...) (the tf_* models' convolutions)
WEIGHT_AS_IS = frozenset({("timm.layers.conv2d_same", "Conv2dSame.forward")})

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


def _timm_classes(model: nn.Module) -> int:
    """A timm classifier's number of classes: its head's width (``get_classifier()``, a head assigned in place,
    ``model.fc = nn.Linear(512, 5)`` or a ``Sequential`` ending in one, which leaves timm's ``num_classes`` as it
    was: its last Linear's), else ``num_classes``."""
    get_classifier = getattr(model, "get_classifier", None)
    try:
        head = get_classifier() if callable(get_classifier) else None
    except (AttributeError, NotImplementedError, TypeError):  # (a model of timm's whose head is not one module)
        head = None
    width = getattr(head, "out_features", None) if isinstance(head, nn.Module) else None
    if width is None and isinstance(head, nn.Module):  # a head of several modules (dropout and a Linear, an MLP)
        linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
        width = linears[-1].out_features if linears else None
    return width if isinstance(width, int) and width > 0 else model.num_classes


def infer_task(model: nn.Module) -> Task | None:
    """The task a model states about its own output, or None when it states nothing.

    * Hugging Face ``PreTrainedModel``: :class:`HuggingFaceTask` (``logits`` by ``config.problem_type``
      and the head; the ``loss`` recomputed from the mixture).
    * torchvision segmentation (FCN, DeepLabV3, LRASPP): ``{"out", "aux"}`` class logits at axis 1.
    * torchvision detection (Faster / Mask / Keypoint R-CNN, RetinaNet, FCOS, SSD): :class:`Members`
      (boxes of different members cannot be averaged; see :func:`bayesify.detection.fuse_detections`).
    * a timm model with ``num_classes > 0`` or a torchvision classifier: :class:`Classification` (-1; with the
      number of classes the model states, which an output's class axis must match: timm's head's width, else its
      ``num_classes``; a torchvision classifier's head, its last ``Linear``).
    * a torch recurrent, attention or transformer module used as the model: :class:`Regression` (its
      outputs are features and states; the mixture is their mean).
    * a peft wrapper (``get_peft_model``): its model's.
    """
    hf = _huggingface_task(model)
    if hf is not None:
        return hf
    if _defined_in(model, "peft") and callable(getattr(model, "get_base_model", None)):
        inner = model.get_base_model()  # a peft wrapper of another library's model (timm's): its output is the model's
        if isinstance(inner, nn.Module) and inner is not model:
            return infer_task(inner)
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
        return Classification(-1, _timm_classes(model)) if model.num_classes > 0 else None
    if _defined_in(model, "torchvision.models") and not _defined_in(
        model, "torchvision.models.detection", "torchvision.models.segmentation", "torchvision.models.optical_flow"
    ):
        classes = _torchvision_classes(model)
        return None if classes == 0 else Classification(-1, classes)
    return None


_TORCHVISION_HEADS = ("fc", "classifier", "heads", "head")  # ResNet / RegNet; VGG / MobileNet / ConvNeXt; ViT; Swin


def _torchvision_classes(model: nn.Module) -> int | None:
    """The number of classes a torchvision classifier's head gives: its last Linear's outputs (SqueezeNet's: a 1x1
    convolution's, then a ReLU and a pooling); 0 where the head was removed (``model.fc = nn.Identity()``, the usual
    way to take embeddings, or its last Linear cut off: ``classifier[-1] = nn.Identity()``, ``classifier[:-1]``,
    which leaves a hidden Linear of MobileNetV3 or VGG last but one): features, which the model no longer states to
    be logits; None where no head is found."""
    for name in _TORCHVISION_HEADS:
        head = getattr(model, name, None)
        if not isinstance(head, nn.Module):
            continue
        order = list(head.modules())
        maps = [i for i, m in enumerate(order) if isinstance(m, (nn.Linear, nn.Conv2d))]
        if not maps:
            return 0
        last = order[maps[-1]]
        inner = {id(m) for m in last.modules()}  # (a converted layer's factors are modules of their own)
        if isinstance(last, nn.Linear) and any(
            id(m) not in inner and next(m.children(), None) is None for m in order[maps[-1] + 1 :]
        ):
            return 0  # a module after the last Linear: the classes' Linear was taken off, a hidden one is left
        return last.out_features if isinstance(last, nn.Linear) else last.out_channels
    return None


@dataclass(frozen=True)
class HuggingFaceTask(TaskMap):
    """A Hugging Face model's outputs: ``logits`` by the head and ``config.problem_type``; the ``loss``
    recomputed from the mixture's logits when labels are given (the predictive NLL, not the members'
    mean loss); other floating-point outputs (hidden states, attentions) averaged; the KV cache kept
    with its K * B rows (so ``generate`` continues every member)."""

    rest: str = "mean"
    recompute_loss: bool = True
    problem_type: str | None = None  # the model's config.problem_type that the logits' task was read from

    def recomputes(self, key: Any) -> bool:
        return self.recompute_loss and key == "loss"

    def finish(self, model: Any, reduced: list[tuple[Any, object]], inputs: dict) -> list[object]:
        """The ``loss``: the model's own loss function on the mixture's logits (the predictive NLL); the KV cache
        reordered member by member in beam search."""
        for _, value in reduced:
            if callable(getattr(value, "reorder_cache", None)):  # the KV cache (`cache`; `past_key_values` before 5.x)
                _reorder_by_member(value)
        if not self.recompute_loss or all(key != "loss" for key, _ in reduced):
            return super().finish(model, reduced, inputs)
        outputs = {key: value for key, value in reduced if isinstance(value, Tensor)}
        loss = huggingface_loss(model, outputs, inputs)
        if loss is None:  # the model computed a loss, from inputs other than the labels (CLIP's return_loss)
            raise _cannot_recompute(model)
        return [loss if key == "loss" else value for key, value in reduced]


def _reorder_by_member(cache: object) -> None:
    """Make a KV cache of the tiled pass (member-major: member k's rows ``[k * n, (k + 1) * n)``) reorder each
    member's rows alike: beam search hands ``cache.reorder_cache`` the ``n`` beams' indices, which on the K * n rows
    kept member 0's alone (the next step's K * n new rows then failed to join them)."""
    reorder = getattr(cache, "reorder_cache", None)
    if reorder is None or getattr(reorder, "by_member", False):
        return

    def reorder_members(beam_idx: Tensor) -> None:
        layers = getattr(cache, "layers", ())
        keys = next((layer.keys for layer in layers if isinstance(getattr(layer, "keys", None), Tensor)), None)
        rows = -1 if keys is None or keys.dim() == 0 else keys.shape[0]  # (a cache of another kind: as it is)
        n = beam_idx.numel()
        if n and rows > n and rows % n == 0:
            offsets = torch.arange(rows // n, device=beam_idx.device) * n
            beam_idx = (offsets[:, None] + beam_idx[None, :]).reshape(-1)
        reorder(beam_idx)

    reorder_members.by_member = True  # type: ignore[attr-defined]
    cache.reorder_cache = reorder_members  # type: ignore[attr-defined]


# the heads whose logits have config.num_labels entries on their class axis
_NUM_LABELS_HEADS = (
    "ForSequenceClassification", "ForImageClassification", "ForAudioClassification", "ForVideoClassification",
    "ForTokenClassification",
)


def _one_label_regresses(kind: str) -> bool:
    """Whether a head of this class regresses with ``num_labels == 1`` (transformers' sequence, image, audio and
    video classifiers: their loss is the mean squared error then, as they set ``problem_type`` in the first forward
    pass with labels); a token classifier's one label is still a class."""
    return kind.endswith(_NUM_LABELS_HEADS) and not kind.endswith("ForTokenClassification")


def huggingface_model(model: nn.Module) -> nn.Module | None:
    """The Hugging Face ``PreTrainedModel`` that ``model`` is, or that a peft wrapper (``PeftModel``: LoRA put on
    before conversion) holds and calls with the same inputs (``get_base_model()``); None for any other model."""
    base = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    if base is None:
        return None
    if isinstance(model, base):
        return model
    if _defined_in(model, "peft") and callable(getattr(model, "get_base_model", None)):
        inner = model.get_base_model()
        return inner if isinstance(inner, base) else None
    return None


# a Hugging Face model's main input of each modality (batch-first), and its fewest dimensions with a batch: a tower's
_TOWER_INPUTS = {"input_ids": 2, "inputs_embeds": 3, "pixel_values": 4, "input_values": 2, "input_features": 3}


def tower_batches(root: nn.Module, args: tuple, kwargs: dict) -> dict[str, int]:
    """The batch of each tower input a Hugging Face model was given (CLIP's ``input_ids`` and ``pixel_values``), by
    name; empty for any other model. (A vision-language model's flat patches ``[patches, dim]`` are no tower's.)"""
    if huggingface_model(root) is None:
        return {}
    given = dict(kwargs)
    if args:  # (by keyword as a rule: the signature is read only for positional inputs, once per class)
        given.update(zip(_positional_names(type(root)), args))
    return {
        name: int(value.shape[0]) for name, dims in _TOWER_INPUTS.items()
        if isinstance(value := given.get(name), Tensor) and value.dim() >= dims
    }  # fmt: skip


def said_of_model(said: Task, stated: Task | None) -> Task:
    """A task said of a Hugging Face model's output as a whole (``task="classification"`` for a sequence
    classifier), as the task of its ``logits`` in what the model states, where it is of the kind the model's own
    loss computes (a softmax said of a softmax head): its loss is still recomputed from the mixture and its other
    outputs averaged (the said task alone reduced the loss as the members' mean, with a warning). Another kind (the
    model's loss would not be the said task's NLL), a mapping, a custom reduction, ``"members"``: as said."""
    logits = stated.get("logits") if isinstance(stated, HuggingFaceTask) else None
    if logits is not None and (isinstance(said, type(logits)) or isinstance(logits, type(said))) and not isinstance(
        said, (Auto, TaskMap, Members, CustomTask)
    ):
        if isinstance(said, Classification) and said.class_axis is None and isinstance(logits, Classification):
            said = dataclasses.replace(said, class_axis=logits.class_axis)  # (a model's logits: classes last)
        return dataclasses.replace(stated, tasks=tuple((k, said if k == "logits" else t) for k, t in stated.tasks))
    return said


@functools.cache
def _positional_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s positional inputs, in order (none where it takes ``*args``: a peft wrapper)."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]  # (not self)
    except (TypeError, ValueError):
        return ()
    P = inspect.Parameter
    return tuple(p.name for p in parameters if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD))


# pre-training discriminators whose logits are one sigmoid per token (replaced or not), not a softmax over the sequence
_DISCRIMINATORS = frozenset({"ElectraForPreTraining", "FunnelForPreTraining"})


def _huggingface_task(model: nn.Module) -> Task | None:
    found = huggingface_model(model)
    if found is None:
        return None
    model, config = found, found.config
    kind = type(model).__name__
    problem = getattr(config, "problem_type", None)
    if problem == "multi_label_classification":
        logits: Task = MultiLabel()
    elif problem == "regression" or (_one_label_regresses(kind) and getattr(config, "num_labels", 2) == 1):
        logits = Regression()
    elif kind.endswith(_NUM_LABELS_HEADS):  # single-label: one logit per label, config.num_labels of them
        logits = Classification(-1, getattr(config, "num_labels", None))
    elif kind.endswith("ForSemanticSegmentation"):  # a map of logits per pixel, [B, num_labels, H, W]: classes at 1
        logits = Classification(1, getattr(config, "num_labels", None))
    else:
        logits = Classification(-1)  # causal / masked LM (logits over the vocabulary, which may be padded)
    if kind.endswith("ForQuestionAnswering"):  # a distribution over the positions where the answer starts and ends
        return HuggingFaceTask((("start_logits", Classification(-1)), ("end_logits", Classification(-1))), problem_type=problem)
    if kind in _DISCRIMINATORS:  # ELECTRA's replaced-token detection: one sigmoid logit per token [B, T]
        logits = Binary()
    # heads beside the logits (their mean as raw logits was not the mixture): a multiple-choice head [B, choices],
    # a pre-training head's tokens [B, T, V] and next-sentence pair [B, 2]
    extra: tuple[tuple[str, Task], ...] = ()
    if kind.endswith("DoubleHeadsModel"):
        extra = (("mc_logits", Classification(-1)),)
    elif kind.endswith("ForPreTraining"):
        extra = (("prediction_logits", Classification(-1)), ("seq_relationship_logits", Classification(-1)))
    return HuggingFaceTask((("logits", logits), *extra), problem_type=problem)


def named_outputs(model: nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The keyword arguments that call a Hugging Face model for its named ``ModelOutput`` where the call (or the
    model's config) asks for a tuple (``return_dict=False``), and whether it did: a tuple's positions do not say what
    each output is (the loss comes first only when labels were given), so the mixture reduces the named outputs and
    the caller hands them back as the tuple asked for (``ModelOutput.to_tuple()``: what the model would return)."""
    found = huggingface_model(model)
    if found is None:
        return kwargs, False
    model = found  # (a peft wrapper hands return_dict on to it)
    said = kwargs.get("return_dict")
    if said is None and "return_dict" not in kwargs and getattr(model.config, "return_dict", True) is False:
        said = False if _takes_return_dict(type(model)) else None
    if said is False:
        return {**kwargs, "return_dict": True}, True
    return kwargs, False


def as_asked(output: object) -> object:
    """A Hugging Face model's named outputs as the tuple it returns for ``return_dict=False`` (``ModelOutput.to_tuple``:
    the outputs that are not None, in their order), for a call :func:`named_outputs` changed."""
    to_tuple = getattr(output, "to_tuple", None)
    return to_tuple() if callable(to_tuple) else output


@functools.cache
def _takes_return_dict(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``return_dict`` (by name, or in its ``**kwargs``, as transformers' decorated
    forwards do)."""
    try:
        parameters = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    return "return_dict" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def restated_task(model: nn.Module, task: Task) -> Task:
    """``task``, or what ``model`` states now where it was read from a Hugging Face config that has changed since:
    transformers sets ``config.problem_type`` in the first forward pass with labels (float multi-hot labels: multi-label
    sigmoids, where the head stated nothing at conversion and read as a softmax over the labels)."""
    if not isinstance(task, HuggingFaceTask):  # (every pass asks: any other model's task, at once)
        return task
    if getattr(getattr(huggingface_model(model), "config", None), "problem_type", None) != task.problem_type:
        return _huggingface_task(model) or task
    return task


def predicts_next_token(model: nn.Module) -> bool:
    """Whether ``model``'s logits at position t are for the token at t + 1: a Hugging Face decoder-only model that
    generates (GPT-2's ``LMHeadModel``, any ``ForCausalLM``), whose own loss shifts its labels by one position. A
    sequence-to-sequence model's logits are for the label at their own position (its decoder inputs are shifted)."""
    model = huggingface_model(model)
    if model is None or getattr(model.config, "is_encoder_decoder", False):
        return False
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate()) if callable(can_generate) else False


def with_decoder_inputs(model: nn.Module, inputs: object, labels: Tensor) -> object:
    """Keyword inputs for a Hugging Face sequence-to-sequence model (T5, BART) with its decoder inputs made from
    ``labels``, as its own forward makes them when given ``labels=``: an evaluation that keeps the labels from the
    model (they are the target) would else give it no decoder input at all (BART: its own input ids). Decoder inputs
    given are kept; any other model's inputs are returned as they are."""
    given = ("decoder_input_ids", "decoder_inputs_embeds")
    if not isinstance(inputs, Mapping) or any(inputs.get(k) is not None for k in given):
        return inputs
    model = huggingface_model(model) or model
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if not callable(prepare) or not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return inputs
    return {**inputs, "decoder_input_ids": prepare(labels=labels)}


def padding_targets(x: object, label: int) -> Tensor | None:
    """Targets for a mapping batch's token positions from its ``attention_mask`` (Hugging Face's inputs' mark of
    padding): ``label`` where it is 0 (padding), 0 elsewhere; None where the batch holds no such mask."""
    mask = x.get("attention_mask") if isinstance(x, Mapping) else None
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        return None
    return torch.where(mask.bool(), 0, label).cpu()


# the heads whose loss the model's own ``self.loss_function`` computes from ``logits`` and ``labels`` alone
_LOSS_FUNCTION_TYPES = (
    "ForCausalLM", "ForMaskedLM", "ForSequenceClassification", "ForImageClassification", "ForAudioClassification",
    "ForVideoClassification", "ForTokenClassification", "ForConditionalGeneration",
)


def huggingface_loss(model: nn.Module, outputs: dict[str, Tensor], inputs: dict[str, Any]) -> Tensor | None:
    """The loss the model computes, on the mixture's outputs (the predictive NLL); None without labels (or a
    question-answering model's positions), and a ``ValueError`` where the model computes it another way.

    A model's forward computes its loss in one of two ways: with ``self.loss_function`` (what Hugging Face maps
    the head's name to), or in its own code. Each is repeated here only where it is known to be that model's
    loss: the former for the heads whose loss function needs the logits and labels alone, the latter for
    the heads below (the formulas of transformers' own models). Anything else (CTC, detection, pre-training
    heads) stops with a one-line error rather than give another loss under the model's name. (A peft wrapper's loss
    is its Hugging Face model's.)"""
    model = huggingface_model(model) or model
    kind = type(model).__name__
    if kind.endswith("ForQuestionAnswering"):
        start, end = inputs.get("start_positions"), inputs.get("end_positions")
        if not (isinstance(start, Tensor) and isinstance(end, Tensor)) or "start_logits" not in outputs:
            return None
        return _question_answering_loss(outputs["start_logits"], outputs["end_logits"], start, end)
    labels, logits = inputs.get("labels"), outputs.get("logits")
    if not isinstance(labels, Tensor):
        return None
    if logits is None:  # labels, and outputs of other names (a pre-training head's prediction_logits)
        raise _cannot_recompute(model)
    config = model.config
    loss_function = getattr(model, "loss_function", None)
    if loss_function is not None and _computes_with_loss_function(type(model)):
        if (getattr(model, "loss_type", None) or "ForCausalLM") in _LOSS_FUNCTION_TYPES:  # (None: transformers' default)
            # with what the forward hands its loss function from its **kwargs: num_items_in_batch (transformers'
            # Trainer: the tokens of the global batch, so that it sums the processes' losses), shift_labels,
            # ignore_index. (Left out, the mean of one batch came back, and Trainer.evaluate on 2 processes doubled.)
            return loss_function(
                logits=logits, pooled_logits=logits, labels=labels, vocab_size=getattr(config, "vocab_size", None),
                config=config, **_loss_keywords(type(model), inputs),
            )  # fmt: skip
    elif kind.endswith("ForMaskedLM") or (getattr(config, "is_encoder_decoder", False) and (
        kind.endswith("ForConditionalGeneration") or kind == "MarianMTModel"  # (Marian's: BART's loss, another name)
    )):  # fmt: skip
        # every token against its own label (a sequence-to-sequence model's decoder inputs are the labels shifted)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    elif kind.endswith("ForCausalLM"):  # every token against the next one's label
        return F.cross_entropy(logits[..., :-1, :].reshape(-1, logits.shape[-1]).float(), labels[..., 1:].reshape(-1))
    elif kind.endswith(("ForTokenClassification", "ForMultipleChoice")):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    elif kind.endswith("ForSequenceClassification"):
        return _sequence_classification_loss(logits, labels, config)
    raise _cannot_recompute(model)


def _cannot_recompute(model: nn.Module) -> ValueError:
    model = huggingface_model(model) or model
    return ValueError(
        f"bayesify cannot recompute {type(model).__name__}'s loss from the mixture of its members (the model computes "
        "it its own way): in evaluation call it without labels (or return_loss) and compute the loss from the "
        "mixture's outputs, or take one member's loss under bayesify.mode(model, component=k)."
    )


def _loss_keywords(cls: type, inputs: dict[str, Any]) -> dict[str, Any]:
    """The call's keyword arguments that ``cls.forward`` does not name: its ``**kwargs``, which transformers' heads
    pass on to ``self.loss_function``."""
    named = _named_parameters(cls)
    return {k: v for k, v in inputs.items() if k not in named}


@functools.cache
def _named_parameters(cls: type) -> frozenset[str]:
    try:
        parameters = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):  # no signature at hand: hand nothing on
        return frozenset()
    return frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD)


@functools.cache
def _computes_with_loss_function(cls: type) -> bool:
    """Whether ``cls.forward`` computes its loss with ``self.loss_function`` (transformers' newer heads)."""
    try:
        return "self.loss_function(" in inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source at hand
        return False


def _sequence_classification_loss(logits: Tensor, labels: Tensor, config: Any) -> Tensor:
    """transformers' sequence classification loss by ``config.problem_type`` (which the model's forward set)."""
    problem, classes = getattr(config, "problem_type", None), getattr(config, "num_labels", logits.shape[-1])
    if problem == "regression":
        return F.mse_loss(logits.squeeze(), labels.squeeze()) if classes == 1 else F.mse_loss(logits, labels)
    if problem == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels)
    return F.cross_entropy(logits.reshape(-1, classes).float(), labels.reshape(-1))


def _question_answering_loss(start_logits: Tensor, end_logits: Tensor, start: Tensor, end: Tensor) -> Tensor:
    """transformers' extractive question answering loss: positions outside the sequence are ignored."""
    ignored = start_logits.shape[1]
    start, end = (p.squeeze(-1) if p.dim() > 1 else p for p in (start, end))  # (on several devices, one more dim)
    start, end = start.clamp(0, ignored), end.clamp(0, ignored)
    return (F.cross_entropy(start_logits, start, ignore_index=ignored) + F.cross_entropy(end_logits, end, ignore_index=ignored)) / 2
