"""``torch.compile`` of converted models: bayesify's code causes no graph breaks.

Graph breaks are counted (``torch._dynamo.utils.counters["graph_break"]`` after
``torch._dynamo.reset()``), not graphs: ``torch.compile(model)`` runs a module's forward hooks
outside dynamo (``nn.Sequential`` excepted), so the routing pre-hook, the forward and, in
evaluation, the mixture post-hook are compiled as separate frames without any break between them.
The ``eager`` backend is enough to find breaks (they are dynamo's, whatever the backend) and keeps
the tests fast. The other layer families: ``tests/layers/test_compile_families.py``.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import bayesify
from tests._rank1 import perturb


def compiled_breaks(model: nn.Module, *inputs: torch.Tensor, calls: int = 1) -> tuple[dict[str, int], list[int]]:
    """``({reason: count}, [graphs after each call])`` of ``calls`` forward passes of ``torch.compile(model)``."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    graphs = []
    for _ in range(calls):
        compiled(*inputs)
        graphs.append(counters["stats"]["unique_graphs"])
    return {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}, graphs


def perturbed(net: nn.Module, **options) -> nn.Module:
    model = bayesify.convert(net, components=4, task="classification", **options)
    return perturb(model)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 5),
    )  # fmt: skip


def _vit() -> nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, num_classes=5
    )


MODELS = {"cnn": (_cnn, (8, 3, 8, 8)), "vit": (_vit, (4, 3, 32, 32))}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(MODELS))
def test_no_graph_breaks_from_bayesify(name: str, training: bool) -> None:
    make, shape = MODELS[name]
    plain = make().train(training)
    model = perturbed(copy.deepcopy(plain)).train(training)  # train: sample route; eval: mixture route
    x = torch.randn(*shape)
    breaks, graphs = compiled_breaks(model, x, calls=3)
    plain_breaks, _ = compiled_breaks(plain, x)
    assert breaks == plain_breaks, f"graph breaks from bayesify: {breaks}"
    # the random order of the components in training is a tensor: no recompilation from one step to the next
    assert graphs[0] == graphs[-1]
    copy.deepcopy(model)  # nothing of the traced forward passes is left in the model's state


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_mixture_equals_eager(name: str) -> None:
    make, shape = MODELS[name]
    model = perturbed(make()).eval()
    x = torch.randn(*shape)
    torch._dynamo.reset()
    with torch.no_grad(), bayesify.mode(model, noise=False):
        torch.testing.assert_close(torch.compile(model, backend="eager")(x), model(x))


# ---- fullgraph: real architectures, every route, against eager (issue 27) ----------------------------------------


def _resnet18() -> tuple[nn.Module, torch.Tensor]:
    timm = pytest.importorskip("timm")
    return timm.create_model("resnet18", num_classes=5, pretrained=False), torch.randn(4, 3, 32, 32)


def _vit_tiny() -> tuple[nn.Module, torch.Tensor]:
    return _vit(), torch.randn(4, 3, 32, 32)


class _GPT2(nn.Module):
    """A 2-layer Hugging Face GPT-2 language model returning its logits ``[B, T, V]``."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        self.gpt = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens).logits


def _gpt2() -> tuple[nn.Module, torch.Tensor]:
    return _GPT2(), torch.randint(0, 64, (4, 8))


@pytest.mark.parametrize("route", ["sample", "tile", "mixture"])
@pytest.mark.parametrize("make", [_resnet18, _vit_tiny, _gpt2], ids=["resnet18", "vit", "gpt2"])
def test_fullgraph_compile_of_every_route_equals_eager(make, route: str) -> None:
    """``torch.compile(model, fullgraph=True)`` traces a converted timm ResNet / ViT and Hugging Face GPT-2 in one
    graph per frame (no break at all), in training (default and tiled routes: outputs and every gradient) and
    evaluation (the mixture), and gives eager's values. ``aot_eager`` traces the backward as inductor would, without
    its code generation (minutes on the CPU): the values are the traced graph's own."""
    base, x = make()
    model = bayesify.convert(base, components=4, task="classification", class_axis=-1)
    model.train(route != "mixture")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    outputs, grads = [], []
    for forward in (model, compiled):
        model.zero_grad()
        torch.manual_seed(0)  # the same order of the components
        tiled = {"route": "tile"} if route == "tile" else {}
        with bayesify.mode(model, noise=False, **tiled), torch.set_grad_enabled(route != "mixture"):
            out = forward(x)
        if route != "mixture":
            out.float().square().mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        outputs.append(out.detach())
    torch.testing.assert_close(outputs[1], outputs[0])
    if grads:
        assert grads[0].keys() == grads[1].keys() and any("rank1_" in n for n in grads[0])
        for name in grads[0]:
            torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)


