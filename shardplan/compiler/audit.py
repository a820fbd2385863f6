"""Hold a plan's predictions against what XLA compiled: collectives, dot FLOPs and memory.

>>> compiled = train_step.lower(abstract_state, abstract_batch).compile()   # doctest: +SKIP
>>> print(train_step.plan.audit(compiled).table())                          # doctest: +SKIP

The compiled side is read from the HLO text (:mod:`shardplan.compiler.hlo`): every collective with its
bytes per device, the mesh axes its replica groups span and its trip count, priced on the plan's
mesh with the same formulas as the prediction. Memory is argument + output + temp - alias per
device (:mod:`shardplan.compiler.footprint`: on a TPU, temp is the heap libtpu's buffer assignment lays out).

Compiling on CPU (fake devices) differs from a GPU or TPU compile in known ways, which the audit
names in ``notes`` rather than hiding: the CPU backend emits a reduce-scatter as an all-reduce
whose users keep only their slice (read here as the reduce-scatter an accelerator emits), and it
computes bf16 in f32, its collectives and temporaries (a plan for a CPU mesh prices them so; one
for a GPU or TPU compiled on CPU sees their bytes doubled).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardplan.compiler import footprint
from shardplan.compiler.cost import COLLECTIVE_KINDS, CostModel
from shardplan.compiler.footprint import compiled_host_memory, compiled_memory, compiled_temp
from shardplan.compiler.hlo import Collective, collectives, dot_flops
from shardplan.compiler.layout import HEAP_ALIGN
from shardplan.compiler.targets import compiler_kind
from shardplan.devices.mesh import MeshSpec
from shardplan.util.sizes import format_bytes


@dataclasses.dataclass(frozen=True)
class AuditRow:
    """Predicted against compiled for one collective kind (or one mesh axis, or memory)."""

    name: str
    predicted_bytes: float
    compiled_bytes: float
    predicted_s: float
    compiled_s: float
    compiled_count: float = 0.0

    def bytes_error(self) -> float:
        """Relative error of the predicted bytes; 0 when both are zero, inf when only one is."""
        if self.compiled_bytes == 0:
            return 0.0 if self.predicted_bytes == 0 else float("inf")
        return (self.predicted_bytes - self.compiled_bytes) / self.compiled_bytes


@dataclasses.dataclass(frozen=True)
class Audit:
    """A plan's prediction against one compiled program. Build with :func:`audit`."""

    platform: str
    collectives: tuple[Collective, ...]
    by_kind: tuple[AuditRow, ...]
    by_axis: tuple[AuditRow, ...]
    memory: AuditRow                 # bytes per device: predicted peak vs compiled (shardplan.compiler.footprint)
    dot_flops: dict[str, float]      # per device per step, by HLO dtype
    notes: tuple[str, ...]
    host: AuditRow | None = None     # bytes per device offloaded to host memory, where either side has any

    @property
    def comm_bytes(self) -> tuple[float, float]:
        """(predicted, compiled) collective bytes per device per step."""
        return sum(r.predicted_bytes for r in self.by_kind), sum(r.compiled_bytes for r in self.by_kind)

    def comm_error(self) -> float:
        p, c = self.comm_bytes
        return 0.0 if c == 0 and p == 0 else float("inf") if c == 0 else (p - c) / c

    def memory_error(self) -> float:
        return self.memory.bytes_error()

    def divergences(self, comm_tolerance: float = 0.05, memory_tolerance: float = 0.15) -> list[str]:
        """One line per figure whose prediction is off by more than the tolerance."""
        out = []
        p, c = self.comm_bytes
        if abs(self.comm_error()) > comm_tolerance:
            out.append(f"collective bytes: predicted {format_bytes(p)}, compiled {format_bytes(c)} "
                       f"({self.comm_error():+.1%}, tolerance {comm_tolerance:.0%})")
        for r in self.by_kind:
            if max(r.predicted_bytes, r.compiled_bytes) > comm_tolerance * max(c, 1.0) and \
                    abs(r.bytes_error()) > comm_tolerance:
                out.append(f"{r.name}: predicted {format_bytes(r.predicted_bytes)}, compiled "
                           f"{format_bytes(r.compiled_bytes)} ({r.bytes_error():+.1%})")
        if abs(self.memory_error()) > memory_tolerance:
            out.append(f"memory per device: predicted {format_bytes(self.memory.predicted_bytes)}, compiled "
                       f"{format_bytes(self.memory.compiled_bytes)} ({self.memory_error():+.1%}, "
                       f"tolerance {memory_tolerance:.0%})")
        if self.host is not None and abs(self.host.bytes_error()) > memory_tolerance:
            out.append(f"host memory per device: predicted {format_bytes(self.host.predicted_bytes)}, compiled "
                       f"{format_bytes(self.host.compiled_bytes)} ({self.host.bytes_error():+.1%}, "
                       f"tolerance {memory_tolerance:.0%})")
        return out

    def __str__(self) -> str:
        return self.table()

    def table(self) -> str:
        """Prediction against compiled per collective kind, per mesh axis, and for memory
        (``print(audit)`` prints it)."""
        head = f"{'':<22}{'predicted':>14}{'compiled':>14}{'error':>9}{'pred ms':>10}{'comp ms':>10}{'runs':>8}"
        lines = [f"audit against the compiled program ({self.platform})", head, "-" * len(head)]

        def fmt(r: AuditRow, runs=True):
            err = r.bytes_error()
            err_s = ("" if r.predicted_bytes == r.compiled_bytes == 0 else "n/a" if err == float("inf")
                     else f"{err:+.1%}")
            return (f"{r.name:<22}{format_bytes(r.predicted_bytes):>14}{format_bytes(r.compiled_bytes):>14}"
                    f"{err_s:>9}{r.predicted_s * 1e3:>10.3f}{r.compiled_s * 1e3:>10.3f}"
                    f"{(f'{r.compiled_count:.0f}' if runs else ''):>8}")
        lines += [fmt(r) for r in self.by_kind]
        p, c = self.comm_bytes
        lines.append(fmt(AuditRow("all collectives", p, c, sum(r.predicted_s for r in self.by_kind),
                                  sum(r.compiled_s for r in self.by_kind),
                                  sum(r.compiled_count for r in self.by_kind))))
        lines += [fmt(dataclasses.replace(r, name=f"axis {r.name}"), runs=False) for r in self.by_axis]
        lines.append(fmt(self.memory, runs=False))
        if self.host is not None:
            lines.append(fmt(self.host, runs=False))
        flops = ", ".join(f"{k} {v / 1e12:.3f} TFLOP" for k, v in self.dot_flops.items()) or "none"
        lines.append(f"dot FLOPs per device per step: {flops}")
        lines += [f"note: {n}" for n in self.notes]
        div = self.divergences()
        lines += [f"DIVERGES: {d}" for d in div] or ["no divergence beyond 5% (collective bytes) / 15% (memory)"]
        return "\n".join(lines)


