"""The architecture sweep's shared logic: which models, at which input size, and what must hold.

Used by ``tests/benchmarks/test_sweep.py`` (a deterministic sample in CI, everything with
``BAYESIFY_SWEEP=all``) and by ``benchmarks/sweep.py --all`` (every model, one worker
subprocess per shard). One model is one *spec*: ``"timm/<name>"`` or ``"torchvision/<name>"``.

:func:`check` builds a model with random weights, converts it with ``components`` rank-1
components and asserts the converter's promises:

* identity at init: under ``bayesify.mode(model, route="tile", noise=False)`` every component
  reproduces the original output (relative error ``max |out_k - ref| / max |ref|`` < 1e-4);
* shapes: the default evaluation (mixture predictive) and training forwards return the original
  shapes, with no NaN/Inf;
* gradients: after one training step (cross-entropy + KL / N) every rank-1 parameter has a finite
  gradient; a layer without one fails the check unless ``bayesify.summary(model, x)`` names it as
  not in the compute path (nothing may be bypassed silently);
* the original Parameters are the same objects and the original ``state_dict`` keys are unchanged.

Input sizes follow timm's own ``tests/test_models.py`` (``_get_input_size``): a model with a
fixed input size runs at that size, one with a minimum size at its minimum, others shrunk to a
small target; if the *original* model cannot run at that size, larger sizes are tried, and a model
whose original forward fails at every size is skipped (not bayesify's failure).
"""

from __future__ import annotations

import fnmatch
import functools
import gc
import hashlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

import bayesify

__all__ = [
    "CheckFailure",
    "CheckSkip",
    "Result",
    "check",
    "ci_sample",
    "family",
    "list_specs",
    "meta_parameter_count",
    "pick_from_family",
]

SMALL_TARGET = 64  # input side the sweep shrinks to where the model allows it (timm's tests: 128)
LARGE_FIXED = 256  # a fixed-size model above this is first tried at img_size=224 (see _attempts)
RTOL = 1e-4  # identity at init: max |out_k - ref| / max |ref|
KL_N = 1000  # the "training set size" dividing the KL in the training step


class CheckFailure(AssertionError):
    """A broken promise of the converter; ``check`` names which one (``identity``, ``grad``, ...)."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"[{check}] {message}")
        self.check = check


class CheckSkip(Exception):
    """The model cannot be checked here (too big, or the original model itself does not run)."""


@dataclass
class Result:
    """What :func:`check` measured for one model."""

    model: str
    input_size: tuple[int, ...] | None = None
    build_kwargs: dict[str, Any] = field(default_factory=dict)
    params_original: int = 0
    params_added: int = 0
    converted_layers: int = 0
    skipped_layers: list[str] = field(default_factory=list)  # weight-bearing modules convert() left alone
    bypassed_layers: dict[str, str] = field(default_factory=dict)  # no gradient, and summary() says why
    identity_error: float = 0.0
    identity_error_float64: float | None = None  # only measured when float32 misses the tolerance

    @property
    def overhead_pct(self) -> float:
        return 100.0 * self.params_added / max(self.params_original, 1)


# ---- the model zoo ------------------------------------------------------------------------------


def list_specs(source: str | None = None) -> list[str]:
    """Every timm architecture and every torchvision classification model, as specs."""
    specs: list[str] = []
    if source in (None, "timm"):
        import timm

        specs += [f"timm/{name}" for name in timm.list_models()]
    if source in (None, "torchvision"):
        import torchvision

        specs += [f"torchvision/{name}" for name in torchvision.models.list_models(module=torchvision.models)]
    return specs


def family(spec: str) -> str:
    """The model's family: the module file that defines it (``timm/resnet``, ``torchvision/resnet``)."""
    source, name = spec.split("/", 1)
    try:
        if source == "timm":
            return f"timm/{_timm_modules()[name]}"
        import torchvision

        return f"torchvision/{torchvision.models.get_model_builder(name).__module__.rsplit('.', 1)[-1]}"
    except (KeyError, ValueError, ImportError):
        return f"{source}/?"


@functools.lru_cache(maxsize=None)
def _timm_modules() -> dict[str, str]:
    import timm

    return {name: module for module in timm.list_modules() for name in timm.list_models(module=module)}


