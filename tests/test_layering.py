"""The package's layering, checked on its source: every module sits in one layer, imports only
from its own layer or below (function-level imports included), no import circle, and no
private name (``_x``) taken from another module."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "shardplan"

# The layers, lower first: a subpackage each (errors, the top's one low module, first; the user's
# entry points last). Data flows up them: the step is traced to a graph, its primitives' rules and
# candidate shardings are priced by the cost and compiler models, the parallelism families rewrite
# the step, the ILP is solved, the plan is kept and shared, and the planner and its search drive it.
LAYERS = ["errors", "util", "ir", "devices", "compiler", "tracing", "sharding", "parallel", "solve", "plans",
          "planning", "api cli __init__"]
TOP = {"errors": 0, "api": len(LAYERS) - 1, "cli": len(LAYERS) - 1, "__init__": len(LAYERS) - 1}


def _layer(module: str) -> int:
    """``module``'s layer: its subpackage's, or a top module's."""
    head = module.split(".")[0]
    return TOP[head] if head in TOP else LAYERS.index(head)


def _modules() -> dict[str, ast.Module]:
    """Every module of the package by its dotted name under ``shardplan`` (``compiler.cost``)."""
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
        out[name.removesuffix(".__init__") if "." in name else name] = ast.parse(p.read_text())
    return out


def _imports(tree: ast.Module, modules) -> tuple[set[str], list[tuple[str, str]]]:
    """The package's modules ``tree`` imports, and the private names it takes from them."""
    found, private, aliases = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shardplan":
            source = node.module.removeprefix("shardplan").removeprefix(".")
            for a in node.names:
                if f"{source}.{a.name}".strip(".") in modules:          # a module: from shardplan.compiler import cost
                    found.add(f"{source}.{a.name}".strip("."))
                    aliases[a.asname or a.name] = f"{source}.{a.name}".strip(".")
                elif source in modules:                                 # a name of a module
                    found.add(source)
                    if a.name.startswith("_"):
                        private.append((source, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                source = a.name.removeprefix("shardplan").removeprefix(".")
                if a.name.split(".")[0] == "shardplan" and source in modules:
                    found.add(source)
                    if a.asname:
                        aliases[a.asname] = source
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            private.append((aliases[node.value.id], node.attr))
    return found, private


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {name: _imports(tree, modules) for name, tree in modules.items()}


def test_every_module_sits_in_a_layer(graph):
    assert sorted(m for m in graph if m.split(".")[0] not in TOP and m.split(".")[0] not in LAYERS) == [], \
        "place each new module in a subpackage of LAYERS"
    assert sorted(m for m in LAYERS[1:-1] if m not in graph) == [], "LAYERS names a subpackage that is gone"


def test_no_module_imports_from_a_layer_above_its_own(graph):
    upward = [f"{m} imports {i}" for m, (imports, _) in graph.items() for i in sorted(imports)
              if _layer(i) > _layer(m)]
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


def test_the_checker_sees_each_kind_of_import_and_a_private_name():
    modules = {"compiler.cost": None, "compiler": None, "planning.search": None, "errors": None}
    tree = ast.parse("from shardplan.compiler import cost\nimport shardplan.planning.search as S\n"
                     "from shardplan.errors import _hidden\nx = S._helper\n")
    found, private = _imports(tree, modules)
    assert found == {"compiler.cost", "planning.search", "errors"}
    assert sorted(private) == [("errors", "_hidden"), ("planning.search", "_helper")]
    assert _layer("errors") < _layer("compiler.cost") < _layer("planning.search") < _layer("api")


def test_the_old_flat_import_paths_give_the_modules_at_their_new_places():
    import importlib

    import shardplan
    from shardplan.parallel import pipeline

    assert importlib.import_module("shardplan.pipeline") is pipeline
    from shardplan.plan import Plan
    assert Plan is shardplan.Plan and callable(shardplan.plan)        # the function stays the attribute
    for old, new in shardplan.MOVED.items():
        module = importlib.import_module(f"shardplan.{old}")
        assert module.__name__ == module.__spec__.name == f"shardplan.{new}"