def _heap_note(cost, compiled, heap_overhead: float) -> str:
    """What the compiled heap says of ``device.heap_overhead`` (the allowance on live temporaries)."""
    args = sum(cost.memory_bytes_by_role.values())
    slots = cost.tuple_slots * HEAP_ALIGN       # a TPU's tuple results, a heap slot each
    live = max(cost.memory_bytes - args - slots, 0.0) / (1.0 + heap_overhead)
    heap = compiled_temp(compiled)
    implied = f"device.heap_overhead = {(heap - slots) / live - 1.0:.2f} would match" if live > 0 else \
        "no temporaries"
    laid = footprint.dumped(compiled)
    layout = (f"; the heap's live peak {format_bytes(laid.live_peak)}, its layout adds "
              f"{laid.heap / laid.live_peak - 1.0:+.0%}; {laid.tuple_slots} tuple slots, "
              f"{cost.tuple_slots} predicted"
              ) if laid is not None and laid.live_peak else ""
    tuples = f" + {cost.tuple_slots} tuple slots" if cost.tuple_slots else ""
    return (f"memory: temporaries predicted live {format_bytes(live)} + {heap_overhead:.0%} heap overhead{tuples}; "
            f"compiled heap {format_bytes(heap)} ({implied}){layout}")


def price_collectives(comms, model: CostModel) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Bytes, seconds and runs per step of compiled collectives, by kind, priced by ``model``."""
    nbytes = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    seconds, runs = dict(nbytes), dict(nbytes)
    for c in comms:
        nbytes[c.kind] += c.nbytes * c.count
        seconds[c.kind] += model.collective_time(c.comm()) * c.count
        runs[c.kind] += c.count
    return nbytes, seconds, runs


def audit(plan, compiled, mesh: MeshSpec, jax_mesh=None, *, platform: str | None = None,
          compiler: str | None = None, memory_compiled=None) -> Audit:
    """Compare ``plan`` with ``compiled`` (a ``jax.stages.Compiled``), pricing both on ``mesh``;
    ``compiler`` names what compiled it (the table says so); ``memory_compiled``: the same
    program compiled to count device memory alone, read for the memory row where given."""
    jax_mesh = jax_mesh if jax_mesh is not None else plan.jax_mesh()
    if platform is None:
        platform = jax_mesh.devices.flat[0].platform
    text = compiled.as_text()
    comms = tuple(collectives(text, jax_mesh))
    model = CostModel(mesh)
    bytes_k, secs_k, runs_k = price_collectives(comms, model)
    secs_a: dict[str, float] = dict.fromkeys(mesh.axis_names, 0.0)
    bytes_a: dict[str, float] = dict.fromkeys(mesh.axis_names, 0.0)
    for c in comms:
        for a in c.axes:
            secs_a[a] += model.collective_time(c.comm()) * c.count / len(c.axes)
            bytes_a[a] += c.nbytes * c.count / len(c.axes)
    cost = plan.cost
    by_kind = tuple(AuditRow(k, cost.comm_bytes_by_kind.get(k, 0.0), bytes_k[k], cost.comm_s_by_kind.get(k, 0.0),
                             secs_k[k], runs_k[k])
                    for k in bytes_k if bytes_k[k] or cost.comm_bytes_by_kind.get(k, 0.0))
    by_axis = tuple(AuditRow(a, cost.comm_bytes_by_axis.get(a, 0.0), bytes_a[a], cost.comm_s_by_axis.get(a, 0.0),
                             secs_a[a])
                    for a in mesh.axis_names)
    held = compiled if memory_compiled is None else memory_compiled
    memory = AuditRow("memory per device", cost.memory_bytes, compiled_memory(held), 0.0, 0.0)
    host = AuditRow("host memory per device", cost.offload_bytes, compiled_host_memory(compiled), cost.offload_s,
                    0.0)
    notes = ([f"compiled by {compiler}"] if compiler else []) + [_heap_note(cost, held, mesh.device.heap_overhead)]
    if platform == "cpu":
        read = [c for c in comms if c.emitted]
        if read:
            notes.append(f"CPU compile: {sum(c.count for c in read):.0f} all-reduce runs whose users keep only "
                         f"their slice are read as the reduce-scatters a GPU/TPU compile emits "
                         f"({format_bytes(sum(c.nbytes * c.count for c in read))})")
        if any(r.dtype == "bfloat16" for r in plan.inputs) and compiler_kind(mesh) == "cpu":
            notes.append("CPU compile: bf16 is computed in f32: the plan holds the bf16 temporaries the step makes "
                         "and prices its bf16 collectives as f32, as this compiler runs them")
        elif any(r.dtype == "bfloat16" for r in plan.inputs):
            notes.append("CPU compile: bf16 is computed in f32, so the compiled collective bytes and temporaries of "
                         "bf16 tensors are doubled (memory and bytes are not comparable with this plan for "
                         f"{mesh.device.name}); audit fp32 models on CPU")
    return Audit(platform, comms, by_kind, by_axis, memory, dot_flops(text), tuple(notes),
                 host if host.predicted_bytes or host.compiled_bytes else None)


def audit_step(plan, compiled, mesh: MeshSpec | None = None, jax_mesh: Any = None) -> Audit:
    """:func:`audit` with the plan's own mesh when it came from a preset."""
    if mesh is None:
        mesh = plan.mesh_spec
    if mesh is None:
        raise ValueError("this plan does not carry its mesh (it was loaded from JSON); "
                         "pass mesh=shardplan.load_mesh(...) to audit it")
    return audit(plan, compiled, mesh, jax_mesh)
