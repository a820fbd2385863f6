"""A solved choice made a :class:`Plan`: every tensor's PartitionSpec, the collectives counted as
XLA runs them (a repeated reshard once, reassociated all-reduces as one), the pins that make XLA
move what was priced, and the predicted memory with what the plan holds beyond its tensors."""

from __future__ import annotations

import dataclasses

from shardplan.compiler.cost import COLLECTIVE_KINDS, Spec
from shardplan.compiler.held import held_bytes
from shardplan.compiler.pricing import dot_specs
from shardplan.compiler.targets import compiler_kind
from shardplan.devices.mesh import MeshSpec
from shardplan.ir.graph import Graph
from shardplan.plans.plan import Plan, PredictedCost, TensorPlan, fingerprint, signature
from shardplan.sharding.strategies import Enumerator
from shardplan.solve.solver import SolverStats, point_memory
from shardplan.tracing.manual import body_costs


def role_of(path: str, fed: bool) -> str:
    """A readable role for an input leaf from its pytree path and whether the hosts feed it every
    step (``fed``: not the first argument, neither returned anew nor donated: the batch)."""
    low = path.lower()
    if "opt_state" in low:
        return "opt_state"
    if "param" in low:
        return "params"
    return "batch" if fed else "state"


def graph_fingerprint(g: Graph) -> str:
    return fingerprint(list(signature(g)))



def short_source(source: str) -> str:
    """``dir/file.py:12 (fn)`` -> ``file.py:12``: enough to find the line, short enough for a table."""
    where = source.split(" (")[0]
    return where.rsplit("/", 1)[-1] if ":" in where else ""


def reassociated(graph: Graph, all_reduced: dict[int, list], account) -> None:
    """XLA's AllReduceReassociate: ``add(all-reduce(x), all-reduce(y))`` becomes
    ``all-reduce(add(x, y))`` where both all-reduce the same bytes over the same mesh axes and
    nothing else reads them (through a transpose or reshape on the way), e.g. a tied embedding's
    gradient summed from its lookup and its logits. The bytes and seconds count one all-reduce;
    the ILP's objective keeps both (each reduction is priced on its own edge), as for a repeated
    reshard."""
    readers: dict[int, int] = {}
    for tid in graph.eqn_inputs.values():
        readers[tid] = readers.get(tid, 0) + 1

    def sole(tid):
        items = all_reduced.get(tid, [])
        return items[0] if tid is not None and len(items) == 1 and readers.get(tid) == 1 else None

    for t in graph.tensors:
        here, _, j = t.path.rpartition(":")
        prim = here.rsplit("/", 1)[-1].partition(".")[2]
        if j != "0" or t.id in all_reduced:
            continue
        if prim in ("transpose", "reshape", "copy"):
            moved = sole(graph.eqn_inputs.get((here, 0)))
            if moved is not None:
                all_reduced[t.id] = [moved]
        elif prim in ("add", "add_any"):
            a, b = graph.eqn_inputs.get((here, 0)), graph.eqn_inputs.get((here, 1))
            ra, rb = sole(a), sole(b)
            if a != b and ra is not None and rb is not None and \
                    (ra[0].axes, ra[0].nbytes, ra[1]) == (rb[0].axes, rb[0].nbytes, rb[1]):
                account([], rb[1], t.id, [(rb[0], 0.0)])
                all_reduced[t.id] = [ra]


def plan_specs(graph: Graph, enum: Enumerator, problem, choice) -> dict[int, Spec]:
    """Every tensor's PartitionSpec under ``choice``."""
    spec_of: dict[int, Spec] = {}
    for node, i in zip(problem.nodes, choice):
        if node.kind == "group":
            for t in enum.groups[node.key]:
                spec_of[t] = enum.tensor_spec_from(graph, t, node.options[i])
    for t in graph.tensors:
        spec_of.setdefault(t.id, ((),) * t.rank)
    return spec_of


