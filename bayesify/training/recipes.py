"""The paper's training recipes, as presets of :class:`~bayesify.training.TrainConfig` values.

From METHOD.md and the reference ``baselines/{cifar,imagenet}/rank1_bnn.py`` (MIMIC-III: the
paper's appendix). Epoch-relative entries (``*_fraction``) are scaled to the run's epochs;
``base_lr`` is for ``lr_batch`` examples per step and scaled linearly to the run's batch size.
Explicit settings always win over a preset.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS", "apply_preset"]

PRESETS: dict[str, dict[str, Any]] = {
    "cifar10": dict(
        components=4, route="tile", optimizer="sgd", momentum=0.9, nesterov=True, base_lr=0.1, lr_batch=128,
        batch_size=128, epochs=250, warmup_epochs=1.0, decay_fractions=(80 / 200, 160 / 200, 180 / 200),
        decay_ratio=0.2, l2=1e-4, l2_norm_layers=True, prior_std=0.1, init="random_sign", init_sign_p=0.5,
        init_dropout=1e-3, init_jitter=0.1, kl_annealing_fraction=200 / 250,
    ),
    "cifar100": dict(
        components=4, route="tile", optimizer="sgd", momentum=0.9, nesterov=True, base_lr=0.1, lr_batch=128,
        batch_size=128, epochs=250, warmup_epochs=1.0, decay_fractions=(80 / 200, 160 / 200, 180 / 200),
        decay_ratio=0.2, l2=3e-4, l2_norm_layers=True, prior_std=0.1, init="random_sign", init_sign_p=0.5,
        init_dropout=1e-3, init_jitter=0.1, kl_annealing_fraction=200 / 250,
    ),
    "imagenet": dict(
        components=4, route="tile", optimizer="sgd", momentum=0.9, nesterov=True, base_lr=0.1, lr_batch=256,
        batch_size=256, epochs=135, warmup_epochs=5.0, decay_fractions=(45 / 135, 90 / 135, 120 / 135),
        decay_ratio=0.1, l2=1e-4, l2_norm_layers=False, prior_std=0.05, init="random_sign", init_sign_p=0.75,
        init_dropout=1e-3, init_jitter=0.1, kl_annealing_fraction=90 / 135,
    ),
    "mimic": dict(
        components=4, route="tile", optimizer="adam", lr=3e-4, batch_size=128, max_steps=25_000, epochs=10_000,
        embeddings=True,
    ),
}  # fmt: skip


def apply_preset(name: str | None, explicit: dict[str, Any]) -> dict[str, Any]:
    """The config values of preset ``name`` scaled to the run, with ``explicit`` values on top.

    Raises:
        ValueError: an unknown preset name.
    """
    if name is None:
        return dict(explicit)
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not one of {sorted(PRESETS)}.")
    preset = dict(PRESETS[name])
    epochs = explicit.get("epochs", preset["epochs"])
    batch = explicit.get("batch_size", preset["batch_size"])
    values: dict[str, Any] = {}
    if "decay_fractions" in preset:
        values["decay_epochs"] = tuple(round(f * epochs, 4) for f in preset.pop("decay_fractions"))
    if "kl_annealing_fraction" in preset:
        values["kl_annealing_epochs"] = round(preset.pop("kl_annealing_fraction") * epochs, 4)
    if "base_lr" in preset:
        values["lr"] = preset.pop("base_lr") * batch / preset.pop("lr_batch")
    values.update(preset)
    values.update(explicit)
    return values
