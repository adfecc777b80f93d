"""evaluate() on mapping batches, the Hugging Face format ({"input_ids", "attention_mask", "labels"}, what
transformers.Trainer takes): the "labels" entry is the target, the others the model's keyword inputs. It ended in
"too many values to unpack (expected 2)", so a padded batch's attention mask could not be given at all."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayesify
from bayesify.evaluation import collect_members, evaluate, evaluate_corruptions

transformers = pytest.importorskip("transformers")

METRICS = ("nll", "accuracy", "ece", "brier")


@pytest.fixture(scope="module")
def bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=37, num_labels=3, initializer_range=0.5)  # fmt: skip
    return bayesify.convert(transformers.BertForSequenceClassification(config), components=2, init="normal")


@pytest.fixture(scope="module")
def padded() -> dict[str, torch.Tensor]:
    """12 sequences of 8 tokens, every other one padded after its 3rd; two copies of the ids that differ only at the
    padded positions (0, the pad token, in one; random ids in the other): a dropped mask scores them differently."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (12, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, 3:] = 0
    noisy = torch.where(mask.bool(), ids, torch.randint(1, 100, ids.shape, generator=g))
    return {"ids": ids * mask, "noisy": noisy, "mask": mask, "labels": torch.randint(3, (12,), generator=g)}


