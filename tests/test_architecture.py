"""The package's imports run one way: no cycle, and each wing imports only what lies below it.

Read from the source (every import statement, function-local and ``TYPE_CHECKING`` ones included), so
a test fails the moment an import points the wrong way, before it breaks anything at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import bayesify

PACKAGE = Path(bayesify.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The bayesify modules ``name`` imports anywhere in its source (``from pkg import sub`` names ``pkg.sub``)."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "bayesify")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] + ([node.module] if node.module else [])
                source = ".".join(base)
            else:
                source = node.module or ""
            if source.split(".")[0] != "bayesify":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in MODULES else source)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    return out


def _reaches(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in GRAPH[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_the_walk_sees_the_imports_it_must_see() -> None:
    # the walk itself: a function-local import and a relative one are edges (else the tests below prove nothing)
    assert "bayesify.predictive.tasks" in GRAPH["bayesify.convert"]
    assert "bayesify.training.trainer" in GRAPH["bayesify.cli"]  # imported inside a function
    assert "bayesify.predictive.decompositions" in GRAPH["bayesify.predictive.tasks"]


def test_no_module_imports_itself_back_through_others() -> None:
    assert _cycles() == []


@pytest.mark.parametrize("wing", ["bayesify.predictive"])
def test_the_predictive_wing_imports_only_options_level_code(wing: str) -> None:
    allowed = {"bayesify.options", "bayesify.mixture"}
    for name in MODULES:
        if name == wing or name.startswith(wing + "."):
            outside = {m for m in GRAPH[name] if not m.startswith(wing) and m not in allowed}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_the_router_knows_rows_not_layers_or_model_libraries() -> None:
    below = _reaches("bayesify._router")
    assert not {m for m in below if m.startswith("bayesify.layers")}, sorted(below)
    assert "bayesify.hf" not in below
    source = MODULES["bayesify._router"].read_text()
    for library in ("transformers", "huggingface", "loss_function", "labels"):
        assert library not in source.lower(), library


def test_training_uses_evaluation_never_the_other_way() -> None:
    evaluation = [m for m in MODULES if m.startswith("bayesify.evaluation")]
    assert "bayesify.evaluation.evaluator" in GRAPH["bayesify.training.trainer"]
    for name in evaluation:
        assert not {m for m in GRAPH[name] if m.startswith("bayesify.training")}, name


def test_the_task_is_decided_in_one_place() -> None:
    # parse_task is the parser resolve_task uses; nothing outside the predictive wing parses a task itself
    for name, path in MODULES.items():
        if name.startswith("bayesify.predictive"):
            continue
        assert "parse_task(" not in path.read_text(), f"{name} parses a task: use resolve_task"


def test_the_options_sit_below_what_uses_them() -> None:
    """``config.py`` (the options, one list) imports nothing of the variational wing, the layers or the router: the
    KL-pair check it runs lives with the option enums (``options.py``). No arrow of the import graph runs back up."""
    below = _reaches("bayesify.config")
    assert not {m for m in below if m.startswith(("bayesify.variational", "bayesify.layers", "bayesify._router"))}, sorted(below)


def test_the_per_pass_draw_lives_beside_the_factors() -> None:
    """The router routes rows; the factors' draws of a pass are ``variational/draws.py``'s, which knows no router."""
    assert "bayesify.variational.draws" in GRAPH["bayesify._router"]
    assert not {m for m in _reaches("bayesify.variational.draws") if m.startswith(("bayesify._router", "bayesify.layers"))}
    source = MODULES["bayesify._router"].read_text()
    for name in ("draw_all", "draw_one", ".noise(", "joined("):
        assert name not in source, name
