"""Weighted box fusion of detection members on hand-made boxes, and box IoU against torchvision."""

import pytest
import torch

from bayesify.detection import box_iou, fuse_detections


def _image(boxes, scores, labels=None, dtype=torch.float64):
    boxes = torch.tensor(boxes, dtype=dtype).reshape(-1, 4)
    labels = torch.ones(len(boxes), dtype=torch.int64) if labels is None else torch.tensor(labels)
    return {"boxes": boxes, "labels": labels, "scores": torch.tensor(scores, dtype=dtype)}


def test_box_iou_by_hand_and_against_torchvision():
    a = torch.tensor([[0.0, 0, 2, 2], [0, 0, 0, 0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 0, 3, 2], [5, 5, 6, 6], [0, 0, 0, 0]], dtype=torch.float64)
    iou = box_iou(a, b)
    assert iou.tolist() == [[pytest.approx(2 / 6), 0.0, 0.0], [0.0, 0.0, 0.0]]  # zero-area boxes: 0, not NaN
    ops = pytest.importorskip("torchvision.ops")
    generator = torch.Generator().manual_seed(0)
    corners = torch.rand(30, 2, generator=generator, dtype=torch.float64) * 10
    sizes = torch.rand(30, 2, generator=generator, dtype=torch.float64) * 5
    boxes = torch.cat([corners, corners + sizes], 1)
    assert torch.allclose(box_iou(boxes[:12], boxes[12:]), ops.box_iou(boxes[:12], boxes[12:]), atol=1e-15)


def test_two_agreeing_members_give_one_box_with_full_agreement():
    fused = fuse_detections([[_image([0.0, 0, 10, 10], [0.9])], [_image([2.0, 0, 12, 10], [0.6])]])
    assert len(fused) == 1
    result = fused[0]
    # score-weighted mean: x1 = (0.9 * 0 + 0.6 * 2) / 1.5, x2 = (0.9 * 10 + 0.6 * 12) / 1.5
    assert result["boxes"].tolist() == [[pytest.approx(0.8), 0.0, pytest.approx(10.8), 10.0]]
    assert result["scores"].tolist() == [pytest.approx(0.75)] and result["agreement"].tolist() == [1.0]
    assert result["labels"].tolist() == [1]
    assert result["box_std"].tolist() == [[1.0, 0.0, 1.0, 0.0]]  # population std of 0 and 2, 10 and 12


def test_a_box_one_member_found_alone_has_half_agreement_and_half_its_score():
    members = [[_image([[0.0, 0, 10, 10], [50, 50, 60, 60]], [0.9, 0.8])], [_image([0.0, 0, 10, 10], [0.7])]]
    result = fuse_detections(members)[0]
    assert result["agreement"].tolist() == [1.0, 0.5]  # sorted by score: 0.8 then 0.8 / 2
    assert result["scores"].tolist() == [pytest.approx(0.8), pytest.approx(0.4)]
    assert result["boxes"][1].tolist() == [50.0, 50, 60, 60] and result["box_std"][1].tolist() == [0.0] * 4


def test_later_boxes_match_the_updated_fused_box():
    # C overlaps A with IoU 0.48 < 0.55 but the fused box of A and B ([1, 0, 11, 10]) with IoU 0.6
    members = [
        [_image([0.0, 0, 10, 10], [0.9])],
        [_image([2.0, 0, 12, 10], [0.9])],
        [_image([3.5, 0, 13.5, 10], [0.5])],
    ]
    assert box_iou(members[0][0]["boxes"], members[2][0]["boxes"]).item() < 0.55
    result = fuse_detections(members)[0]
    assert result["agreement"].tolist() == [1.0]
    x1, x2 = (0.9 * 0 + 0.9 * 2 + 0.5 * 3.5) / 2.3, (0.9 * 10 + 0.9 * 12 + 0.5 * 13.5) / 2.3
    assert result["boxes"].tolist() == [[pytest.approx(x1), 0.0, pytest.approx(x2), 10.0]]
    assert result["scores"].tolist() == [pytest.approx((0.9 + 0.9 + 0.5) / 3)]


def test_labels_thresholds_and_skipped_scores_keep_boxes_apart():
    same_place = [[_image([0.0, 0, 10, 10], [0.9], labels=[1])], [_image([0.0, 0, 10, 10], [0.8], labels=[2])]]
    result = fuse_detections(same_place)[0]
    assert sorted(result["labels"].tolist()) == [1, 2] and result["agreement"].tolist() == [0.5, 0.5]
    # IoU of [0, 0, 10, 10] and [5, 0, 15, 10] is 1/3: fused at a threshold of 0.3, apart at the default
    shifted = [[_image([0.0, 0, 10, 10], [0.9])], [_image([5.0, 0, 15, 10], [0.8])]]
    assert len(fuse_detections(shifted)[0]["boxes"]) == 2
    assert len(fuse_detections(shifted, iou_threshold=0.3)[0]["boxes"]) == 1
    result = fuse_detections(shifted, skip_score=0.85)[0]
    assert result["scores"].tolist() == [pytest.approx(0.45)] and result["agreement"].tolist() == [0.5]


def test_agreement_counts_distinct_members():
    # member 0 puts two overlapping boxes on one object; member 1 finds nothing
    members = [[_image([[0.0, 0, 10, 10], [1.0, 0, 11, 10]], [0.8, 0.6])], [_image([], [])]]
    result = fuse_detections(members)[0]
    assert result["agreement"].tolist() == [0.5]
    assert result["scores"].tolist() == [pytest.approx(0.7 * 0.5)]


def test_several_images_empty_images_and_dtypes():
    members = [
        [_image([0.0, 0, 10, 10], [0.9], dtype=torch.float32), _image([], [], dtype=torch.float32)],
        [_image([0.0, 0, 10, 10], [0.5], dtype=torch.float32), _image([], [], dtype=torch.float32)],
    ]
    first, empty = fuse_detections(members)
    assert first["boxes"].dtype == first["scores"].dtype == first["agreement"].dtype == torch.float32
    assert first["labels"].dtype == torch.int64 and first["scores"].tolist() == [pytest.approx(0.7)]
    assert empty["boxes"].shape == (0, 4) and empty["box_std"].shape == (0, 4)
    assert empty["scores"].shape == empty["labels"].shape == empty["agreement"].shape == (0,)


def test_bad_input_is_refused():
    good = _image([0.0, 0, 10, 10], [0.9])
    with pytest.raises(TypeError, match="non-empty list"):
        fuse_detections([])
    with pytest.raises(TypeError, match="list over images"):
        fuse_detections([good])
    with pytest.raises(ValueError, match="different numbers of images"):
        fuse_detections([[good], [good, good]])
    with pytest.raises(ValueError, match="needs 'boxes', 'labels' and 'scores'"):
        fuse_detections([[{"boxes": good["boxes"]}]])
    with pytest.raises(ValueError, match=r"members\[0\]\[0\]: expected boxes \[N, 4\]"):
        fuse_detections([[{**good, "boxes": torch.zeros(1, 5)}]])
    with pytest.raises(ValueError, match="xyxy, not xywh"):
        fuse_detections([[_image([5.0, 5, 2, 2], [0.9])]])
    with pytest.raises(TypeError, match="labels integers"):
        fuse_detections([[{**good, "labels": torch.ones(1)}]])
    with pytest.raises(ValueError, match="iou_threshold"):
        fuse_detections([[good]], iou_threshold=1.5)
    with pytest.raises(TypeError, match="skip_score"):
        fuse_detections([[good]], skip_score=None)