def test_inductor_training_step_on_the_cpu_draws_eager_numbers() -> None:
    """Inductor compiles the sampled training pass on the CPU with the eager pass's very random numbers (the noise is
    an op it calls, not one it lowers: its own generator is ~40 ns a number there) and neither recomputes them in
    the backward nor merges two draws: from one seed, the compiled step's outputs and gradients are eager's."""
    make, shape = MODELS["cnn"]
    model = perturbed(make()).train()
    x = torch.randn(*shape)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    outputs, grads = [], []
    for forward in (model, compiled, compiled):
        model.zero_grad()
        torch.manual_seed(0)
        out = forward(x)
        out.square().mean().backward()
        outputs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert any("rank1_s" in n for n in grads[0])
    for i in (1, 2):
        torch.testing.assert_close(outputs[i], outputs[0])
        for name in grads[0]:
            torch.testing.assert_close(grads[i][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)
    torch.manual_seed(1)
    assert not torch.allclose(compiled(x), outputs[0])  # (the numbers are drawn, not baked into the graph)


def test_inductor_keeps_the_order_of_a_passs_noise_draws() -> None:
    # a sampled pass draws twice (a value per block, then per row) with no data between the two: inductor ordered
    # them as it liked (in a training pass under torch.no_grad() the draw per row came first, taking the block's
    # numbers: 0.29 off eager from one seed); each draw now takes the last as an input it does not read
    model = bayesify.convert(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5)), components=4,
                             task="classification").train()  # fmt: skip
    x = torch.randn(8, 6)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.manual_seed(0)
        eager = model(x)
        torch.manual_seed(0)
        torch.testing.assert_close(compiled(x), eager)


# ---- replay safety: what a CUDA graph captures is what every pass runs (issue 27) ---------------------------------

_HOST_READS = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "repeat_interleave", "is_nonzero", "equal")
_HOST_WRITES = ("lift_fresh",)  # torch.tensor(data): on CUDA a copy from the host, which a capture refuses


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Every op a pass dispatches, with its inputs' shapes, dtypes and devices."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        shapes = tuple((tuple(a.shape), a.dtype, a.device.type) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("make", [_resnet18, _vit_tiny, _gpt2], ids=["resnet18", "vit", "gpt2"])
def test_every_pass_after_the_first_is_the_same_ops_with_no_host_read(make, training: bool) -> None:
    """What a CUDA graph (``torch.cuda.graphs``, ``torch.compile(mode="reduce-overhead")``) captures of a converted
    model's step is what every eager step would run: after one pass (which learns how the layers take their draws
    and makes the index of the columns they take; torch's own recipe warms up three) each pass
    dispatches the very same ops on the same shapes, and bayesify adds no op that reads a value back to the host
    (no ``.item()``, no data-dependent shape: the random components of the rows are a tensor) and none that makes
    a tensor from host data (the original's own are its own: Hugging Face's mask code makes 4 a pass), so a replay
    skipping the Python routing is the pass. Its random numbers come from the device's generator, which a captured
    graph advances at each replay."""
    base, x = make()
    plain = copy.deepcopy(base).train(training)
    model = bayesify.convert(base, components=4, task="classification", class_axis=-1).train(training)

    def step(net: nn.Module) -> list[tuple]:
        with _OpLog() as log, torch.set_grad_enabled(training):
            out = net(x)
            if training:
                out.float().square().mean().backward()
        return log.ops

    logs = [step(model) for _ in range(4)][1:]
    assert logs[0] == logs[1] == logs[2]
    original = step(plain)

    def host(ops: list[tuple], names: tuple[str, ...]) -> list[str]:
        return [op for op, _ in ops if any(name in op for name in names)]

    assert host(logs[0], _HOST_READS) == host(original, _HOST_READS) == [], "ops that read a device value on the host"
    assert len(host(logs[0], _HOST_WRITES)) == len(host(original, _HOST_WRITES)), "tensors made from host data"


