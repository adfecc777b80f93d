"""Merging the members of a Bayesian object detector into one set of boxes, with per-box agreement.

A converted detector (torchvision's Faster R-CNN, RetinaNet, ...) gives each of its
``S = K * M`` members its own detections; there is no mixture "average" of box lists.
:func:`fuse_detections` merges them by weighted box fusion (WBF): boxes of the same label
from all members are clustered by IoU, and each cluster becomes one box whose coordinates
are the score-weighted mean of its members' boxes. The spread of a cluster is the
uncertainty: ``agreement`` (the fraction of members that found the object) and ``box_std``
(how much their boxes disagree on its extent).

Example:
    >>> members = [model_k(images) for model_k in ...]     # S lists of per-image dicts, torchvision format
    >>> fused = fuse_detections(members)                   # one dict per image
    >>> fused[0]["boxes"], fused[0]["agreement"]

References:
    Solovyev, Wang and Gabruseva, "Weighted boxes fusion: Ensembling boxes from different
    object detection models", Image and Vision Computing 107, 2021 (Algorithm 1, ``conf_type="avg"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["box_iou", "fuse_detections"]

Detections = Mapping[str, Tensor]


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """Pairwise intersection over union of ``[N, 4]`` and ``[M, 4]`` xyxy boxes: ``[N, M]``.

    As ``torchvision.ops.box_iou``, without the dependency; two boxes of zero area have IoU 0.

    Example:
        >>> box_iou(torch.tensor([[0.0, 0, 2, 2]]), torch.tensor([[1.0, 0, 3, 2]]))
        tensor([[0.3333]])
    """
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    top_left = torch.maximum(boxes1[:, None, :2], boxes2[None, :, :2])
    bottom_right = torch.minimum(boxes1[:, None, 2:], boxes2[None, :, 2:])
    overlap = (bottom_right - top_left).clamp_min(0).prod(-1)
    union = area1[:, None] + area2[None, :] - overlap
    return torch.where(union > 0, overlap / union, torch.zeros_like(overlap))


def _check_image(detections: object, member: int, image: int) -> tuple[Tensor, Tensor, Tensor]:
    where = f"members[{member}][{image}]"
    if not isinstance(detections, Mapping):
        raise TypeError(f"{where} must be a dict of 'boxes', 'labels' and 'scores', got {type(detections).__name__}.")
    if not {"boxes", "labels", "scores"} <= detections.keys():
        raise ValueError(
            f"{where} has keys {sorted(detections)}; it needs 'boxes', 'labels' and 'scores' (torchvision's "
            "detection output format)."
        )
    boxes, labels, scores = detections["boxes"], detections["labels"], detections["scores"]
    if not all(isinstance(t, Tensor) for t in (boxes, labels, scores)):
        raise TypeError(f"{where}: 'boxes', 'labels' and 'scores' must be tensors.")
    if boxes.dim() != 2 or boxes.shape[1] != 4 or labels.shape != boxes.shape[:1] or scores.shape != boxes.shape[:1]:
        raise ValueError(
            f"{where}: expected boxes [N, 4], labels [N] and scores [N], got {tuple(boxes.shape)}, "
            f"{tuple(labels.shape)} and {tuple(scores.shape)}."
        )
    if not boxes.is_floating_point() or not scores.is_floating_point() or labels.is_floating_point():
        raise TypeError(
            f"{where}: boxes and scores must be floating point and labels integers, got {boxes.dtype}, "
            f"{scores.dtype} and {labels.dtype}."
        )
    if torch.any(boxes[:, 2:] < boxes[:, :2]):
        raise ValueError(f"{where}: boxes must be (x1, y1, x2, y2) with x2 >= x1 and y2 >= y1 (xyxy, not xywh).")
    return boxes, labels, scores


def _fuse_one_label(boxes: Tensor, scores: Tensor, owners: Tensor, members: int, iou_threshold: float) -> list[Tensor]:
    """WBF of one image's boxes of one label (float64, CPU): fused boxes, scores, agreement and box std."""
    order = torch.argsort(scores, descending=True, stable=True)
    fused = boxes.new_empty(boxes.shape)  # at most one fused box per input box
    clusters: list[list[int]] = []
    for index in order.tolist():
        best, best_overlap = -1, -1.0
        if clusters:
            overlaps = box_iou(boxes[index : index + 1], fused[: len(clusters)])[0]
            best = int(overlaps.argmax())
            best_overlap = float(overlaps[best])
        if best_overlap > iou_threshold:
            clusters[best].append(index)
        else:
            best = len(clusters)
            clusters.append([index])
        # the fused box is the score-weighted mean of its cluster, so later boxes match against it
        members_boxes, members_scores = boxes[clusters[best]], scores[clusters[best]]
        weights = members_scores if members_scores.sum() > 0 else torch.ones_like(members_scores)
        fused[best] = (weights[:, None] * members_boxes).sum(0) / weights.sum()

    fused_scores, agreement, spread = [], [], []
    for cluster in clusters:
        found_by = owners[cluster].unique().numel()
        agreement.append(found_by / members)
        # WBF's "avg" confidence, rescaled by the fraction of members that found the box
        fused_scores.append(scores[cluster].mean() * found_by / members)
        spread.append(boxes[cluster].std(0, correction=0))
    return [fused[: len(clusters)], torch.stack(fused_scores), boxes.new_tensor(agreement), torch.stack(spread)]


