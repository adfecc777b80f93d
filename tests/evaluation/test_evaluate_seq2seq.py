"""evaluate() on a converted sequence-to-sequence model (T5, BART) with Trainer-style batches ({"input_ids",
"labels"}): evaluation keeps the labels from the model (they are the target), so the model never made its decoder
inputs from them and T5 ended in "You must specify exactly one of input_ids or inputs_embeds". The decoder inputs
are now made from the labels as the model's own forward makes them, so evaluate's NLL is the model's own loss."""

import pytest
import torch

import bayesify
from bayesify.evaluation import evaluate

transformers = pytest.importorskip("transformers")

SEQ2SEQ = {"vocab_size": 60, "decoder_start_token_id": 0, "pad_token_id": 1}


def _t5():
    return transformers.T5ForConditionalGeneration(
        transformers.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, **SEQ2SEQ)
    )


def _bart():
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, **SEQ2SEQ))  # fmt: skip


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """6 source sequences of 8 tokens and their labels of 5, the labels of every other one padded with -100 after
    its 3rd token (what transformers' DataCollatorForSeq2Seq pads them with)."""
    g = torch.Generator().manual_seed(1)
    source, labels = torch.randint(2, 60, (6, 8), generator=g), torch.randint(2, 60, (6, 5), generator=g)
    labels[::2, 3:] = -100
    return source, labels


@pytest.mark.parametrize("make", [_t5, _bart], ids=["t5", "bart"])
def test_a_seq2seq_models_nll_is_its_own_eval_loss_on_input_ids_and_labels(make) -> None:
    torch.manual_seed(0)
    model = bayesify.convert(make(), components=2, init="normal").eval()
    source, labels = _batch()
    with torch.no_grad():
        expected = model(input_ids=source, labels=labels).loss  # the mixture's NLL, -100 labels ignored
    data = [{"input_ids": s, "labels": y} for s, y in zip(source, labels)]
    results = evaluate(model, data, batch_size=6, ignore_index=-100)
    assert results["ignored"] == int((labels == -100).sum())
    assert results["nll"] == pytest.approx(float(expected), rel=1e-5)


def test_decoder_inputs_a_batch_has_are_kept() -> None:
    """Decoder inputs given in the batch are the model's, not replaced by ones made from the labels."""
    torch.manual_seed(0)
    model = bayesify.convert(_t5(), components=2, init="normal").eval()
    source, labels = _batch()
    decoder = torch.randint(2, 60, labels.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids=source, decoder_input_ids=decoder, labels=labels).loss
        made = model(input_ids=source, labels=labels).loss
    assert float(expected) != pytest.approx(float(made), rel=1e-3)  # (else this test could not tell them apart)
    data = [{"input_ids": s, "decoder_input_ids": d, "labels": y} for s, d, y in zip(source, decoder, labels)]
    results = evaluate(model, data, batch_size=6, ignore_index=-100)
    assert results["nll"] == pytest.approx(float(expected), rel=1e-5)