def test_compiled_folded_blocks_keep_eagers_dtype_under_autocast() -> None:
    # in a graph a folded block's bias is added after its map: in the map's dtype, as the map would have added it
    model = bayesify.convert(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)), components=4,
                             sampling="component").train()  # fmt: skip
    x = torch.randn(8, 3, 8, 8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(0)
        eager = model(x)
        torch.manual_seed(0)
        traced = compiled(x)
    assert eager.dtype == traced.dtype == torch.bfloat16
    torch.testing.assert_close(traced.float(), eager.float(), rtol=2e-2, atol=2e-2)


def test_compiled_evaluation_runs_each_convolution_once_for_all_members() -> None:
    # eager evaluation folds a small convolution's K member weights (K convolutions of B rows); in a compiled graph
    # the per-row scalings fuse into their neighbours, so each convolution runs once over the K*B rows
    model = bayesify.convert(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 12 * 12, 4)),
                             components=4, task="classification")  # fmt: skip
    x = torch.randn(8, 3, 16, 16)
    model.eval()(x)
    convolutions: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        convolutions.append(sum(node.target in (torch.conv2d, F.conv2d) for node in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, backend=backend, fullgraph=True)(x)
    assert sum(convolutions) == 2  # (K = 4 folded: 8)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def test_a_compiled_pass_takes_each_rows_draw_from_its_block() -> None:
    # the sample route's rows run in blocks of one component: in a graph a row's draw is its block's, expanded (it
    # fuses into the noise draw, and its backward is a sum per block), not a one-hot GEMM per row each way
    model = bayesify.convert(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), components=4, task="classification")
    x = torch.randn(10, 6)  # blocks of 3, 3, 2, 2 rows
    one_hot_rows: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        one_hot_rows.extend(n.meta["example_value"].shape[0] for n in gm.graph.nodes if n.target is F.one_hot)
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = model(x)
    torch.manual_seed(0)
    compiled = torch.compile(model, backend=backend, fullgraph=True)(x)
    assert one_hot_rows and set(one_hot_rows) == {4}, one_hot_rows  # the blocks' K components only (was: 10 rows)
    torch.testing.assert_close(compiled, eager)  # the very draws: same rows, same noise


@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 14),
    reason="torch 2.9 traces the root's hooks and the layers as frames of their own, whose sizes it cannot relate",
)
def test_a_dynamic_compile_of_the_evaluation_mixture_serves_every_batch_size_with_one_graph() -> None:
    """``torch.compile(model, dynamic=True)`` in evaluation (a server's varying batch sizes): the members' blocks were
    compared through a set of their sizes, whose hashing fixed the batch to its first value, so every batch size
    compiled a graph of its own until dynamo's recompile limit, then ran eagerly."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5)), components=3,
                             task="classification", init="normal").eval()  # fmt: skip
    compiled = torch.compile(model, dynamic=True, backend="eager")
    with torch.no_grad():
        for batch in range(2, 12):
            x = torch.randn(batch, 6)
            torch.testing.assert_close(compiled(x), model(x))
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


class _Blocks(nn.Module):
    """``depth`` identical blocks under a root of its own (as timm's and Hugging Face's models are: torch.compile
    runs its hooks as frames of their own)."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(depth))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(1))


def _kernels_compiled(depth: int, converted: bool) -> int:
    """How many kernels inductor writes for one training step of ``_Blocks(depth)`` (converted or not), forward and
    backward."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Blocks(depth)
    model = bayesify.convert(model, components=4, task="classification") if converted else model
    compiled = torch.compile(model.train())

    def step() -> None:
        compiled(torch.randn(8, 5, 16)).logsumexp(-1).sum().backward()

    _, sources = run_and_get_code(step)
    return sum(source.count("= async_compile.") for source in sources)


def test_compiled_repeated_blocks_share_their_kernels() -> None:
    # a repeated block's layers read their draws at offset 0 (each its own piece of the pass's draws, taken in the
    # root's pre-hook graph), so inductor writes one kernel for them all, as for the original network: a ViT-tiny
    # step compiled 88 kernels where the original compiles 19 when each piece was a slice of its group, at an offset
    # of its own in the forward graph (a kernel per layer: 30 -> 37 kernels here from 3 to 5 blocks, the original
    # 13 -> 16). (ViT-tiny at 64 px, CPU: 88 -> 34 kernels, its step's compile time 101 -> 81 s against 30 s)
    added = _kernels_compiled(5, True) - _kernels_compiled(3, True)
    assert added <= _kernels_compiled(5, False) - _kernels_compiled(3, False), added


def _copies_of_rows(backend: str, batch: int = 8) -> list[str]:
    """The ``copy_`` / ``fill_`` ops of one compiled training step of ``_Blocks(3)`` (after a warm-up step) on a
    ``[batch, F]`` tensor: work on the pass's draws per row outside the graphs' own kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = bayesify.convert(_Blocks(3), components=4, task="classification")
    compiled = torch.compile(model.train(), backend=backend)
    x = torch.randn(batch, 5, 16)

    def step() -> None:
        compiled(x).logsumexp(-1).sum().backward()

    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    return [
        f"{event.name}{event.input_shapes[0]}"
        for event in prof.events()
        if event.name in ("aten::copy_", "aten::fill_") and event.input_shapes and _rows_wide(event.input_shapes[0], batch)
    ]