def fuse_detections(
    members: Sequence[Sequence[Detections]], *, iou_threshold: float = 0.55, skip_score: float = 0.0
) -> list[dict[str, Tensor]]:
    """Weighted box fusion of S members' detections, per image and label, with per-box member agreement.

    Boxes of one label are taken in descending score order; each joins the fused box it
    overlaps most if that IoU is above ``iou_threshold``, else it starts a new one. A fused box
    is the score-weighted mean of its cluster's boxes. This is WBF with ``conf_type="avg"``
    and equal member weights, except that the score is rescaled by the number of *distinct*
    members in the cluster (``ensemble_boxes`` uses ``min(cluster size, S)``; the two agree
    whenever no member puts two boxes in one cluster).

    Args:
        members: S member outputs, each a list over images of dicts ``{"boxes": [N, 4] xyxy,
            "labels": [N] int, "scores": [N]}`` (torchvision's detection output; other keys such
            as masks are ignored). Every member must cover the same images.
        iou_threshold: a box joins a fused box whose IoU with it is above this (WBF: 0.55).
        skip_score: boxes scored below this are dropped before fusion.

    Returns:
        One dict per image, sorted by descending score, with ``boxes`` ``[F, 4]``, ``labels``
        ``[F]``, ``scores`` ``[F]`` (mean score of the cluster x the fraction of members in it),
        ``agreement`` ``[F]`` (the fraction of members with a box in the cluster, in (0, 1]),
        and ``box_std`` ``[F, 4]`` (the population standard deviation of the cluster's box
        coordinates; 0 for a single box). Dtypes and device follow the first member's tensors.

    Raises:
        TypeError / ValueError: members that are not S lists of equally many torchvision-style dicts.

    Example:
        >>> def one_box(box, score):  # one image with one box of label 1
        ...     return [{"boxes": torch.tensor([box]), "labels": torch.tensor([1]), "scores": torch.tensor([score])}]
        >>> fused = fuse_detections([one_box([0.0, 0, 10, 10], 0.9), one_box([1.0, 0, 11, 10], 0.7)])
        >>> fused[0]["agreement"], fused[0]["scores"]
        (tensor([1.]), tensor([0.8000]))

    References:
        Solovyev et al., Image and Vision Computing 107, 2021, Algorithm 1.
    """
    _check_members(members, iou_threshold, skip_score)
    fused_images = []
    for image in range(len(members[0])):
        checked = [_check_image(m[image], member, image) for member, m in enumerate(members)]
        fused_images.append(_fuse_image(checked, iou_threshold, skip_score))
    return fused_images


def _check_members(members: Sequence[Sequence[Detections]], iou_threshold: float, skip_score: float) -> None:
    """Raise the error :func:`fuse_detections` documents for members or settings it cannot fuse (each image's
    dicts are checked as it comes, by :func:`_check_image`)."""
    if isinstance(members, Mapping) or not isinstance(members, Sequence) or len(members) == 0:
        raise TypeError(
            "members must be a non-empty list with one entry per member, each a list over images of detection dicts; "
            f"got {type(members).__name__}."
        )
    if not all(isinstance(m, Sequence) and not isinstance(m, Mapping) for m in members):
        raise TypeError("every member must be a list over images of detection dicts (torchvision's output format).")
    images = len(members[0])
    if any(len(m) != images for m in members):
        raise ValueError(
            f"members cover different numbers of images: {[len(m) for m in members]}; each must cover all."
        )
    if isinstance(iou_threshold, bool) or not isinstance(iou_threshold, (int, float)) or not 0 <= iou_threshold <= 1:
        raise ValueError(f"iou_threshold={iou_threshold!r} must be a number in [0, 1] (WBF's default: 0.55).")
    if isinstance(skip_score, bool) or not isinstance(skip_score, (int, float)):
        raise TypeError(f"skip_score={skip_score!r} must be a number: boxes scored below it are dropped.")


def _fuse_image(
    checked: list[tuple[Tensor, Tensor, Tensor]], iou_threshold: float, skip_score: float
) -> dict[str, Tensor]:
    """One image's fused detections (see :func:`fuse_detections`) from each member's ``(boxes, labels, scores)``:
    fused label by label in float64 on the CPU, returned sorted by score in the first member's dtypes and device."""
    boxes0, labels0, scores0 = checked[0]
    boxes = torch.cat([b for b, _, _ in checked]).detach().to("cpu", torch.float64)
    labels = torch.cat([lab for _, lab, _ in checked]).detach().to("cpu", torch.int64)
    scores = torch.cat([s for _, _, s in checked]).detach().to("cpu", torch.float64)
    owners = torch.cat([torch.full((len(b),), member) for member, (b, _, _) in enumerate(checked)])
    keep = scores >= skip_score
    boxes, labels, scores, owners = boxes[keep], labels[keep], scores[keep], owners[keep]

    parts: list[list[Tensor]] = []
    for label in labels.unique().tolist():
        same = labels == label
        fused = _fuse_one_label(boxes[same], scores[same], owners[same], len(checked), iou_threshold)
        parts.append([*fused, torch.full((len(fused[0]),), label, dtype=torch.int64)])
    if parts:
        fused_boxes, fused_scores, agreement, spread, fused_labels = (torch.cat(p) for p in zip(*parts))
    else:
        fused_boxes, spread = boxes.new_zeros(0, 4), boxes.new_zeros(0, 4)
        fused_scores, agreement, fused_labels = scores.new_zeros(0), scores.new_zeros(0), labels.new_zeros(0)
    order = torch.argsort(fused_scores, descending=True, stable=True)
    return {
        "boxes": fused_boxes[order].to(boxes0.device, boxes0.dtype),
        "labels": fused_labels[order].to(labels0.device, labels0.dtype),
        "scores": fused_scores[order].to(scores0.device, scores0.dtype),
        "agreement": agreement[order].to(scores0.device, scores0.dtype),
        "box_std": spread[order].to(boxes0.device, boxes0.dtype),
    }