def plan_memory(graph: Graph, enum: Enumerator, problem, choice, spec_of=None) -> float:
    """The predicted memory per device of ``choice``: the ILP's checkpoints, with what the plan
    holds there beyond its tensors (compiler/held.py)."""
    totals = point_memory(problem, choice)
    if not totals.size:
        return 0.0
    spec_of = spec_of if spec_of is not None else plan_specs(graph, enum, problem, choice)
    node = problem.node_of_dot
    totals = totals + held_bytes(graph, enum.price, spec_of, lambda k: problem.nodes[node[k]].options[choice[node[k]]])
    return float(totals.max())


def make_plan(graph: Graph, enum: Enumerator, problem, choice, stats: SolverStats, mesh: MeshSpec,
               in_tree, out_tree, out_names=None) -> Plan:
    model = enum.m
    spec_of = plan_specs(graph, enum, problem, choice)

    cost_of = {t.id: 0.0 for t in graph.tensors}
    by_kind = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    bytes_by_kind = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    by_axis = dict.fromkeys(mesh.axis_names, 0.0)
    bytes_by_axis = dict.fromkeys(mesh.axis_names, 0.0)

    all_reduced: dict[int, list] = {}      # tensor -> the all-reduces of its partial sums, (Comm, mult)

    dropped = 0.0       # seconds of collectives XLA runs once that the ILP priced for each reader

    def account(priced, mult, tid, repeated=()):
        nonlocal dropped
        for c, s in priced:
            if c.kind == "all-reduce":
                all_reduced.setdefault(tid, []).append((c, mult))
            by_kind[c.kind] += s
            bytes_by_kind[c.kind] += c.nbytes * mult
            for a in c.axes:
                by_axis[a] += s / len(c.axes)
                bytes_by_axis[a] += c.nbytes * mult / len(c.axes)
            if tid is not None:
                cost_of[tid] += s
        for c, _ in repeated:
            saved = model.collective_time(c) * mult
            dropped += saved
            bytes_by_kind[c.kind] -= c.nbytes * mult
            by_kind[c.kind] -= saved
            for a in c.axes:
                bytes_by_axis[a] -= c.nbytes * mult / len(c.axes)
                by_axis[a] -= saved / len(c.axes)
            if tid is not None:
                cost_of[tid] -= saved

    # XLA's partitioner reshards one tensor to one spec once per computation (its reshard cache,
    # then CSE): ops of one loop body (or of the top level) that need an operand resharded alike
    # share one set of collectives, e.g. the tied embedding gathered for the logits and again for
    # their gradient. Not across a differentiated jax.checkpoint's optimization barrier: its body
    # reads the barrier's copy of the operand, and reshards it again (an unrolled layer's weight,
    # gathered for the forward pass and again for the recomputation). The bytes and seconds count
    # each once; the objective the ILP minimised (searched_s) keeps each reader's, as its pairwise
    # tables price them.
    resharded: set = set()

    def repeats(tid, need, loop, itemsize=None, region=0):
        """The collectives of resharding ``tid`` to ``need`` where an op before did the same
        (``itemsize``: the bytes an element moves as, where not its own: a dot's bfloat16 pass;
        ``region``: the differentiated checkpoint the reading op is in, :attr:`Graph.region_of`)."""
        t = graph.tensors[tid]
        itemsize = itemsize or enum.price.wire(t)
        key = (tid, need, loop, itemsize, region)
        if need is None or key not in resharded:
            resharded.add(key)
            return []
        return model.reshard_items(t.shape, itemsize, spec_of[tid], need)

    # Where the pricing reshards an operand before its op, or makes a result in place and
    # reshards it after: apply.py pins both there, so XLA moves what the plan priced.
    operand_pins, result_pins, rewrites = {}, {}, {}
    indices_of = {e.dst: e for e in graph.edges if e.primitive.startswith("scatter") and e.required is not None}
    reshards = {id(e): enum.price.operand_reshard(e, spec_of[e.src], spec_of[e.dst])
                for e in graph.edges if e.required is not None}
    # An op that makes its result in place (a gather on the table's split) takes its other
    # operands (the indices) as that result needs them, not as the planned result would.
    made_by_op = {e.dst: (e.src, reshards[id(e)][2]) for e in graph.edges
                  if e.required is not None and reshards[id(e)][2] is not None}
    for e in graph.edges:
        if e.required is not None:
            comms, pin, made, rewrite = reshards[id(e)]
            where = made_by_op.get(e.dst)
            if where is not None and where[0] != e.src:
                need = e.need(where[1], model.sizes)
                comms = enum.price.scaled(model.reshard_items(graph.tensors[e.src].shape, enum.price.src_itemsize(e),
                                                        spec_of[e.src], need), e.mult)
                pin = need if comms else None
            if pin is not None:
                operand_pins[(graph.tensors[e.src].path, graph.tensors[e.dst].path)] = pin
            if made is not None:
                result_pins[graph.tensors[e.dst].path] = made
            if rewrite is not None:         # the op emitted another way (shardplan.tracing.rewrites)
                kind, made, partial = rewrite
                rewrites[graph.tensors[e.dst].path] = {"kind": kind, "operand": spec_of[e.src], "made": made,
                                                       "partial": tuple(partial)}
            account(comms, e.mult, e.dst, repeats(e.src, pin, graph.loop_of[e.dst], region=graph.region_of[e.dst]))
        else:
            need = enum.price.scattered_updates(e, spec_of[e.src], spec_of[e.dst])
            if need is not None and need != spec_of[e.src]:
                # Pinned, so that XLA moves the updates in the steps priced (one at a time), and
                # the indices to match them (small; else XLA reshards the updates to suit them).
                operand_pins[(graph.tensors[e.src].path, graph.tensors[e.dst].path)] = need
                ie = indices_of.get(e.src)
                if ie is not None and ie.required(need) != spec_of[ie.src]:
                    operand_pins[(graph.tensors[ie.src].path, graph.tensors[e.dst].path)] = ie.required(need)
            account(enum.price.edge_comms(e, spec_of[e.src], spec_of[e.dst]), e.mult, e.dst)
    for t in graph.shifts:
        account(enum.price.shift_comms(t, spec_of[t]), graph.tensors[t].mult, t)
    # A reduction to a scalar (a loss's mean over a split batch): one all-reduce of a scalar,
    # latency alone. It counts in the plan's collectives; the ILP leaves it out (it would be a
    # cost of the summed tensor's options, as small as one collective's latency).
    unsearched = 0.0
    for e in graph.to_scalar:
        priced = enum.price.edge_comms(e, spec_of[e.src], ())
        unsearched += sum(s for _, s in priced)
        account(priced, e.mult, e.dst)
    compute = 0.0
    dot_operands = {}
    for k, dot in enumerate(graph.dots):
        node = problem.nodes[problem.node_of_dot[k]]
        option = node.options[choice[problem.node_of_dot[k]]]
        req_l, req_r, prod, partial, _ = dot_specs(dot, option)
        repeated = [c for tid, need in ((dot.lhs, req_l), (dot.rhs, req_r))
                    for c in repeats(tid, need if need != spec_of[tid] else None, graph.loop_of[dot.out],
                                     enum.price.moved_itemsize(dot, graph.tensors[tid]), graph.region_of[dot.out])]
        account(enum.price.dot_comms(dot, option, spec_of[dot.lhs], spec_of[dot.rhs], spec_of[dot.out]), dot.mult,
                dot.out, repeated)
        t = enum.price.dot_compute(dot, option) * dot.mult
        compute += t
        cost_of[dot.out] += t
        # The result spec the strategy computes, reduced as priced (before any resharding to the
        # tensor's own spec): pinned, XLA runs the planned reduction instead of choosing its own.
        dot_operands[graph.tensors[dot.out].path] = (req_l, req_r, model.reduced_spec(prod, partial, spec_of[dot.out]))
    seen: dict = {}
    for r in graph.manual:                   # shard_map bodies: what they do whatever the plan
        costs = body_costs(r.body, dict(r.mesh), r.operands, seen, r.results, gpu=model.gpu,
                           cpu=graph.compiler == "cpu")
        for c, runs in costs.comms:
            account([(c, model.collective_time(c) * runs * r.mult)], runs * r.mult, r.out)
        seconds = costs.hbm_bytes / mesh.device.hbm_bandwidth
        seconds += sum(model.compute_time(flops, costs.dot_bytes[dtype], dtype) for dtype, flops in costs.flops.items())
        compute += seconds * r.mult
        if r.out is not None:
            cost_of[r.out] += seconds * r.mult
    if compiler_kind(mesh) != "cpu":         # XLA's CPU pipeline does not reassociate all-reduces
        reassociated(graph, all_reduced, account)
    searched = compute          # the ILP's pricing: HBM traffic counted its way
    for t in graph.tensors:
        if t.rank and (t.id in enum.price.a.traffic or t.id in enum.price.a.priced_traffic):
            per_device = enum.price.stored_bytes(t.id, spec_of[t.id])      # as the ILP priced it
            searched += enum.price.hbm_seconds(t.id, per_device)
            s = enum.price.hbm_seconds(t.id, per_device, priced=True)     # as XLA fuses it: the prediction
            compute += s
            cost_of[t.id] += s

    def row(tid, role, name=None):
        t = graph.tensors[tid]
        return TensorPlan(t.path, name or t.name, role, t.shape, t.dtype.name, spec_of[tid],
                          enum.price.stored_bytes(tid, spec_of[tid]), cost_of[tid], t.source)

    offload_s = offload_bytes = 0.0
    for t in graph.transfers:
        s = enum.price.offload_seconds(t, spec_of[t])
        offload_s += s
        cost_of[t] += s
    if graph.host_apart:        # the host's share: offloaded residuals at their fullest, and host arguments
        def host_bytes(tids):
            return sum(model.memory_bytes(graph.tensors[t].shape, graph.tensors[t].dtype.itemsize, spec_of[t])
                       for t in tids if graph.tensors[t].rank)
        offload_bytes = max((host_bytes(p) for p in graph.host_points), default=0.0) + \
            host_bytes(t for t in graph.inputs if graph.tensors[t].host)
    loading = 0.0
    for t in enum.fed:
        s = enum.price.input_seconds(t, spec_of[t])
        loading += s
        cost_of[t] += s
    inputs = tuple(row(t, role_of(graph.tensors[t].name, t in enum.fed)) for t in graph.inputs)
    by_role: dict[str, float] = {}
    for r in inputs:
        by_role[r.role] = by_role.get(r.role, 0.0) + r.bytes_per_device
    out_names = list(out_names) if out_names is not None else [f"out{i}" for i in range(len(graph.outputs))]
    outputs = tuple(row(t, "output", out_names[i]) if t is not None else
                    TensorPlan("", out_names[i], "output", (), "float32", (), 0.0, 0.0)
                    for i, t in enumerate(graph.outputs))
    seen = set(graph.inputs) | {t for t in graph.outputs if t is not None}
    acts = tuple(row(t.id, "activation", f"{t.name} @ {short_source(t.source)}" if short_source(t.source) else t.name)
                 for t in graph.tensors if t.rank and t.id not in seen)
    memory = plan_memory(graph, enum, problem, choice, spec_of)
    cost = PredictedCost(compute_s=compute, comm_s_by_kind=by_kind, comm_s_by_axis=by_axis,
                         comm_bytes_by_kind=bytes_by_kind, memory_bytes=memory,
                         memory_bytes_by_role=by_role, comm_bytes_by_axis=bytes_by_axis, input_s=loading,
                         offload_s=offload_s, offload_bytes=offload_bytes,
                         tuple_slots=enum.price.a.tuple_slots)
    cost = dataclasses.replace(cost, searched_s=dataclasses.replace(cost, compute_s=searched).step_s + dropped
                               - unsearched)
    return Plan(mesh_name=mesh.name, axis_names=mesh.axis_names, axis_sizes=mesh.axis_sizes, inputs=inputs,
                outputs=outputs, activations=acts, dot_operands=dot_operands, operand_pins=operand_pins,
                result_pins=result_pins, rewrites=rewrites,
                cost=cost, solver=stats,
                fingerprint=graph_fingerprint(graph), signature=signature(graph), warnings=tuple(graph.warnings),
                stage_shifts=bool(graph.shifts),
                in_tree=in_tree, out_tree=out_tree, mesh_spec=mesh)
