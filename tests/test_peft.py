"""peft (LoRA) with bayesify: LoRA put on first, then ``convert`` (bayesify reads the Hugging Face model inside)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bayesify

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

K = 4


def _lora_classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=3)  # fmt: skip
    base = transformers.BertForSequenceClassification(config)
    with torch.no_grad():
        base.classifier.weight.mul_(30)  # confident logits: the mixture's NLL and the members' mean loss differ
    lora = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=["query", "value"])
    return peft.get_peft_model(base, lora)


def test_a_lora_model_converted_reads_its_hugging_face_models_task_and_recomputes_the_loss() -> None:
    """The peft wrapper states nothing itself: its task was refused (auto), and with task= said the eval loss was the
    members' mean loss (1.1516 against the mixture's 1.1500 here)."""
    model = bayesify.convert(_lora_classifier(), components=K, init="normal").eval()
    assert str(bayesify.summary(model)).splitlines()[2] == "output: {'logits': classification (class axis -1)}, other outputs averaged"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (8, 16), generator=g)
    labels = ids[:, 0] % 3
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        members = []
        for k in range(K):
            with bayesify.mode(model, component=k, noise=False):
                members.append(model(input_ids=ids).logits)
    mixture = torch.stack(members).softmax(-1).mean(0)
    torch.testing.assert_close(out.logits.softmax(-1), mixture)
    torch.testing.assert_close(out.loss, F.nll_loss(mixture.log(), labels))


def test_a_lora_model_converted_trains_lora_and_the_factors_and_leaves_the_base_weights() -> None:
    model = bayesify.convert(_lora_classifier(), components=K)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "base_model.model.bert.encoder.layer.0.attention.self.key.rank1_s.loc" in trained
    assert "base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.default.weight" in trained
    assert "base_model.model.bert.encoder.layer.0.attention.self.key.weight" not in trained  # peft froze it
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(5, 100, (8, 16))
    model.train()
    loss = model(input_ids=ids, labels=ids[:, 0] % 3).loss + bayesify.kl_loss(model, 100)
    loss.backward()
    optimizer.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert "base_model.model.bert.encoder.layer.0.attention.self.key.rank1_s.loc" in moved
    assert not any(n.endswith("attention.self.key.weight") for n in moved)


def test_lora_on_a_timm_model_reads_the_timm_models_task() -> None:
    # get_peft_model of a timm ViT: the wrapper stated nothing (evaluation asked for task=); its output is the ViT's
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=5)
    model = peft.get_peft_model(vit, peft.LoraConfig(r=4, target_modules=["qkv"]))
    model = bayesify.convert(model, components=K).eval()
    assert bayesify.predictive.infer_task(model).classes == 5
    with torch.no_grad():
        probs = bayesify.uncertainty(model, torch.randn(2, 3, 32, 32)).probs
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
