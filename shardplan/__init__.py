"""shardplan: a sharding auto-planner for JAX and Flax.

An OR-Tools ILP gives every tensor of a train step (forward, backward, optimizer update) a
PartitionSpec, priced on a device mesh's cost model and held under a per-device memory budget.

>>> import shardplan
>>> @shardplan.auto(mesh="h100-8", memory_budget="60GiB", donate_argnums=(0,))   # doctest: +SKIP
... def train_step(state, batch): ...
"""

import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import os as _os
import sys as _sys

# Installed, the repository's models/, benchmarks/ and meshes/ folders are the subpackages
# shardplan.models, shardplan.benchmarks and shardplan.meshes (pyproject.toml's package-dir). In a
# source checkout they stand beside this package: look for those subpackages there too.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and \
        _os.path.isfile(_os.path.join(_checkout, "models", "__init__.py")):
    __path__.append(_checkout)

from shardplan.api import AutoFunction, auto, plan, search_mesh
from shardplan.devices.mesh import MeshSpec, load_mesh, preset_names
from shardplan.errors import (
    DeviceCountError,
    InfeasibleBudgetError,
    InvalidPlanError,
    MeshConfigError,
    PlanFileError,
    PlanMismatchError,
    ShardplanError,
)
from shardplan.parallel.pipeline import PipelineConfig, PipelineError, layer_scan, pipelined
from shardplan.parallel.recompute import RecomputeError, layer_remat
from shardplan.parallel.sequence import ContextConfig, attention, context_parallel
from shardplan.planning.frontier import Frontier, frontier
from shardplan.plans.multihost import global_batch, local_rows
from shardplan.plans.plan import Plan, PredictedCost, TensorPlan
from shardplan.util.sizes import parse_bytes

__all__ = [
    "AutoFunction", "ContextConfig", "DeviceCountError", "Frontier", "InfeasibleBudgetError", "InvalidPlanError",
    "MeshConfigError", "MeshSpec", "PipelineConfig", "PipelineError", "Plan", "PlanFileError", "PlanMismatchError",
    "PredictedCost", "RecomputeError", "ShardplanError", "TensorPlan", "attention", "auto", "context_parallel",
    "frontier", "global_batch", "layer_remat", "layer_scan", "load_mesh", "local_rows", "parse_bytes", "pipelined",
    "plan", "preset_names", "search_mesh",
]

# -- the modules' old places -----------------------------------------------------------------------
# Until 0.1 every module sat in this folder (shardplan.pipeline, shardplan.sequence, ...). An import
# of an old path gives the module at its new place, the same object.
MOVED = {
    "sizes": "util.sizes", "progress": "util.progress", "graph": "ir.graph", "problem": "ir.problem",
    "mesh": "devices.mesh", "hardware": "devices.hardware", "cluster": "devices.cluster",
    "calibrate": "devices.calibrate", "targets": "compiler.targets", "splitk": "compiler.splitk",
    "layout": "compiler.layout", "footprint": "compiler.footprint", "liveness": "compiler.liveness",
    "cost": "compiler.cost", "combine": "compiler.combine", "traffic": "compiler.traffic",
    "bf16_pass": "compiler.bf16_pass", "xla_bugs": "compiler.xla_bugs", "tables": "compiler.tables",
    "hlo": "compiler.hlo", "audit": "compiler.audit", "fit": "compiler.fit", "bands": "compiler.bands",
    "trace": "tracing.trace", "walk": "tracing.walk", "stacks": "tracing.stacks", "manual": "tracing.manual",
    "rewrites": "tracing.rewrites", "attention_pattern": "tracing.attention_pattern",
    "einsum_attention": "tracing.einsum_attention", "rules": "sharding.rules", "strategies": "sharding.strategies",
    "apply": "sharding.apply", "families": "parallel.families", "defaults": "parallel.defaults",
    "recompute": "parallel.recompute", "unrolled": "parallel.unrolled", "pipeline": "parallel.pipeline",
    "pipeline_search": "parallel.pipeline_search", "flash": "parallel.flash", "context": "parallel.context",
    "sequence": "parallel.sequence", "simplify": "solve.simplify", "solver": "solve.solver", "tying": "solve.tying",
    "exact": "solve.exact", "plan": "plans.plan", "cache": "plans.cache", "multihost": "plans.multihost",
    "checkpoint": "plans.checkpoint", "planner": "planning.planner", "search": "planning.search",
}


class _MovedModules(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """``import shardplan.<old>`` of a module not imported yet: load the new one under the old name."""

    def find_spec(self, name, path=None, target=None):
        package, _, old = name.partition(".")
        if package == "shardplan" and old in MOVED:
            return _importlib_util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        module = _importlib.import_module("shardplan." + MOVED[spec.name.partition(".")[2]])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state     # the import system gave it the old name's spec


for _old, _new in MOVED.items():               # those imported already; shardplan.plan, the attribute,
    if "shardplan." + _new in _sys.modules:    # stays the function (the module is shardplan.plans.plan)
        _sys.modules.setdefault("shardplan." + _old, _sys.modules["shardplan." + _new])
        globals().setdefault(_old, _sys.modules["shardplan." + _new])
_sys.meta_path.append(_MovedModules())
