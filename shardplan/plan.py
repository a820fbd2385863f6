"""The :class:`Plan`: a PartitionSpec for every tensor, the predicted cost, and how the solver did.

Frozen and serialisable (``to_json`` / ``Plan.from_json``); ``explain()`` prints one row per tensor.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shardplan.cost import Spec, to_partition_spec
from shardplan.errors import PlanMismatchError
from shardplan.mesh import make_jax_mesh
from shardplan.sizes import format_bytes
from shardplan.solver import SolverStats


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One tensor's row: its name (pytree path or Flax name stack), shape, dtype, spec and cost."""

    id: int
    name: str
    role: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    bytes_per_device: float
    cost_s: float
    source: str = ""

    @property
    def partition_spec(self) -> PartitionSpec:
        return to_partition_spec(self.spec)


@dataclasses.dataclass(frozen=True)
class PredictedCost:
    """Seconds per step and bytes per device, as the cost model prices the plan."""

    compute_s: float
    comm_s_by_kind: dict[str, float]
    comm_s_by_axis: dict[str, float]
    comm_bytes_by_kind: dict[str, float]
    memory_bytes: float                   # peak per device: arguments + live intermediates
    memory_bytes_by_role: dict[str, float]  # arguments only: "params", "opt_state", "batch", ...
    comm_bytes_by_axis: dict[str, float] = dataclasses.field(default_factory=dict)  # split evenly over a collective's axes

    @property
    def comm_s(self) -> float:
        return sum(self.comm_s_by_kind.values())

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclasses.dataclass(frozen=True)
class Plan:
    """A sharding plan for one traced signature of a train step.

    >>> p = shardplan.plan(train_step, abstract_state, abstract_batch, mesh="h100-8")  # doctest: +SKIP
    >>> print(p.explain())                                                           # doctest: +SKIP
    """

    mesh_name: str
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    activations: tuple[TensorPlan, ...]
    dot_operands: dict[int, tuple[Spec, ...]]    # dot output tensor id -> (lhs, rhs, computed result) specs
    cost: PredictedCost
    solver: SolverStats
    fingerprint: str
    warnings: tuple[str, ...] = ()
    # (operand tensor id, result tensor id) -> the spec the operand is resharded to before the op
    operand_pins: dict[tuple[int, int], Spec] = dataclasses.field(default_factory=dict)
    # result tensor id -> the spec its op makes it in (before resharding to its own spec)
    result_pins: dict[int, Spec] = dataclasses.field(default_factory=dict)
    in_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    out_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    mesh_spec: Any = dataclasses.field(default=None, compare=False, repr=False)   # the MeshSpec it was priced on

    # -- shardings ---------------------------------------------------------------------------------
    def jax_mesh(self, devices=None) -> jax.sharding.Mesh:
        return make_jax_mesh(self.axis_names, self.axis_sizes, devices, name=self.mesh_name)

    @staticmethod
    def flat_shardings(rows, mesh: jax.sharding.Mesh) -> list[NamedSharding]:
        """One ``NamedSharding`` per row (``plan.inputs`` or ``plan.outputs``), in flat order."""
        return [NamedSharding(mesh, r.partition_spec) for r in rows]

    def _tree(self, rows, tree, mesh):
        leaves = self.flat_shardings(rows, mesh)
        if tree is None:
            raise PlanMismatchError("this plan was loaded from JSON and has no pytree structure; "
                                    "use plan.input_specs() for (path, PartitionSpec) pairs")
        return jax.tree_util.tree_unflatten(tree, leaves)

    def in_shardings(self, mesh: jax.sharding.Mesh | None = None):
        """A pytree of ``NamedSharding`` mirroring the step's positional arguments (a tuple)."""
        return self._tree(self.inputs, self.in_tree, mesh or self.jax_mesh())

    def out_shardings(self, mesh: jax.sharding.Mesh | None = None):
        """A pytree of ``NamedSharding`` mirroring the step's outputs."""
        return self._tree(self.outputs, self.out_tree, mesh or self.jax_mesh())

    def audit(self, compiled, mesh=None):
        """Hold this plan's predictions against a compiled program of its step (:mod:`shardplan.audit`).

        ``mesh`` (a ``MeshSpec``) prices the compiled collectives; default: the mesh it was planned on.
        """
        from shardplan.audit import audit_step
        return audit_step(self, compiled, mesh)

    def input_specs(self) -> list[tuple[str, PartitionSpec]]:
        return [(r.name, r.partition_spec) for r in self.inputs]

    # -- inspection ----------------------------------------------------------------------------------
    def explain(self, max_activations: int = 40) -> str:
        """One row per tensor: path, shape, dtype, PartitionSpec, bytes per device, cost; then totals."""
        c = self.cost
        lines = [f"shardplan plan on {self.mesh_name} {dict(zip(self.axis_names, self.axis_sizes))}",
                 f"predicted step {c.step_s * 1e3:.3f} ms = compute {c.compute_s * 1e3:.3f} ms + "
                 f"collectives {c.comm_s * 1e3:.3f} ms; peak memory {format_bytes(c.memory_bytes)}/device",
                 "collectives: " + (", ".join(f"{k} {v * 1e3:.3f} ms ({format_bytes(c.comm_bytes_by_kind[k])})"
                                             for k, v in c.comm_s_by_kind.items() if v) or "none"),
                 "per mesh axis: " + (", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in c.comm_s_by_axis.items() if v)
                                      or "none"),
                 "arguments per device: " + ", ".join(f"{k} {format_bytes(v)}"
                                                      for k, v in c.memory_bytes_by_role.items()),
                 f"solver: {self.solver.status}, objective {self.solver.objective * 1e3:.3f} ms, "
                 f"gap {self.solver.gap:.2%}, {self.solver.wall_time:.2f} s, "
                 f"{self.solver.num_variables} variables, {self.solver.num_constraints} constraints", ""]
        header = f"{'role':<10} {'tensor':<58} {'shape':<22} {'dtype':<9} {'PartitionSpec':<34} {'bytes/dev':>11} {'cost ms':>9}"
        lines += [header, "-" * len(header)]
        acts = sorted(self.activations, key=lambda r: -r.cost_s)[:max_activations]
        for r in list(self.inputs) + list(self.outputs) + acts:
            name = r.name if len(r.name) <= 58 else "..." + r.name[-55:]
            spec = str(tuple(r.partition_spec)) if r.spec else "()"
            lines.append(f"{r.role:<10} {name:<58} {str(r.shape):<22} {r.dtype:<9} {spec:<34} "
                         f"{format_bytes(r.bytes_per_device):>11} {r.cost_s * 1e3:>9.4f}")
        if len(self.activations) > max_activations:
            lines.append(f"... {len(self.activations) - max_activations} more activations "
                         f"(explain(max_activations=...) shows them)")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)

    # -- serialisation ------------------------------------------------------------------------------
    def to_json(self) -> str:
        def rows(rs):
            return [dict(dataclasses.asdict(r), spec=[list(a) for a in r.spec], shape=list(r.shape)) for r in rs]
        data = {
            "format": "shardplan.plan/1", "mesh_name": self.mesh_name, "axis_names": list(self.axis_names),
            "axis_sizes": list(self.axis_sizes), "inputs": rows(self.inputs), "outputs": rows(self.outputs),
            "activations": rows(self.activations),
            "dot_operands": {str(k): [[list(a) for a in s] for s in v] for k, v in self.dot_operands.items()},
            "cost": dataclasses.asdict(self.cost), "solver": dataclasses.asdict(self.solver),
            "fingerprint": self.fingerprint, "warnings": list(self.warnings),
            "operand_pins": [[a, b, [list(x) for x in s]] for (a, b), s in self.operand_pins.items()],
            "result_pins": {str(k): [list(x) for x in s] for k, s in self.result_pins.items()}}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        if data.get("format") != "shardplan.plan/1":
            raise PlanMismatchError(f"not a shardplan plan (format {data.get('format')!r})")

        def spec(s):
            return tuple(tuple(a) for a in s)

        def rows(rs):
            return tuple(TensorPlan(**dict(r, spec=spec(r["spec"]), shape=tuple(r["shape"]))) for r in rs)
        return cls(
            mesh_name=data["mesh_name"], axis_names=tuple(data["axis_names"]),
            axis_sizes=tuple(data["axis_sizes"]), inputs=rows(data["inputs"]), outputs=rows(data["outputs"]),
            activations=rows(data["activations"]),
            dot_operands={int(k): tuple(spec(x) for x in v) for k, v in data["dot_operands"].items()},
            cost=PredictedCost(**data["cost"]), solver=SolverStats(**data["solver"]),
            fingerprint=data["fingerprint"], warnings=tuple(data["warnings"]),
            operand_pins={(a, b): spec(s) for a, b, s in data.get("operand_pins", [])},
            result_pins={int(k): spec(s) for k, s in data.get("result_pins", {}).items()})

    def specs_by_tensor(self) -> dict[int, Spec]:
        return {r.id: r.spec for r in (*self.inputs, *self.outputs, *self.activations)}


def fingerprint(shapes: list[tuple[tuple[int, ...], str]]) -> str:
    import hashlib
    return hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]