def _rows_wide(shape: list[int], batch: int) -> bool:
    """A ``[batch, F]`` tensor with F > 1 (what a layer's draws per row are; not a loss's ``[batch, 1]``)."""
    return len(shape) == 2 and shape[0] == batch and shape[1] > 1


def test_a_compiled_step_hands_each_layer_its_draws_per_row_without_copies() -> None:
    # the root's pre-hook graph hands each layer its piece of the pass's draws per row ([B, F]): a column slice of
    # the joined group got its gradient copied back into the slice's strides, one copy per table (AOTAutograd keeps
    # a tangent in its output's layout), and the whole group, an output of that graph too, a zero-filled gradient
    # (ViT-tiny at 32 px, B=32, CPU: 147 copies a step; the compiled step 139 -> 122 ms against the original's 82)
    assert _copies_of_rows("inductor") == []


@pytest.mark.parametrize("sampling", ["auto", "component"])
def test_a_training_step_compiled_by_inductor_with_dynamic_shapes_runs_its_convolutions_per_row(sampling: str) -> None:
    """``torch.compile(model, dynamic=True)`` of a converted CNN failed in inductor ("cannot determine truth value of
    Relational: 1 < s69", in its stride order): ``sampling="auto"`` folds a network's first convolution in
    training, K convolutions of blocks of a symbolic size. Under a symbolic shape no layer folds now (the per-row
    path: one function for every size, no guard; ``sampling="component"``, which folds everywhere, draws once per
    block there too); the step runs and takes every gradient, at two batch sizes."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 5))
    model = bayesify.convert(net, components=4, task="classification", sampling=sampling)
    step = torch.compile(model.train(), dynamic=True)
    for batch in (8, 5):
        model.zero_grad()
        out = step(torch.randn(batch, 3, 6, 6))
        assert out.shape == (batch, 5) and torch.isfinite(out).all()
        (out.logsumexp(-1).sum() + bayesify.kl_loss(model, 100)).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_a_compiled_training_step_takes_another_batch_size_in_one_graph(dynamic: bool | None) -> None:
    """A training loop's last partial batch (no ``drop_last``): torch.compile makes the batch symbolic from the second
    size on (or from the first, ``dynamic=True``), and the sample route's blocks took it with ``divmod``, which a
    symbolic size does not take: the step failed under ``fullgraph=True`` (a ``ValueError`` about export) and broke
    into dozens of frames without it. The blocks now take ``//`` and ``%``; each step equals eager's, seeded."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = bayesify.convert(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5)), components=4,
                             task="classification", init="normal")  # fmt: skip
    twin = copy.deepcopy(model)
    compiled = torch.compile(model.train(), fullgraph=True, dynamic=dynamic, backend="eager")
    twin.train()
    for step, batch in enumerate((8, 8, 5, 8, 5, 7)):
        x = torch.randn(batch, 6)
        torch.manual_seed(step)
        out = compiled(x)
        torch.manual_seed(step)
        torch.testing.assert_close(out, twin(x))
        (out.logsumexp(-1).sum() + bayesify.kl_loss(model, 100)).backward()
    assert counters["stats"]["unique_graphs"] <= 6, dict(counters["stats"])


def test_a_compiled_training_step_traces_no_autograd_function() -> None:
    """A traced ``autograd.Function`` (the folded weights', the KL's) keeps its graph out of AOTAutograd's cache: it
    was compiled again in every process (a ResNet-18's step: 12.5 s warm against the original's 3.3 s; 5.1 s
    without). In a graph AOTAutograd derives their backward."""
    model = perturbed(_cnn())
    x = torch.randn(8, 3, 8, 8)
    functions: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        functions.extend(str(n.target) for n in gm.graph.nodes if "autograd_function_apply" in str(n.target))
        return gm.forward

    def step() -> torch.Tensor:
        loss = F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)) + bayesify.kl_loss(model, 100)
        loss.backward()
        return loss

    torch._dynamo.reset()
    model.train()
    torch.manual_seed(0)
    eager = step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.manual_seed(0)
    compiled = torch.compile(step, backend=backend)()
    assert not functions, functions
    torch.testing.assert_close(compiled, eager)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)
