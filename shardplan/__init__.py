"""shardplan: a sharding auto-planner for JAX and Flax.

An OR-Tools ILP gives every tensor of a train step (forward, backward, optimizer update) a
PartitionSpec, priced on a device mesh's cost model and held under a per-device memory budget.

>>> import shardplan
>>> @shardplan.auto(mesh="h100-8", memory_budget="60GiB", donate_argnums=(0,))   # doctest: +SKIP
... def train_step(state, batch): ...
"""

import os as _os

# Installed, the repository's models/, benchmarks/ and meshes/ folders are the subpackages
# shardplan.models, shardplan.benchmarks and shardplan.meshes (pyproject.toml's package-dir). In a
# source checkout they stand beside this package: look for those subpackages there too.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and \
        _os.path.isfile(_os.path.join(_checkout, "models", "__init__.py")):
    __path__.append(_checkout)

from shardplan.api import AutoFunction, auto, plan, search_mesh
from shardplan.errors import (
    DeviceCountError,
    InfeasibleBudgetError,
    MeshConfigError,
    PlanFileError,
    PlanMismatchError,
    ShardplanError,
)
from shardplan.mesh import MeshSpec, load_mesh, preset_names
from shardplan.multihost import global_batch, local_rows
from shardplan.pipeline import PipelineConfig, PipelineError, layer_scan, pipelined
from shardplan.plan import Plan, PredictedCost, TensorPlan
from shardplan.recompute import RecomputeError, layer_remat
from shardplan.sequence import ContextConfig, attention, context_parallel
from shardplan.sizes import parse_bytes

__all__ = [
    "AutoFunction", "ContextConfig", "DeviceCountError", "InfeasibleBudgetError", "MeshConfigError", "MeshSpec",
    "PipelineConfig",
    "PipelineError", "Plan", "PlanFileError", "PlanMismatchError", "PredictedCost", "RecomputeError", "ShardplanError",
    "TensorPlan",
    "attention", "auto", "context_parallel", "global_batch", "layer_remat", "layer_scan", "load_mesh", "local_rows",
    "parse_bytes", "pipelined", "plan",
    "preset_names", "search_mesh",
]
