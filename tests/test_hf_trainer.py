"""A converted Hugging Face model under ``transformers.Trainer`` (KL in ``compute_loss``) and ``generate``.

The ``BayesianTrainer`` below is the README's "Hugging Face Trainer" snippet with the KL warm-up as a
constructor argument; ``test_the_readme_trainer_...`` runs the README's own code. All offline on the
CPU, with a 2-layer GPT-2 built from a config (no weights are downloaded).
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import bayesify

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

VOCAB, LENGTH = 24, 12


# ---- the README snippet ------------------------------------------------------------------------


class BayesianTrainer(Trainer):
    """``Trainer`` whose training loss is the ELBO per example: the model's NLL + w * KL / N."""

    def __init__(self, *args, kl_warmup_steps: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kl_warmup_steps = kl_warmup_steps

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)  # the Trainer's NLL
        if model.training:  # (evaluation: the model's loss is already the mixture's NLL)
            # the KL term: KL / N, its weight warmed up linearly over the first kl_warmup_steps steps, counted once a
            # step whatever the gradient accumulation
            weight = min(1.0, (self.state.global_step + 1) / max(1, self.kl_warmup_steps))
            kl = weight * bayesify.kl_divergence(model) / len(self.train_dataset)
            loss = loss + kl * bayesify.hf.kl_share(self, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def get_decay_parameter_names(self, model):  # no weight decay on bayesify's parameters
        return bayesify.hf.decay_parameter_names(model, super().get_decay_parameter_names(model))


# ---- fixtures ------------------------------------------------------------------------------------


def tiny_gpt2(components: int = 4, dtype: torch.dtype = torch.float32, init_std: float = 0.02) -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=2 * LENGTH, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=init_std,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).to(dtype)
    return bayesify.convert(model, components=components)