class IdsAndMask(nn.Module):
    """The mask folded in by hand: one input ``[B, 2, T]`` carrying the ids and the mask, for (x, y) pairs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor):
        return self.model(input_ids=x[:, 0], attention_mask=x[:, 1])


def _examples(ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, label_key: str = "labels") -> list[dict]:
    return [{"input_ids": i, "attention_mask": m, label_key: y} for i, m, y in zip(ids, mask, labels)]


def _assert_same(a: dict, b: dict) -> None:
    for key in METRICS:
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


def test_dict_batches_are_scored_with_their_attention_mask(bert, padded):
    ids, noisy, mask, labels = padded["ids"], padded["noisy"], padded["mask"], padded["labels"]
    # the mask folded in by hand, through the (x, y) path
    by_hand = evaluate(IdsAndMask(bert), TensorDataset(torch.stack([ids, mask], 1), labels), samples=2, batch_size=5)
    # a list of examples (a Hugging Face data set), batched by evaluate
    examples = evaluate(bert, _examples(ids, mask, labels), samples=2, batch_size=5)
    # ready-made dict batches (a DataLoader and its collator), the other ids at the padded positions
    batches = [{"input_ids": noisy[i : i + 5], "attention_mask": mask[i : i + 5], "labels": labels[i : i + 5]}
               for i in range(0, 12, 5)]  # fmt: skip
    collated = evaluate(bert, DataLoader(batches, batch_size=None), samples=2)
    assert examples["output"] == collated["output"] == "logits"
    _assert_same(examples, by_hand)
    _assert_same(collated, by_hand)
    # the comparison would catch a dropped mask: without it the two copies' padded ids score differently
    unmasked = [evaluate(bert, TensorDataset(x, labels), samples=2)["nll"] for x in (ids, noisy)]
    assert abs(unmasked[0] - unmasked[1]) > 1e-3 and abs(unmasked[0] - by_hand["nll"]) > 1e-3


def test_a_mapping_and_an_input_target_pair_give_the_same_numbers(bert, padded):
    ids, labels = padded["noisy"], padded["labels"]
    pairs = evaluate(bert, TensorDataset(ids, labels), batch_size=5)  # the (x, y) path, as before
    mapping = evaluate(bert, [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)], batch_size=5)
    assert pairs.keys() == mapping.keys()
    _assert_same(mapping, pairs)
    with torch.no_grad():  # the (x, y) path's NLL is the mixture's, at the K posterior means
        logits = bayesify.predict(bert.eval(), ids, noise=False).logits  # [K, B, C]
    log_p = logits.log_softmax(-1).logsumexp(0) - math.log(2)
    assert pairs["nll"] == pytest.approx(float(-log_p.gather(1, labels[:, None]).mean()), rel=1e-5)
    # one example at a time (a DataLoader with batch_size=None: 0-d labels): each entry becomes a batch of one
    one_by_one = evaluate(bert, DataLoader(_examples(ids, padded["mask"], labels), batch_size=None))
    _assert_same(one_by_one, evaluate(bert, _examples(ids, padded["mask"], labels)))
    # collect_members reads the same batches
    members, targets = collect_members(bert, _examples(padded["ids"], padded["mask"], labels), samples=1)
    assert members.shape == (2, 12, 3) and torch.equal(targets, labels)


def test_label_key_names_another_target_entry(bert, padded):
    ids, mask, labels = padded["ids"], padded["mask"], padded["labels"]
    renamed = evaluate(bert, _examples(ids, mask, labels, label_key="label"), label_key="label")
    _assert_same(renamed, evaluate(bert, _examples(ids, mask, labels)))


def test_an_ood_set_of_mappings_needs_no_labels(bert, padded):
    ids, noisy, mask, labels = padded["ids"], padded["noisy"], padded["mask"], padded["labels"]
    ood_ids = torch.randint(50, 100, (10, 8))
    ood_pairs = TensorDataset(torch.stack([ood_ids, torch.ones_like(ood_ids)], 1), torch.zeros(10))
    pairs = evaluate(IdsAndMask(bert), TensorDataset(torch.stack([ids, mask], 1), labels), ood=ood_pairs)
    # the in-distribution set's mappings are scored again without their labels (sampled), the OOD set has none
    ood = [{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ood_ids]
    mapping = evaluate(bert, _examples(noisy, mask, labels), ood=ood)
    assert mapping["ood_scoring"] == pairs["ood_scoring"]
    for score, table in pairs["ood"].items():
        assert mapping["ood"][score] == pytest.approx(table, rel=1e-5), score


def test_batches_of_another_form_are_refused_naming_what_is_accepted(bert, padded):
    ids, mask, labels = padded["ids"], padded["mask"], padded["labels"]
    with pytest.raises(ValueError, match=r"^a mapping batch holds its target under label_key='labels', but the batch "
                                         r"is a dict with keys 'input_ids', 'attention_mask', 'label'; name the "
                                         r"target's entry with label_key= \(label_key='label'\), or pass \(inputs, "
                                         r"target\) pairs\.$"):  # fmt: skip
        evaluate(bert, _examples(ids, mask, labels, label_key="label"))
    with pytest.raises(ValueError, match=r"^a batch must be an \(inputs, target\) pair or a mapping of the "
                                         r"model's keyword inputs with the target under 'labels'; got a list of "
                                         r"3\.$"):  # fmt: skip
        evaluate(bert, TensorDataset(ids, mask, labels))
    with pytest.raises(ValueError, match=r"got a tensor of shape \(5, 8\)\.$"):
        evaluate(bert, DataLoader(ids, batch_size=5))
    images = [{"pixel_values": torch.rand(3, 32, 32), "labels": torch.tensor(1)}] * 2
    classifier = bayesify.convert(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 3)), task="classification")
    with pytest.raises(ValueError, match=r"^the corruption benchmark corrupts \(images, labels\) batches; got a dict "
                                         r"with keys 'pixel_values', 'labels'\. .*corrupt_images .*evaluate\(\), which "
                                         r"takes mapping batches\.$"):  # fmt: skip
        evaluate_corruptions(classifier, images, corruptions="fog", severities=[1], progress=False)


def test_a_plain_model_takes_mapping_batches_too(padded):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=37, num_labels=3, initializer_range=0.5)  # fmt: skip
    plain = transformers.BertForSequenceClassification(config)
    ids, noisy, mask, labels = padded["ids"], padded["noisy"], padded["mask"], padded["labels"]
    by_hand = evaluate(IdsAndMask(plain), TensorDataset(torch.stack([ids, mask], 1), labels), task="classification")
    mapping = evaluate(plain, _examples(noisy, mask, labels), batch_size=5)
    assert mapping["components"] == 1 and mapping["output"] == "logits"
    _assert_same(mapping, by_hand)


@pytest.mark.parametrize("converted", [False, True])
def test_an_ood_table_leaves_out_the_positions_ignore_index_leaves_out(converted):
    """A token classifier's padding (labels -100) was scored as test tokens in the OOD table while every metric left
    it out: against the same sequences unpadded, whose real tokens score alike, the AUROC read 0.516, not 0.5."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=37, num_labels=4, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)  # fmt: skip
    model = transformers.BertForTokenClassification(config)
    if converted:  # (a delta posterior: the sampled members repeat, so equal tokens score alike in both sets)
        model = bayesify.convert(model, components=2, init="normal", posterior="delta")
    g = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(1, 100, (20, 4), generator=g), torch.randint(0, 4, (20, 4), generator=g)
    pad = torch.zeros(20, 6, dtype=torch.long)
    padded = [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(
        torch.cat([ids, pad], 1), torch.cat([torch.ones_like(ids), pad], 1), torch.cat([labels, pad - 100], 1))]  # fmt: skip
    unpadded = [{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids]
    task = bayesify.predictive.resolve_task("classification", class_axis=-1)
    unlabelled = [{k: v for k, v in example.items() if k != "labels"} for example in padded]
    # the OOD set's own padding is left out where its labels mark it, or, unlabelled, its attention mask (it was
    # scored: 0.416 for max_probability, 768 padded positions against 256 real ones, in a new user's trial)
    for ood in (unpadded, padded, unlabelled):
        report = evaluate(model, padded, ignore_index=-100, ood=ood, task=task, batch_size=8)
        assert report["ignored"] == 120
        for score in ("entropy", "max_probability"):
            assert report["ood"][score]["auroc"] == pytest.approx(0.5), score
    no_mask = [{"input_ids": example["input_ids"]} for example in unpadded]
    with pytest.raises(ValueError, match=r"1 of the 3 batches hold targets"):
        evaluate(model, padded, ignore_index=-100, ood=no_mask[:16] + padded[:4], task=task, batch_size=8)
