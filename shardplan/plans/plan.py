"""The :class:`Plan`: a PartitionSpec for every tensor, the predicted cost, and how the solver did.

A frozen record, checked when it is built (:class:`~shardplan.errors.InvalidPlanError` names what is wrong),
serialisable (``to_json`` / ``Plan.from_json``, the file itself in :mod:`shardplan.plans.files`);
``explain()`` prints one row per tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shardplan.compiler.bands import describe as describe_band
from shardplan.compiler.cost import Spec, to_partition_spec
from shardplan.compiler.targets import compiler_kind
from shardplan.devices.mesh import make_jax_mesh
from shardplan.errors import InvalidPlanError, PlanFileError, PlanMismatchError
from shardplan.plans import files
from shardplan.solve.solver import SolverStats
from shardplan.util.sizes import format_bytes


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One tensor's row: its name (pytree path or Flax name stack), shape, dtype, spec and cost.

    ``path`` says where the tensor is in the step (:func:`shardplan.ir.graph.eqn_path`): ``"in:3"``
    for the fourth flat argument, ``"12.scan/3.dot_general:0"`` for a result inside a scan body.
    """

    path: str
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
    # split evenly over a collective's axes
    comm_bytes_by_axis: dict[str, float] = dataclasses.field(default_factory=dict)
    input_s: float = 0.0                  # the hosts loading the step's input, each its share
    # Host offload: seconds of copies between device and pinned host memory (all of them show in
    # the step: offload_exposed_s), and the bytes per device held in host memory.
    offload_s: float = 0.0
    offload_bytes: float = 0.0
    # What the ILP minimised for this plan: the same terms with HBM traffic counted the ILP's way
    # (every tensor on a sharding edge written and read once), where compute_s counts it as XLA
    # fuses it (shardplan.compiler.traffic.hbm_traffic), a reshard that several readers share priced
    # for each (XLA runs it once; comm_s counts it once), and no all-reduce of a scalar (a loss's;
    # comm_s counts it). The solver's objective, plus any host copies (offload_s), which the ILP
    # does not price.
    searched_s: float = 0.0
    # On a TPU: the tuple results (loops, multi-output kernels) counted in memory_bytes, a heap
    # slot each (shardplan.compiler.liveness.multi_output_kernels); 0 elsewhere.
    tuple_slots: int = 0

    @property
    def comm_s(self) -> float:
        return sum(self.comm_s_by_kind.values())

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.input_s + self.offload_exposed_s

    @property
    def offload_exposed_s(self) -> float:
        """The host copies' seconds that show in the step: all of them. The DMA engines could run
        them beside the kernels, but on an H200 they did not: gpt2-small (batch 16) under
        ``offload`` ran 169 ms longer than under ``dots``, whose residuals it keeps, and its copies
        take 182 ms at the 53 GB/s measured there (RESULTS.md, session 20). Session 18 priced
        only what outlasts the compute, and the planner chose offload where it lost 2.3x."""
        return self.offload_s


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
    dot_operands: dict[str, tuple[Spec, ...]]    # dot output tensor path -> (lhs, rhs, computed result) specs
    cost: PredictedCost
    solver: SolverStats
    fingerprint: str
    warnings: tuple[str, ...] = ()
    # (operand tensor path, result tensor path) -> the spec the operand is resharded to before the op
    operand_pins: dict[tuple[str, str], Spec] = dataclasses.field(default_factory=dict)
    # result tensor path -> the spec its op makes it in (before resharding to its own spec)
    result_pins: dict[str, Spec] = dataclasses.field(default_factory=dict)
    # result tensor path -> the rewrite that computes its op (shardplan.tracing.rewrites): kind and specs
    rewrites: dict[str, dict] = dataclasses.field(default_factory=dict)
    # "path dtype[shape]" of every tensor of the traced step: what the fingerprint hashes
    signature: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)
    in_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    out_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    # str() of the argument and output pytree structures (kept when loaded from JSON)
    trees: tuple[str, str] = dataclasses.field(default=("", ""), compare=False, repr=False)
    mesh_spec: Any = dataclasses.field(default=None, compare=False, repr=False)   # the MeshSpec it was priced on
    # the pipeline its step was traced in (shardplan.parallel.pipeline.PipelineConfig.to_json()), None: none
    pipeline: dict | None = None
    # the recomputation its step was traced with, per layer class (shardplan.parallel.recompute):
    # {"sites": [{"key", "where", "layers", "policy"}]}; None: the step as written
    remat: dict | None = None
    # how its shardplan.attention calls were traced (shardplan.parallel.sequence.ContextConfig.to_json()),
    # None: as jax.nn.dot_product_attention
    context: dict | None = None
    # the traced step moves a pipeline's stages (shardplan.parallel.pipeline.stage_shift): with ``pipeline``
    # None, a pipeline of the step's own (traced inside shardplan.pipelined), planned around
    stage_shifts: bool = False
    # family ("pipeline", "remat", "context") -> the best candidate of another choice the search
    # planned, and its predicted step against this plan's (for explain); empty where none searched
    searched: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        problem = self._inconsistency()
        if problem:
            raise InvalidPlanError(problem)

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
            raise PlanMismatchError("this plan was loaded from JSON: its pytree structure is known only by "
                                    "name until it is bound to the step (shardplan.auto(step, plan=...) or "
                                    "plan.apply(step), then f.make_plan(*args) or a first call); "
                                    "plan.input_specs() gives (path, PartitionSpec) pairs now")
        return jax.tree_util.tree_unflatten(tree, leaves)

    def in_shardings(self, mesh: jax.sharding.Mesh | None = None):
        """A pytree of ``NamedSharding`` mirroring the step's positional arguments (a tuple)."""
        return self._tree(self.inputs, self.in_tree, mesh or self.jax_mesh())

    def out_shardings(self, mesh: jax.sharding.Mesh | None = None):
        """A pytree of ``NamedSharding`` mirroring the step's outputs."""
        return self._tree(self.outputs, self.out_tree, mesh or self.jax_mesh())

    def audit(self, compiled, mesh=None, jax_mesh=None):
        """Hold this plan's predictions against a compiled program of its step (:mod:`shardplan.compiler.audit`).

        ``mesh`` (a ``MeshSpec``) prices the compiled collectives; default: the mesh it was planned on.
        ``jax_mesh``: the ``jax.sharding.Mesh`` it was compiled for (the second value
        :meth:`~shardplan.api.AutoFunction.compile_for` returns), which names its compiler (a GPU or
        TPU compile without a device); default: this plan's mesh of the local devices. For a TPU
        compile, :meth:`~shardplan.api.AutoFunction.audit_for` also reads memory from an
        HBM-only compile, as this cannot.
        """
        from shardplan.compiler.audit import audit_step
        return audit_step(self, compiled, mesh, jax_mesh)

    def input_specs(self) -> list[tuple[str, PartitionSpec]]:
        return [(r.name, r.partition_spec) for r in self.inputs]

    # -- inspection ----------------------------------------------------------------------------------
    def explain(self, max_activations: int = 40) -> str:
        """One row per tensor: path, shape, dtype, PartitionSpec, bytes per device, cost; then totals."""
        c = self.cost
        lines = [f"shardplan plan on {self.mesh_name} {dict(zip(self.axis_names, self.axis_sizes))}",
                 f"predicted step {c.step_s * 1e3:.3f} ms = compute {c.compute_s * 1e3:.3f} ms + "
                 f"collectives {c.comm_s * 1e3:.3f} ms"
                 + (f" + input loading {c.input_s * 1e3:.3f} ms" if c.input_s else "")
                 + (f" + host copies {c.offload_exposed_s * 1e3:.3f} ms" if c.offload_s else "")
                 + f"; peak memory {format_bytes(c.memory_bytes)}/device"
                 + (f" (+ {format_bytes(c.offload_bytes)}/device offloaded to host memory, "
                    f"{c.offload_s * 1e3:.3f} ms of copies)" if c.offload_s else ""),
                 *([describe_band(compiler_kind(self.mesh_spec))] if self.mesh_spec is not None else []),
                 "collectives: " + (", ".join(f"{k} {v * 1e3:.3f} ms ({format_bytes(c.comm_bytes_by_kind[k])})"
                                             for k, v in c.comm_s_by_kind.items() if v) or "none"),
                 "per mesh axis: " + (", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in c.comm_s_by_axis.items() if v)
                                      or "none"),
                 "pipeline: " + (self.choice("pipeline") if self.pipeline or not self.stage_shifts else
                                 "the step's own (traced inside pipelined(...)), planned around")
                 + self._beat("pipeline"),
                 "recomputation: " + self.choice("remat") + self._beat("remat"),
                 "context parallelism: " + self.choice("context") + self._beat("context"),
                 "arguments per device: " + ", ".join(f"{k} {format_bytes(v)}"
                                                      for k, v in c.memory_bytes_by_role.items()),
                 f"solver: {self.solver.status}, objective {self.solver.objective * 1e3:.3f} ms "
                 f"(HBM traffic unfused), "
                 f"gap {self.solver.gap:.2%}, {self.solver.wall_time:.2f} s, "
                 f"{self.solver.num_variables} variables, {self.solver.num_constraints} constraints", ""]
        header = (f"{'role':<10} {'tensor':<58} {'shape':<22} {'dtype':<9} {'PartitionSpec':<34} "
                  f"{'bytes/dev':>11} {'cost ms':>9}")
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

    def context_config(self):
        """The :class:`~shardplan.parallel.sequence.ContextConfig` the step's attention is traced in, or ``None``."""
        from shardplan.parallel.sequence import ContextConfig
        return None if self.context is None else ContextConfig.from_json(self.context)

    def pipeline_config(self):
        """The :class:`~shardplan.parallel.pipeline.PipelineConfig` the step is traced in, or ``None``."""
        from shardplan.parallel.pipeline import PipelineConfig
        return None if self.pipeline is None else PipelineConfig.from_json(self.pipeline)

    def choice(self, family: str) -> str:
        """What this plan does for a parallelism ``family``: ``"pipeline"``, ``"remat"`` or ``"context"``."""
        if family == "pipeline":
            return self.pipeline_config().describe() if self.pipeline else "none"
        if family == "remat":
            return _describe_remat(self.remat)
        return self.context_config().describe() if self.context else "none"

    def _beat(self, family: str) -> str:
        return f" ({self.searched[family]})" if family in self.searched else ""

    # -- identity and serialisation ------------------------------------------------------------------
    def digest(self) -> str:
        """A hash of what the plan makes XLA run: the step's fingerprint, the mesh and every
        sharding. Timing and solver statistics are not part of it: processes whose solvers took
        different times but chose the same shardings hold the same plan."""
        import hashlib
        data = self._data()
        body = {k: data[k] for k in ("fingerprint", "axis_names", "axis_sizes", "dot_operands", "operand_pins",
                                     "result_pins", "rewrites", "pipeline", "remat", "context")}
        body["specs"] = [(r["path"], r["spec"]) for r in data["inputs"] + data["outputs"] + data["activations"]]
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]

    def _data(self) -> dict:
        def rows(rs):
            return [dict(dataclasses.asdict(r), spec=[list(a) for a in r.spec], shape=list(r.shape)) for r in rs]
        solver = dataclasses.asdict(self.solver)
        solver.pop("wall_time")          # timing is not part of a plan
        in_tree = str(self.in_tree) if self.in_tree is not None else self.trees[0]
        out_tree = str(self.out_tree) if self.out_tree is not None else self.trees[1]
        return {
            "mesh_name": self.mesh_name,
            "axis_names": list(self.axis_names), "axis_sizes": list(self.axis_sizes),
            "in_tree": in_tree, "out_tree": out_tree,
            "inputs": rows(self.inputs), "outputs": rows(self.outputs), "activations": rows(self.activations),
            "dot_operands": {k: [[list(a) for a in s] for s in v] for k, v in self.dot_operands.items()},
            "operand_pins": [[a, b, [list(x) for x in s]] for (a, b), s in self.operand_pins.items()],
            "result_pins": {k: [list(x) for x in s] for k, s in self.result_pins.items()},
            "rewrites": {k: {"kind": r["kind"], "operand": [list(x) for x in r["operand"]],
                             "made": [list(x) for x in r["made"]], "partial": list(r["partial"])}
                         for k, r in self.rewrites.items()},
            "cost": dataclasses.asdict(self.cost), "solver": solver,
            "fingerprint": self.fingerprint, "signature": list(self.signature), "warnings": list(self.warnings),
            "pipeline": self.pipeline, "remat": self.remat, "context": self.context,
            "stage_shifts": self.stage_shifts, "searched": dict(self.searched)}

    def to_json(self) -> str:
        """The plan as JSON (schema :data:`~shardplan.plans.files.SCHEMA_VERSION`): every sharding
        keyed by tensor path, the step's signature and fingerprint, and the names of the pytree
        structures."""
        return files.dump(self._data())

    @classmethod
    def from_json(cls, text: str, source: str = "plan JSON") -> Plan:
        """Read :meth:`to_json`'s output back. Anything else (truncated, foreign, an older schema,
        an edit that leaves the plan inconsistent) raises :class:`PlanFileError` naming ``source``."""
        data = files.parse(text, source)
        try:
            return cls._from_data(data)
        except InvalidPlanError as e:
            raise PlanFileError(f"{source}: {e} (was the file edited?)") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise PlanFileError(f"{source}: a malformed plan ({what})") from None

    @classmethod
    def _from_data(cls, data: dict) -> Plan:
        def spec(s):
            return tuple(tuple(str(a) for a in axes) for axes in s)

        def rows(rs):
            return tuple(TensorPlan(**dict(r, spec=spec(r["spec"]), shape=tuple(int(n) for n in r["shape"])))
                         for r in rs)
        return cls(
            mesh_name=data["mesh_name"], axis_names=tuple(data["axis_names"]),
            axis_sizes=tuple(int(n) for n in data["axis_sizes"]), inputs=rows(data["inputs"]),
            outputs=rows(data["outputs"]), activations=rows(data["activations"]),
            dot_operands={str(k): tuple(spec(x) for x in v) for k, v in data["dot_operands"].items()},
            cost=PredictedCost(**data["cost"]), solver=SolverStats(**data["solver"], wall_time=0.0),
            fingerprint=data["fingerprint"], signature=tuple(data["signature"]),
            warnings=tuple(data["warnings"]),
            operand_pins={(a, b): spec(s) for a, b, s in data["operand_pins"]},
            result_pins={str(k): spec(s) for k, s in data["result_pins"].items()},
            rewrites={str(k): {"kind": str(r["kind"]), "operand": spec(r["operand"]), "made": spec(r["made"]),
                               "partial": tuple(str(a) for a in r["partial"])} for k, r in data["rewrites"].items()},
            trees=(str(data["in_tree"]), str(data["out_tree"])),
            pipeline=None if data.get("pipeline") is None else dict(data["pipeline"]),
            remat=None if data.get("remat") is None else {"sites": [
                {"key": str(r["key"]), "where": str(r["where"]), "layers": int(r["layers"]),
                 "policy": str(r["policy"])} for r in data["remat"]["sites"]]},
            context=None if data.get("context") is None else dict(data["context"]),
            stage_shifts=bool(data.get("stage_shifts", False)),
            searched={str(k): str(v) for k, v in data.get("searched", {}).items()})

    def _inconsistency(self) -> str:
        """What makes the plan unusable (checked when it is built, a loaded one too), or ``""``."""
        if fingerprint(list(self.signature)) != self.fingerprint:
            return "its signature does not hash to its fingerprint"
        if len(self.axis_names) != len(self.axis_sizes) or any(n < 1 for n in self.axis_sizes):
            return f"mesh axes {self.axis_names} do not match sizes {self.axis_sizes}"
        if self.pipeline is not None:
            try:
                config = self.pipeline_config()
            except (KeyError, TypeError, ValueError) as e:
                return f"its pipeline {self.pipeline} is not a pipeline ({e})"
            if dict(zip(self.axis_names, self.axis_sizes)).get(config.axis) != config.stages:
                return f"its pipeline's {config.stages} stages are not a mesh axis {config.axis!r} of that size"
        if self.context is not None:
            try:
                config = self.context_config()
            except (KeyError, TypeError, ValueError) as e:
                return f"its context parallelism {self.context} is not a shardplan.ContextConfig ({e})"
            unknown = [a for a in (*config.seq_axes, *config.batch_axes, *config.head_axes) if a not in self.axis_names]
            if unknown:
                return f"its context parallelism splits over mesh axis {unknown[0]!r}, not one of {self.axis_names}"
        from shardplan.parallel.recompute import POLICIES, USER
        for site in (self.remat or {}).get("sites", ()):
            if site["policy"] not in (*POLICIES, USER):
                return f"layer class {site['where']}: recomputation policy {site['policy']!r} is not one of " \
                       f"{', '.join((*POLICIES, USER))}"
        known = set(self.axis_names)
        specs = [(r.name, r.shape, r.spec) for r in (*self.inputs, *self.outputs, *self.activations) if r.path]
        specs += [(f"dot {k}", None, s) for k, v in self.dot_operands.items() for s in v]
        specs += [(f"pin {k}", None, s) for k, s in self.result_pins.items()]
        specs += [(f"rewrite {k}", None, r[w]) for k, r in self.rewrites.items() for w in ("operand", "made")]
        from shardplan.tracing.rewrites import EMITTERS
        for k, r in self.rewrites.items():
            if r["kind"] not in EMITTERS:
                return f"rewrite {k}: unknown kind {r['kind']!r} (known: {sorted(EMITTERS)})"
        for name, shape, spec in specs:
            used = [a for axes in spec for a in axes]
            if set(used) - known:
                return f"{name}: PartitionSpec uses mesh axis {sorted(set(used) - known)[0]!r}, not one of " \
                       f"{list(self.axis_names)}"
            if len(used) != len(set(used)):
                return f"{name}: a mesh axis appears twice in its PartitionSpec {spec}"
            if shape is not None and len(spec) != len(shape):
                return f"{name}: PartitionSpec {spec} has {len(spec)} entries for a rank-{len(shape)} tensor"
            sizes = dict(zip(self.axis_names, self.axis_sizes))
            for d, (n, axes) in enumerate(zip(shape or (), spec)):
                parts = math.prod(sizes[a] for a in axes)
                if n % parts:
                    return f"{name}: PartitionSpec {spec} splits dimension {d} (size {n}) in {parts}, " \
                           "which does not divide it"
        return ""

    def save(self, path: str) -> None:
        """Write :meth:`to_json` to ``path`` atomically (a reader never sees half a file). Under
        ``jax.distributed`` only process 0 writes."""
        if jax.process_index() == 0:
            files.write(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> Plan:
        """Read a plan file written by :meth:`save`; :class:`PlanFileError` names the file and what is wrong."""
        return cls.from_json(files.read(path), source=path)

    def specs_by_tensor(self) -> dict[str, Spec]:
        """Tensor path -> spec, for every tensor the plan names."""
        return {r.path: r.spec for r in (*self.inputs, *self.outputs, *self.activations) if r.path}

    def mismatch(self, signature: Sequence[str], input_names: Sequence[str]) -> str:
        """What differs between this plan and a traced step (its :data:`signature` and flat input
        names: the leaves' pytree paths), or ``""`` if nothing does. The pytree nodes themselves
        are not compared: their static fields (a ``TrainState``'s ``apply_fn`` and ``tx``) print
        differently in every process, and the leaves are matched by path."""
        names = [r.name for r in self.inputs]
        if list(input_names) != names:
            for k, (a, b) in enumerate(zip(names, input_names)):
                if a != b:
                    return f"input {k} is {b} in the step, {a} in the plan"
            return f"the step has {len(input_names)} input leaves, the plan {len(names)}"
        if fingerprint(list(signature)) == self.fingerprint:
            return ""
        by_input = {f"in:{k}": n for k, n in enumerate(names)}
        for a, b in zip(self.signature, signature):
            if a != b:
                pa, pb = a.split(" ")[0], b.split(" ")[0]
                where = f"input {by_input[pa]}" if pa == pb and pa in by_input else f"equation {pb}"
                if pa != pb:
                    return f"{where}: the step has {b}, the plan {a} there (the computation differs)"
                return f"{where} is {b.split(' ', 1)[1]} in the step, {a.split(' ', 1)[1]} in the plan"
        return f"the step has {len(signature)} tensors, the plan {len(self.signature)}"


def signature(graph) -> tuple[str, ...]:
    """``"path dtype[shape]"`` of every tensor of a graph: what a plan's fingerprint hashes."""
    return tuple(f"{t.path} {t.dtype.name}{list(t.shape)}" for t in graph.tensors)


def fingerprint(shapes: list[tuple[tuple[int, ...], str]]) -> str:
    import hashlib
    return hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]


def _describe_remat(remat: dict | None) -> str:
    """Each layer class's recomputation policy, for ``explain``."""
    if not remat or not remat.get("sites"):
        return "as the step is written"
    return "; ".join(f"{s['where']} ({s['layers']} layers): {s['policy']}" for s in remat["sites"])
