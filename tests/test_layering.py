"""The package's layering, checked on its source: every module sits in one layer, imports only
from its own layer or below (function-level imports included), no import circle, and no
private name (``_x``) taken from another module."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "shardplan"

# Lower first: what the traced step, its graph and the compilers' behaviour are built on, then
# the families that rewrite the step before it is planned, the solver, the plan, the search over
# plans, and the user's entry points.
LAYERS = {
    "base": "errors sizes progress problem layout footprint flash attention_pattern graph stacks",
    "hardware": "mesh hardware targets splitk cluster calibrate",
    "compiler models": "cost liveness combine traffic bf16_pass xla_bugs tables hlo audit",
    "traced program": "trace walk manual rewrites rules strategies apply",
    "families": "families recompute unrolled pipeline pipeline_search einsum_attention context sequence defaults",
    "solve": "simplify solver tying exact",
    "plan": "bands plan planner cache multihost checkpoint fit",
    "search": "search",
    "entry points": "api cli __init__",
}
LAYER_OF = {m: k for k, (_, names) in enumerate(LAYERS.items()) for m in names.split()}


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(PACKAGE.glob("*.py"))}


def _imports(tree: ast.Module, modules) -> tuple[set[str], list[tuple[str, str]]]:
    """The package's modules ``tree`` imports, and the private names it takes from them."""
    found, private, aliases = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shardplan":
            parts = node.module.split(".")
            if len(parts) == 2 and parts[1] in modules:
                found.add(parts[1])
                private += [(parts[1], a.name) for a in node.names if a.name.startswith("_")]
            elif len(parts) == 1:
                for a in node.names:
                    if a.name in modules:
                        found.add(a.name)
                        aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "shardplan" and len(parts) == 2 and parts[1] in modules:
                    found.add(parts[1])
                    aliases[a.asname or a.name] = parts[1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            private.append((aliases[node.value.id], node.attr))
    return found, private


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {name: _imports(tree, modules) for name, tree in modules.items()}


def test_every_module_has_a_layer(graph):
    assert sorted(set(graph) - set(LAYER_OF)) == [], "place each new module in LAYERS"
    assert sorted(set(LAYER_OF) - set(graph)) == [], "LAYERS names a module that is gone"


def test_no_module_imports_from_a_layer_above_its_own(graph):
    names = list(LAYERS)
    upward = [f"{m} ({names[LAYER_OF[m]]}) imports {i} ({names[LAYER_OF[i]]})"
              for m, (imports, _) in graph.items() for i in sorted(imports) if LAYER_OF[i] > LAYER_OF[m]]
    assert upward == []


def test_no_import_circle(graph):
    circles, state, path = [], {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for i in sorted(graph[m][0] - {m}):
            if state.get(i) == "open":
                circles.append(" -> ".join(path[path.index(i):] + [i]))
            elif i not in state:
                visit(i)
        path.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert circles == []


def test_no_private_name_is_taken_from_another_module(graph):
    taken = [f"{m} takes {source}.{name}" for m, (_, private) in graph.items() for source, name in private]
    assert taken == []