def counting_sequences(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``start, start + 1, ...`` mod VOCAB: a language a 2-layer model learns in a few steps."""
    starts = torch.randint(VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    ids = (starts + torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(tmp_path: Path, **overrides: object) -> TrainingArguments:
    settings = dict(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", per_device_train_batch_size=8,
        per_device_eval_batch_size=8, learning_rate=1e-2, num_train_epochs=1, logging_steps=1, disable_tqdm=True,
        seed=0,
    )  # fmt: skip
    settings.update(overrides)
    return TrainingArguments(**settings)


def perturb_factors(model: torch.nn.Module, scale: float, seed: int = 0) -> None:
    """Move each component's factors away from 1 so that the K members disagree."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bayesify.rank1_parameters(model):
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def mixture_nll_by_hand(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """``-mean_tokens log mean_k p_k(next token)`` from the K posterior-mean members, in float64."""
    members = bayesify.predict(model.eval(), input_ids=ids, noise=False).logits.double()  # [K, B, T, V]
    log_mixture = torch.logsumexp(members.log_softmax(-1), 0) - math.log(members.shape[0])
    return float(F.nll_loss(log_mixture[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)))


def member_nll_by_hand(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """The members' mean NLL (what the loss was before bayesify recomputed it from the mixture)."""
    members = bayesify.predict(model.eval(), input_ids=ids, noise=False).logits.double()
    per_member = [F.cross_entropy(m[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) for m in members]
    return float(torch.stack(per_member).mean())


# ---- tests ---------------------------------------------------------------------------------------


def test_compute_loss_adds_the_weighted_kl_per_example(tmp_path: Path) -> None:
    model = tiny_gpt2()
    with torch.no_grad():  # away from the prior (where the posterior starts, a KL of 0), so the term counts
        for p in bayesify.rank1_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    train = counting_sequences(32, seed=0)
    trainer = BayesianTrainer(model=model, args=arguments(tmp_path), train_dataset=train, kl_warmup_steps=4)
    batch = {k: torch.stack([row[k] for row in train[:8]]) for k in ("input_ids", "labels")}
    model.train()
    trainer.state.global_step = 1  # weight (1 + 1) / 4
    torch.manual_seed(3)
    loss = trainer.compute_loss(model, dict(batch))
    torch.manual_seed(3)  # the same components and factor samples
    nll = model(**batch).loss
    kl = bayesify.kl_divergence(model)
    assert kl > 0
    torch.testing.assert_close(loss, nll + 0.5 * kl / 32)


def test_training_lowers_the_mixture_nll(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_gpt2()
    train, held_out = counting_sequences(64, seed=0), counting_sequences(16, seed=1)
    ids = torch.stack([row["input_ids"] for row in held_out])
    before = mixture_nll_by_hand(model, ids)
    trainer = BayesianTrainer(
        model=model, args=arguments(tmp_path, num_train_epochs=4), train_dataset=train, kl_warmup_steps=16
    )
    rank1_before = [p.detach().clone() for p in bayesify.rank1_parameters(model)]
    trainer.train()
    after = mixture_nll_by_hand(model, ids)
    assert after < 0.5 * before, (before, after)
    moved = [not torch.equal(a, p) for a, p in zip(rank1_before, bayesify.rank1_parameters(model))]
    assert all(moved), "every rank-1 factor is trained"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 32 and all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("recipe", ["this-file", "readme"])
@pytest.mark.parametrize("accumulation, lengths", [(1, "equal"), (2, "equal"), (2, "ragged")])
def test_one_step_equals_sgd_on_the_elbo_by_hand(tmp_path: Path, accumulation: int, lengths: str, recipe: str) -> None:
    """The Trainer's step is SGD on NLL + KL / N, also with gradient accumulation (the KL counted once), the NLL
    weighting every labelled token of the step alike: with sequences of other lengths the README's recipe took the
    mean of the micro-batches' means (a short sequence's tokens weighted above a long one's).

    One component and no noise make the forward pass deterministic, so the update can be computed by hand.
    """
    model = tiny_gpt2(components=1, dtype=torch.float64)
    model.loss_type = "ForCausalLM"  # the Trainer counts the shifted labels (see test_evaluate_reports_the_mixture_nll)
    perturb_factors(model, 0.1)
    reference = copy.deepcopy(model)
    train = counting_sequences(8, seed=0)  # one step takes all of it, in whatever order
    if lengths == "ragged":  # 1-7 and 11 labelled next tokens: no split of the 8 into two halves has equal counts
        for row, length in zip(train, (2, 3, 4, 5, 6, 7, 8, 12)):
            row["labels"] = row["labels"].clone()
            row["labels"][length:] = -100
    args = arguments(
        tmp_path, optim="sgd", learning_rate=0.1, weight_decay=0.0, max_grad_norm=0.0, max_steps=1,
        per_device_train_batch_size=8 // accumulation, gradient_accumulation_steps=accumulation, logging_steps=10,
    )  # fmt: skip
    if recipe == "readme":  # its KL warmed up over 500 steps: weight 1 / 500 at the first
        trainer, weight = readme_trainer()(model=model, args=args, train_dataset=train), 1 / 500
    else:
        trainer, weight = BayesianTrainer(model=model, args=args, train_dataset=train, kl_warmup_steps=1), 1.0
    with bayesify.mode(model, noise=False):
        trainer.train()

    batch = {k: torch.stack([row[k] for row in train]) for k in ("input_ids", "labels")}
    reference.train()
    with bayesify.mode(reference, noise=False):
        loss = reference(**batch).loss + weight * bayesify.kl_divergence(reference) / len(train)
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12, msg=name)


def test_evaluate_reports_the_mixture_nll(tmp_path: Path) -> None:
    """``trainer.evaluate()``'s eval_loss is the predictive NLL of the K-member mixture, not K times it
    (``num_items_in_batch`` counts the untiled labels) nor the members' mean NLL. 20 examples in batches of 8
    (8, 8, 4): the Trainer weights each batch's mean by its size, so equal-length rows give the token mean."""
    model = tiny_gpt2(init_std=0.2)  # confident members
    perturb_factors(model, 0.5)
    # GPT-2 states no loss_type, so the Trainer counts the unshifted labels in num_items_in_batch and reports (T-1)/T
    # of any GPT-2's eval_loss, converted or not (the model's loss divides by it): stated, the count is the tokens'
    model.loss_type = "ForCausalLM"
    data = counting_sequences(20, seed=2)
    ids = torch.stack([row["input_ids"] for row in data])
    trainer = BayesianTrainer(model=model, args=arguments(tmp_path), train_dataset=data, eval_dataset=data)
    assert trainer.model_accepts_loss_kwargs  # so the Trainer passes num_items_in_batch to the model
    with bayesify.mode(model, noise=False):  # posterior means: the same members as by hand
        eval_loss = trainer.evaluate()["eval_loss"]
    expected, members = mixture_nll_by_hand(model, ids), member_nll_by_hand(model, ids)
    assert members - expected > 0.05  # the members disagree enough for the two to differ
    assert eval_loss == pytest.approx(expected, rel=1e-5)


def test_generate_greedy_decodes_the_mixture() -> None:
    """``generate`` in eval continues all K members in its KV cache and picks each next token from the
    mixture: the same tokens as greedy decoding of the mixture without a cache."""
    model = tiny_gpt2(init_std=0.2)
    perturb_factors(model, 0.5)
    model.eval()
    prompt = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(0))
    with bayesify.mode(model, noise=False), torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
        by_hand = prompt
        for _ in range(6):
            next_token = model(by_hand).logits[:, -1].argmax(-1, keepdim=True)
            by_hand = torch.cat([by_hand, next_token], 1)
    assert generated.shape == (3, 5 + 6)
    assert torch.equal(generated, by_hand)


# ---- weight decay: none on bayesify's parameters ----------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_trainer() -> type:
    """The README's ``BayesianTrainer``, executed as written."""
    code = re.search(r"\*\*Hugging Face `Trainer`\*\*.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {"Trainer": Trainer, "bayesify": bayesify}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace["BayesianTrainer"]


@pytest.mark.parametrize("trainer_class", [readme_trainer, lambda: BayesianTrainer], ids=["readme", "this-file"])
def test_the_readme_trainer_does_not_decay_rank1_parameters(tmp_path: Path, trainer_class) -> None:
    model = tiny_gpt2()
    trainer = trainer_class()(model=model, args=arguments(tmp_path, weight_decay=0.01), train_dataset=[])
    optimizer = trainer.create_optimizer()
    added = {id(p) for p in bayesify.rank1_parameters(model)}
    decayed = [p for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]]
    undecayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert added and added <= undecayed, "every rank-1 parameter is in a group without weight decay"
    assert not added & {id(p) for p in decayed}
    # the network's own weights are decayed as before: Trainer's names, less bayesify's only
    own = [n for n in Trainer.get_decay_parameter_names(trainer, model) if "rank1_" not in n]
    assert trainer.get_decay_parameter_names(model) == own
    params = dict(model.named_parameters(remove_duplicate=False))
    assert {id(p) for p in decayed} == {id(params[n]) for n in own} != set()  # (lm_head.weight is wte.weight)


def test_decay_parameter_names_finds_bayesify_parameters_by_identity() -> None:
    model = tiny_gpt2()
    loc = next(bayesify.rank1_parameters(model))
    model.register_parameter("alias", loc)  # a rank-1 parameter under a name without rank1_ in it
    names = ["alias", "lm_head.weight", "transformer.h.0.attn.c_attn.weight", "lm_head.rank1_s.loc"]
    names.append("transformer.h.0.attn.no_such_parameter")  # a slot holding None: kept, as the Trainer gave it
    assert bayesify.hf.decay_parameter_names(model, names) == [
        "lm_head.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.no_such_parameter"
    ]  # fmt: skip
    with pytest.raises(TypeError, match=r"names='lm_head.weight' must be a list of parameter names"):
        bayesify.hf.decay_parameter_names(model, "lm_head.weight")