def stable_hash(text: str) -> int:
    """A hash that is the same in every process and Python version (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big")


def _build(spec: str, **kwargs: Any) -> nn.Module:
    source, name = spec.split("/", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if source == "timm":
            import timm

            return timm.create_model(name, pretrained=False, **kwargs)
        if source == "torchvision":
            import torchvision

            return torchvision.models.get_model(name, weights=None, **kwargs)
    raise ValueError(f"unknown source {source!r} in spec {spec!r}; expected 'timm/<name>' or 'torchvision/<name>'.")


def meta_parameter_count(spec: str) -> int | None:
    """Parameter count of a model built on the meta device (no memory, ~0.3 s); None if it cannot be.

    (torchvision's RegNets compute their widths with tensors at construction: no meta build.)
    """
    try:
        with torch.device("meta"):
            model = _build(spec)
    except Exception:
        return None
    return sum(p.numel() for p in model.parameters())


def _timm_input_size(cfg: dict, target: int) -> tuple[int, ...]:
    # timm tests/test_models.py `_get_input_size`: fixed wins, then the minimum, else shrink to target
    input_size = tuple(cfg["input_size"])
    if cfg.get("fixed_input_size"):
        return input_size
    if max(input_size) > target:
        if cfg.get("min_input_size"):
            return tuple(cfg["min_input_size"])
        return tuple(min(x, target) for x in input_size)
    return input_size


def _attempts(spec: str) -> Iterator[tuple[dict[str, Any], tuple[int, ...]]]:
    """``(build kwargs, input size)`` to try, smallest first; the first the original model runs wins."""
    source, name = spec.split("/", 1)
    if source == "torchvision":
        # no size metadata to go by: small first; Inception's training-only aux head needs 299
        for side in (SMALL_TARGET, 128, 224, 299):
            yield {}, (3, side, side)
        return
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name).to_dict()
    if cfg.get("fixed_input_size") and max(cfg["input_size"][1:]) > LARGE_FIXED:
        # fixed 384..1024 px models (timm's own tests skip these): the same architecture is built for
        # 224 px where it takes img_size, which costs 3-20x less; else its own size below
        yield {"img_size": 224}, (cfg["input_size"][0], 224, 224)
    seen = set()
    for target in (SMALL_TARGET, 128, None):
        size = tuple(cfg["input_size"]) if target is None else _timm_input_size(cfg, target)
        if size not in seen:
            seen.add(size)
            yield {}, size


# ---- CI sample ----------------------------------------------------------------------------------

CI_MAX_PARAMS = 40_000_000  # the CI sample's size filter (chosen from the full sweep's timings)
CI_FAMILY_MAX_PARAMS = 100_000_000  # a timm family with no model under CI_MAX_PARAMS: its smallest, up to this

# models the CI sample leaves out, each with why (the full sweep still runs them)
CI_EXCLUDE: dict[str, str] = {}


def ci_excluded(spec: str) -> bool:
    return any(fnmatch.fnmatchcase(spec, pattern) for pattern in CI_EXCLUDE)


def ci_sample() -> list[str]:
    """The CI sample: ``timm-family/<module>`` for every timm model family, and every torchvision classifier.

    A family stands for one of its models, chosen by :func:`pick_from_family` when its test runs
    (choosing needs meta builds, too slow to do for all families at collection time).
    """
    import timm

    sample = [f"timm-family/{m}" for m in timm.list_modules()]
    return sample + [s for s in list_specs("torchvision") if not ci_excluded(s)]


def pick_from_family(
    family_name: str,
    max_params: int,
    exclude: Callable[[str], bool] = lambda spec: False,
    fallback_max_params: int | None = None,
) -> tuple[str | None, list[str]]:
    """The first model of a timm family in stable-hash order that has at most ``max_params``.

    If none has, the family's smallest model with at most ``fallback_max_params`` (so that families
    of only big models, such as BEiT, are still covered). Models with a fixed input size above
    ``LARGE_FIXED`` are passed over (they cost 3-20x more than their 224 px siblings).
    Returns ``(spec or None, specs passed over)``.
    """
    import timm
    from timm.models import get_pretrained_cfg

    module = family_name.split("/", 1)[1]  # "timm-family/<module>"
    passed: list[str] = []
    sizes: dict[str, int] = {}
    for name in sorted(timm.list_models(module=module), key=lambda n: stable_hash(n)):
        spec = f"timm/{name}"
        cfg = get_pretrained_cfg(name).to_dict()
        if exclude(spec) or (cfg.get("fixed_input_size") and max(cfg["input_size"][1:]) > LARGE_FIXED):
            passed.append(spec)
            continue
        count = meta_parameter_count(spec)
        if count is None:
            passed.append(spec)
            continue
        sizes[spec] = count
        if sizes[spec] <= max_params:
            return spec, passed
        passed.append(spec)
    if fallback_max_params is not None and sizes:
        smallest = min(sizes, key=lambda spec: (sizes[spec], spec))
        if sizes[smallest] <= fallback_max_params:
            return smallest, [s for s in passed if s != smallest]
    return None, passed


# ---- the check ----------------------------------------------------------------------------------


def _leaves(output: Any) -> list[Tensor]:
    return [t for t in tree_flatten(output)[0] if isinstance(t, Tensor)]


def _shapes(output: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in _leaves(output)]


def _require(ok: bool, check_name: str, message: str | Callable[[], str]) -> None:
    if not ok:
        raise CheckFailure(check_name, message() if callable(message) else message)


def _finite(output: Any, check_name: str, what: str) -> None:
    for i, t in enumerate(_leaves(output)):
        if t.is_floating_point() or t.is_complex():
            _require(bool(torch.isfinite(t).all()), check_name, f"{what}: output leaf {i} has NaN/Inf")


def _forward(model: nn.Module, x: Tensor, seed: int) -> Any:
    torch.manual_seed(seed)
    return model(x)


def _reference(spec: str, seed: int, batch: int) -> tuple[nn.Module, Tensor, Any, list[tuple[int, ...]], dict[str, Any]]:
    """The first ``(model, input, eval output, train output shapes, build kwargs)`` the original runs.

    The original must run in evaluation *and* training mode (Inception's training-only auxiliary
    head needs a larger input than its main path); BatchNorm statistics that the training forward
    updated are restored, so the model returned is the freshly built one, in eval mode.
    """
    errors: list[str] = []
    for kwargs, size in _attempts(spec):
        torch.manual_seed(seed)
        try:
            model = _build(spec, **kwargs)
        except Exception as exc:  # e.g. img_size= not accepted: try the next way
            errors.append(f"build{kwargs or ''}: {type(exc).__name__}: {exc}".splitlines()[0][:200])
            continue
        torch.manual_seed(seed + 1)
        x = torch.randn(batch, *size)
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        try:
            with torch.no_grad():
                train_shapes = _shapes(_forward(model.train(), x, seed))
                for name, b in model.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])
                ref = _forward(model.eval(), x, seed)
        except Exception as exc:
            errors.append(f"{tuple(size)}{kwargs or ''}: {type(exc).__name__}: {exc}".splitlines()[0][:200])
            del model, buffers
            continue
        return model, x, ref, train_shapes, kwargs
    raise CheckSkip("the original model does not run: " + " | ".join(errors))


def _loss(output: Any, seed: int) -> Tensor:
    """Cross-entropy on ``[B, classes]`` logits (random labels), mean square on anything else."""
    generator = torch.Generator().manual_seed(seed)
    terms = []
    for t in _leaves(output):
        if not t.is_floating_point() or not t.requires_grad:
            continue
        if t.dim() == 2 and t.shape[1] > 1:
            labels = torch.randint(t.shape[1], (t.shape[0],), generator=generator)
            terms.append(F.cross_entropy(t.float(), labels))
        else:
            terms.append(t.float().square().mean())
    if not terms:
        raise CheckFailure("train", "the training forward returned no differentiable output")
    return torch.stack(terms).sum()


def check(
    spec: str,
    *,
    components: int = 2,
    seed: int = 0,
    batch: int = 2,
    max_params: int | None = None,
    rtol: float = RTOL,
) -> Result:
    """Build, convert and check one model; raise :class:`CheckFailure` or :class:`CheckSkip`.

    Args:
        spec: ``"timm/<name>"`` or ``"torchvision/<name>"``.
        components: K of the conversion.
        seed: seeds initialisation, inputs and every forward (models random in eval stay comparable).
        batch: examples per forward (>= 2: BatchNorm in training needs more than one value).
        max_params: skip models with more parameters (counted on the meta device, before building).
    """
    result = Result(model=spec)
    if max_params is not None:
        _size_guard(meta_parameter_count(spec), max_params)
    model, x, ref, train_shapes, result.build_kwargs = _reference(spec, seed, batch)
    try:
        if max_params is not None:  # no meta count: the built model is counted
            _size_guard(sum(p.numel() for p in model.parameters()), max_params)
        result.input_size = tuple(x.shape[1:])
        if not all(torch.isfinite(t).all() for t in _leaves(ref) if t.is_floating_point()):
            raise CheckSkip("the original model's output has NaN/Inf at random init")

        def rebuild() -> nn.Module:  # the same original model again (seeded init)
            torch.manual_seed(seed)
            return _build(spec, **result.build_kwargs)

        _check_model(model, x, ref, train_shapes, components, seed, rtol, result, rebuild)
    finally:
        del model
        gc.collect()
    return result


def _identity_error(model: nn.Module, x: Tensor, ref: Any, components: int, seed: int) -> tuple[float, str]:
    """Largest ``max |member_k - ref| / max |ref|`` over members and output tensors, and where."""
    batch = x.shape[0]
    ref_leaves = _leaves(ref)
    with torch.no_grad(), bayesify.mode(model, route="tile", noise=False):
        tiled_leaves = _leaves(_forward(model, x, seed))
    _require(len(tiled_leaves) == len(ref_leaves), "identity", f"tile output has {len(tiled_leaves)} tensors, original {len(ref_leaves)}")
    worst, where = 0.0, ""
    for i, (out, r) in enumerate(zip(tiled_leaves, ref_leaves)):
        if not r.is_floating_point():
            continue
        batched = r.dim() > 0 and r.shape[0] == batch
        expect = (components * batch, *r.shape[1:]) if batched else tuple(r.shape)
        _require(tuple(out.shape) == expect, "identity", f"tile output leaf {i}: shape {tuple(out.shape)}, expected {expect}")
        _finite(out, "nonfinite", "tile output")
        members = out.reshape(components, *r.shape) if batched else out.unsqueeze(0)
        scale = r.abs().max().clamp_min(1e-6).item()
        for k in range(members.shape[0]):
            err = (members[k].to(r.dtype) - r).abs().max().item() / scale
            if err > worst or not where:
                worst, where = max(worst, err), f"component {k}, output leaf {i}"
    return worst, where


def _identity_error_float64(model: nn.Module, original: nn.Module, x: Tensor, components: int, seed: int) -> float | None:
    """:func:`_identity_error` with both models in float64 (None if the model cannot run in it)."""
    try:
        original.double().eval()
        with torch.no_grad():
            ref = _forward(original, x.double(), seed)
        del original
        model.double()  # same Parameter objects (data converted in place), back to float32 below
        return _identity_error(model, x.double(), ref, components, seed)[0]
    except CheckFailure:
        raise
    except Exception:
        return None
    finally:
        model.float()


def _size_guard(count: int | None, max_params: int) -> None:
    if count is not None and count > max_params:
        raise CheckSkip(f"size guard: {count / 1e6:.0f}M parameters > {max_params / 1e6:.0f}M")


def _check_model(
    model: nn.Module,
    x: Tensor,
    ref: Any,
    train_shapes: list[tuple[int, ...]],
    components: int,
    seed: int,
    rtol: float,
    result: Result,
    rebuild: Callable[[], nn.Module],
) -> None:
    ref_shapes = _shapes(ref)

    original_params = list(model.named_parameters())
    original_keys = list(model.state_dict().keys())
    result.params_original = sum(p.numel() for _, p in original_params)

    # classifiers say their task (timm's num_classes > 0, torchvision); a feature backbone's output is averaged
    task = "auto" if bayesify.predictive.infer_task(model) is not None else "regression"
    converted = bayesify.convert(model, components=components, task=task)
    _require(converted is model, "convert", "convert() returned a different object than it was given")

    # (e) same Parameter objects under the same names; original state_dict keys unchanged
    now = dict(model.named_parameters())
    for name, p in original_params:
        _require(name in now, "params", f"parameter {name} disappeared")
        _require(now[name] is p, "params", f"parameter {name} is a new object (must be the original Parameter)")
    keys = [k for k in model.state_dict().keys() if not any(part.startswith("rank1_") for part in k.split("."))]
    _require(keys == original_keys, "state_dict", lambda: _key_diff(original_keys, keys))

    added = list(bayesify.rank1_parameters(model))
    result.params_added = sum(p.numel() for p in added)
    layers = list(bayesify.rank1_layers(model))
    result.converted_layers = len(layers)
    result.skipped_layers = sorted(bayesify.summary(model).skipped)

    # (a) identity at init: every component's posterior-mean member reproduces the original
    err, where = _identity_error(model, x, ref, components, seed)
    result.identity_error = err
    if err >= rtol:
        # a deep random-init network can amplify float32 rounding (bayesify adds the bias after the
        # product, not fused into the kernel) into a visible difference: decide in float64, where
        # rounding is 1e-9 times smaller and only a real difference survives
        err64 = _identity_error_float64(model, rebuild(), x, components, seed)
        result.identity_error_float64 = err64
        _require(
            err64 is not None and err64 < rtol,
            "identity",
            f"{where}: relative error {err:.2e} >= {rtol:g} in float32, "
            + (f"{err64:.2e} in float64" if err64 is not None else "and the model does not run in float64"),
        )

    # (b, c) default evaluation: the mixture predictive, original shapes, finite
    with torch.no_grad():
        mixed = _forward(model, x, seed)
    _require(_shapes(mixed) == ref_shapes, "shape", f"eval (mixture) output shapes {_shapes(mixed)} != original {ref_shapes}")
    _finite(mixed, "nonfinite", "eval (mixture) output")
    del mixed

    # (b, c, d) one training step: original training shapes, finite, a finite gradient on every rank-1 parameter
    model.train()
    out = _forward(model, x, seed)
    _require(_shapes(out) == train_shapes, "shape", f"train output shapes {_shapes(out)} != original {train_shapes}")
    _finite(out, "nonfinite", "train output")
    loss = _loss(out, seed) + bayesify.kl_divergence(model) / KL_N
    _require(bool(torch.isfinite(loss)), "nonfinite", f"training loss is {loss.item()}")
    loss.backward()
    del out, loss

    missing: dict[str, list[str]] = {}
    for name, layer in layers:
        for pname, p in _named_rank1(layer):
            if p.grad is None:
                missing.setdefault(name, []).append(pname)
            else:
                _require(bool(torch.isfinite(p.grad).all()), "grad", f"{name}.{pname}: non-finite gradient")
    if missing:
        # allowed only where summary() tells the user this layer is not in the compute path
        model.zero_grad(set_to_none=True)
        report = bayesify.summary(model, x)
        silent = [n for n in missing if n not in report.bypassed]
        _require(
            not silent,
            "grad",
            lambda: f"no gradient for {len(silent)} rank-1 layer(s) that summary() does not report as bypassed: "
            + ", ".join(f"{n} ({'/'.join(missing[n])})" for n in silent[:5]),
        )
        result.bypassed_layers = {n: report.bypassed[n] for n in missing}
    model.zero_grad(set_to_none=True)


def _named_rank1(layer: bayesify.Rank1Layer) -> Iterator[tuple[str, nn.Parameter]]:
    ids = {id(p) for p in layer.rank1_parameters()}
    for name, p in layer.named_parameters():
        if id(p) in ids:
            yield name, p


def _key_diff(before: list[str], after: list[str]) -> str:
    lost = [k for k in before if k not in set(after)]
    new = [k for k in after if k not in set(before)]
    if not lost and not new:
        return "original state_dict keys changed order"
    return f"state_dict keys changed: lost {lost[:5]}, new {new[:5]}"


def timed_check(spec: str, **kwargs: Any) -> dict[str, Any]:
    """:func:`check` as a results-file record: status pass/fail/skip, reason, params, seconds."""
    start = time.perf_counter()
    record: dict[str, Any] = {"model": spec, "family": family(spec), "components": kwargs.get("components", 2)}
    try:
        res = check(spec, **kwargs)
    except CheckSkip as exc:
        record.update(status="skip", check=None, reason=str(exc)[:500])
    except CheckFailure as exc:
        record.update(status="fail", check=exc.check, reason=str(exc)[:500])
    except Exception as exc:  # a crash inside convert / forward / backward of the converted model
        record.update(status="fail", check=f"error:{type(exc).__name__}", reason=f"{type(exc).__name__}: {exc}"[:500])
    else:
        record.update(
            status="pass",
            check=None,
            reason="",
            input_size=list(res.input_size or ()),
            build_kwargs=res.build_kwargs,
            params_original=res.params_original,
            params_added=res.params_added,
            overhead_pct=round(res.overhead_pct, 4),
            converted_layers=res.converted_layers,
            skipped_layers=res.skipped_layers[:20],
            bypassed_layers=res.bypassed_layers,
            identity_error=res.identity_error,
            identity_error_float64=res.identity_error_float64,
        )
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record
