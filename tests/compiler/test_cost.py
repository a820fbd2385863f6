import pytest
from jax.sharding import PartitionSpec as P

from shardplan.compiler.cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_OP, REDUCE_SCATTER, Comm, CostModel
from shardplan.devices.mesh import load_mesh
from shardplan.util.sizes import parse_bytes

M = CostModel(load_mesh("h100-8"))   # data=2, model=4 over NVLink


def test_ring_formulas():
    bw, lat = 450e9, 3e-6
    assert M.collective_time(Comm(ALL_REDUCE, ("model",), 4e9)) == pytest.approx(2 * (3 / 4 * 4e9 / bw + 3 * lat))
    assert M.collective_time(Comm(ALL_GATHER, ("data",), 4e9)) == pytest.approx(1 / 2 * 4e9 / bw + lat)
    assert M.collective_time(Comm(ALL_GATHER, ("data", "model"), 1e9)) == pytest.approx(7 / 8 * 1e9 / bw + 7 * lat)


def test_collectives_across_nodes_run_hierarchically():
    m = CostModel(load_mesh("h100-8x8"))     # data=8 over InfiniBand, model=8 over NVLink
    nv, ib, b = (450e9, 3e-6), (50e9, 10e-6), 1e9
    inner = 7 / 8 * b / nv[0] + 7 * nv[1]
    outer = 7 / 8 * (b / 8) / ib[0] + 7 * ib[1]            # the slow level moves 1/8 of the buffer
    assert m.collective_time(Comm(ALL_REDUCE, ("data", "model"), b)) == pytest.approx(2 * (inner + outer))
    assert m.collective_time(Comm(REDUCE_SCATTER, ("data", "model"), b)) == pytest.approx(inner + outer)
    assert m.latency_time(Comm(ALL_REDUCE, ("data", "model"), b)) == pytest.approx(2 * (7 * nv[1] + 7 * ib[1]))
    # An all-to-all has no hierarchical shortcut: it runs at the slowest link.
    assert m.collective_time(Comm(ALL_TO_ALL, ("data", "model"), b)) == pytest.approx(63 / 64 * b / ib[0] + 63 * ib[1])


def test_reshard_kinds():
    shape = (64, 32)
    assert M.reshard(shape, 4, (("model",), ()), (("model",), ())) == []
    assert M.reshard(shape, 4, ((), ()), (("model",), ())) == []              # a local slice
    [c] = M.reshard(shape, 4, (("model",), ()), ((), ()))
    assert (c.kind, c.axes, c.nbytes) == (ALL_GATHER, ("model",), 64 * 32 * 4)
    [c] = M.reshard(shape, 4, (("model",), ()), ((), ("model",)))
    assert (c.kind, c.nbytes) == (ALL_TO_ALL, 64 * 32 * 4 / 4)
    # slice first: the gather moves the already-sliced array
    [c] = M.reshard(shape, 4, (("model",), ()), ((), ("data",)))
    assert (c.kind, c.nbytes) == (ALL_GATHER, 64 * 32 * 4 / 2)


def test_partial_sums_become_reduce_scatter_or_all_reduce():
    shape = (64, 32)
    [c] = M.reduce_partial(shape, 4, ((), ()), ("model",), (("model",), ()))
    assert (c.kind, c.nbytes) == (REDUCE_SCATTER, 64 * 32 * 4)
    [c] = M.reduce_partial(shape, 4, ((), ()), ("model",), ((), ()))
    assert (c.kind, c.nbytes) == (ALL_REDUCE, 64 * 32 * 4)


def test_uneven_shards_priced_at_largest_shard():
    assert M.per_device_bytes((10,), 4, (("model",),)) == 3 * 4


@pytest.mark.parametrize("text, expected", [("60GiB", 60 * 2**30), ("80GB", 80e9), ("1.5e9", 1.5e9), (1024, 1024)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == int(expected)


@pytest.mark.parametrize("bad", ["sixty", "-1GiB", "10 parsecs", 0, True])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        parse_bytes(bad)


def test_dropping_a_major_axis_gathers_it_and_permutes_the_minor_one():
    shape = (16, 8)
    # ('data', 'model') -> ('data',): the minor axis leaves cleanly
    [c] = M.reshard(shape, 4, (("data", "model"), ()), (("data",), ()))
    assert (c.kind, c.axes) == (ALL_GATHER, ("model",))
    # ('data', 'model') -> ('model',): the blocks of 'model' sit on other devices than they should:
    # XLA permutes them and gathers 'data' (test_reshard_is_what_xla_compiles checks it on the HLO)
    kinds = [(c.kind, c.axes, c.nbytes) for c in M.reshard(shape, 4, (("data", "model"), ()), (("model",), ()))]
    assert kinds == [("collective-permute", ("data", "model"), 2 * 8 * 4), (ALL_GATHER, ("data",), 4 * 8 * 4)]


_RESHARDS = [
    (P(("data", "model")), P("data", None, "model")), (P("model"), P(None, "model")),
    (P("data", "model"), P("model", "data")), (P(None, None, "model"), P("model")),
    (P("data", None, "model"), P(("data", "model"))), (P(None, ("data", "model")), P(("data", "model"))),
    (P("data", "model"), P(None, "model", "data")), (P(None, None, ("data", "model")), P("data", "model")),
    (P("data", None, "model"), P("data", "model")), (P("data"), P()), (P(("data", "model")), P("model")),
    (P(("model", "data")), P("data")), (P("data", "model"), P("data")), (P(), P("data")), (P("model"), P("data")),
]


@pytest.mark.parametrize("src, dst", _RESHARDS, ids=[f"{s}->{d}" for s, d in _RESHARDS])
def test_reshard_is_what_xla_compiles(src, dst):
    """The resharding model names the collectives (kind, mesh axes, bytes) of the compiled HLO,
    the reshard emitted as the emitter emits it (through :func:`reshard_steps`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from shardplan.compiler.cost import from_partition_spec, reshard_steps, to_partition_spec
    from shardplan.compiler.hlo import collectives
    from shardplan.devices.mesh import make_jax_mesh
    mesh = make_jax_mesh(("data", "model"), (2, 4))
    shape = (16, 32, 64)
    have, want = from_partition_spec(src, 3), from_partition_spec(dst, 3)

    def step(a):
        a = a * 2
        for s in reshard_steps(have, want, ("data", "model")):
            a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, to_partition_spec(s)))
        return a
    f = jax.jit(step, in_shardings=NamedSharding(mesh, src), out_shardings=NamedSharding(mesh, dst))
    text = f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()
    compiled = sorted((c.kind, c.axes, c.nbytes) for c in collectives(text, mesh))
    predicted = sorted((c.kind, c.axes, c.nbytes) for c in M.reshard(shape, 4, have, want))
    assert predicted == compiled


@pytest.mark.slow
def test_no_reshard_step_makes_xla_replicate_first():
    """Pairs of rank-2 specs on a (2, 2, 2) mesh and of rank-3 specs on (2, 4), emitted through
    :func:`reshard_steps`: the SPMD partitioner never falls back to replicating the array
    ("Involuntary full rematerialization"), and the compiled collectives' bytes are the
    model's (to the byte on (2, 4); never under it on (2, 2, 2), where a permute of equal-size
    shards can be cheaper than priced)."""
    import itertools
    import os
    import tempfile

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from shardplan.compiler.cost import reshard_steps, to_partition_spec
    from shardplan.compiler.hlo import collectives
    from shardplan.devices.mesh import make_jax_mesh
    for names, sizes, rank in ((("data", "fsdp", "model"), (2, 2, 2), 2), (("data", "model"), (2, 4), 3)):
        mesh = make_jax_mesh(names, sizes)
        model = CostModel(load_mesh("cpu-8", axes=dict(zip(names, sizes))))
        specs = set()
        for pick in itertools.product(range(rank + 1), repeat=len(names)):
            dims = [[] for _ in range(rank)]
            for a, d in zip(names, pick):
                if d < rank:
                    dims[d].append(a)
            specs.add(tuple(map(tuple, dims)))
        shape = (16,) * rank
        fallbacks, under = [], []
        saved = os.dup(2)
        pairs = list(itertools.permutations(sorted(specs), 2))
        # Every 6th pair on (2, 2, 2), every 2nd on (2, 4), for time (all pass, and all 4032
        # rank-3 pairs on (2, 2, 2)).
        for have, want in pairs[::6] if len(names) == 3 else pairs[::2]:
            def step(a, have=have, want=want):
                a = a * 2
                for s in reshard_steps(have, want, names):
                    a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, to_partition_spec(s)))
                return a
            f = jax.jit(step, in_shardings=NamedSharding(mesh, to_partition_spec(have)))
            with tempfile.TemporaryFile() as err:      # XLA warns on the C++ side: read fd 2
                os.dup2(err.fileno(), 2)
                try:
                    text = f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()
                finally:
                    os.dup2(saved, 2)
                err.seek(0)
                if b"Involuntary full rematerialization" in err.read():
                    fallbacks.append((have, want))
            compiled = sum(c.nbytes * c.count for c in collectives(text, mesh))
            predicted = sum(c.nbytes for c in model.reshard(shape, 4, have, want))
            if compiled > predicted or (len(names) == 2 and compiled != predicted):
                under.append((have, want, compiled, predicted))
        os.close(saved)
        assert not fallbacks, fallbacks[:5]
        assert not under, under[:5]


@pytest.mark.parametrize("axes,sizes,dst", [
    (("data", "model"), (2, 4), P()),
    (("data", "model"), (2, 4), P(None, "model")),
    (("data", "model"), (2, 4), P(None, "data")),
    (("data", "model"), (2, 4), P("data", "model")),
    (("data", "model"), (2, 4), P("model", "data")),
    (("data", "model"), (2, 4), P(None, ("data", "model"))),
    (("data", "model", "x"), (2, 2, 2), P("data", "model")),
    (("data", "model", "x"), (2, 2, 2), P("data", ("model", "x"))),
    (("data", "model", "x"), (2, 2, 2), P("x", "data")),
])
def test_partial_sum_reduction_is_what_xla_compiles(axes, sizes, dst):
    """A weight gradient, partial over every mesh axis (the batch is split over all of them),
    reduced onto ``dst``: the kinds, axes and bytes the model names are the compiled HLO's
    (CPU all-reduce-then-slice read as the reduce-scatter GPUs emit)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from shardplan.compiler.cost import from_partition_spec
    from shardplan.compiler.hlo import collectives
    from shardplan.devices.mesh import make_jax_mesh
    mesh = make_jax_mesh(axes, sizes)
    batch = NamedSharding(mesh, P(axes, None))
    out = NamedSharding(mesh, dst)
    f = jax.jit(lambda a, b: a.T @ b, in_shardings=(batch, batch), out_shardings=out)
    args = jax.ShapeDtypeStruct((64, 256), jnp.float32), jax.ShapeDtypeStruct((64, 512), jnp.float32)
    compiled = sorted((c.kind, c.axes, c.nbytes) for c in collectives(f.lower(*args).compile().as_text(), mesh))
    model = CostModel(load_mesh("cpu-8", axes=dict(zip(axes, sizes))))
    predicted = sorted((c.kind, c.axes, c.nbytes) for c in model.reduce_partial(
        (256, 512), 4, ((), ()), axes, from_partition_spec(dst, 2)))
    assert predicted == compiled


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_a_reduce_scatter_puts_its_axes_minor_to_the_split_the_dimension_has(target):
    """A dot whose result is split over ``model`` (the weight's columns) and partial over ``fsdp``
    (the contraction): XLA's SPMD partitioner reduce-scatters ``fsdp`` inside each device's
    ``model`` block, so the result is made ``('model', 'fsdp')``. Pinned to that, the compiled
    collectives are the model's one reduce-scatter; pinned to the mesh order ``('fsdp',
    'model')``, the partitioner gathers the weight's columns and reduces the whole result
    instead (the CNN and Llama cells of the CPU corpus compiled 13-54% more collective bytes than
    predicted until the model made the minor order on every compiler)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from shardplan.compiler import targets
    from shardplan.compiler.hlo import collectives
    from shardplan.devices.mesh import make_jax_mesh
    axes = {"data": 2, "fsdp": 2, "model": 2}
    spec = load_mesh("cpu-8" if target == "cpu" else "h100-8", axes=axes)
    if target == "cpu":
        mesh = make_jax_mesh(tuple(axes), tuple(axes.values()))
    elif not targets.available(target):
        pytest.skip("the GPU compiler is not installed (pip install 'shardplan[aot]')")
    else:
        mesh, _ = targets.target_mesh(spec, target)
    model = CostModel(spec)
    made = model.reduced_spec((("data",), ("model",)), ("fsdp",), (("data",), ("fsdp", "model")))
    assert made == (("data",), ("model", "fsdp"))
    args = jax.ShapeDtypeStruct((64, 256), jnp.float32), jax.ShapeDtypeStruct((256, 512), jnp.float32)

    def compiled(out):
        f = jax.jit(lambda x, w: x @ w, in_shardings=(NamedSharding(mesh, P("data", "fsdp")),
                                                      NamedSharding(mesh, P("fsdp", "model"))),
                    out_shardings=NamedSharding(mesh, out))
        return sorted((c.kind, c.axes, c.nbytes) for c in collectives(f.lower(*args).compile().as_text(), mesh))
    predicted = sorted((c.kind, c.axes, c.nbytes) for c in model.reduce_partial(
        (64, 512), 4, (("data",), ("model",)), ("fsdp",), made))
    assert predicted == [(REDUCE_SCATTER, ("fsdp",), 32 * 256 * 4)]
    assert compiled(P("data", ("model", "fsdp"))) == predicted
    major = compiled(P("data", ("fsdp", "model")))
    assert (ALL_GATHER, ("model",), 256 * 512 * 4 // 2) in major and predicted[0] not in major


@pytest.mark.parametrize("src", [P("data", "model", None), P("model", "data", None)])
@pytest.mark.parametrize("dst", [P(), P(None, "model"), P(None, "data"), P("data", "model"),
                                 P(None, ("data", "model"))])
def test_partial_sums_from_two_contracting_dims_are_what_xla_compiles(src, dst):
    """Batch and sequence split over different mesh axes (Megatron-SP activations): the weight
    gradient is partial over both, one axis per contracting dimension. With nothing to scatter
    XLA all-reduces each dimension's axis on its own, at full size."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from shardplan.compiler.cost import from_partition_spec
    from shardplan.compiler.hlo import collectives
    from shardplan.devices.mesh import make_jax_mesh
    mesh = make_jax_mesh(("data", "model"), (2, 4))
    act = NamedSharding(mesh, src)
    f = jax.jit(lambda a, b: jnp.einsum("bsi,bso->io", a, b), in_shardings=(act, act),
                out_shardings=NamedSharding(mesh, dst))
    args = jax.ShapeDtypeStruct((8, 64, 256), jnp.float32), jax.ShapeDtypeStruct((8, 64, 512), jnp.float32)
    compiled = sorted((c.kind, c.axes, c.nbytes) for c in collectives(f.lower(*args).compile().as_text(), mesh))
    groups = tuple((a,) for a in src[:2])
    predicted = sorted((c.kind, c.axes, c.nbytes) for c in M.reduce_partial(
        (256, 512), 4, ((), ()), ("data", "model"), from_partition_spec(dst, 2), groups))
    assert predicted == compiled


def _all_specs(axes, rank):
    import itertools
    out = []
    for pick in itertools.product(range(-1, rank), repeat=len(axes)):
        spec = [()] * rank
        for a, d in zip(axes, pick):
            if d >= 0:
                spec[d] = spec[d] + (a,)
        out.append(tuple(spec))
    return out


@pytest.mark.parametrize("groups", [None, REDUCE_OP])
@pytest.mark.parametrize("shape", [(8, 16, 4), (2, 2, 2), (6, 4, 1), (3, 8, 5)])
def test_tables_price_what_the_collectives_cost(shape, groups):
    """The ILP's tables (one unit per spec pair, scaled by the tensor's bytes) give the seconds of
    the collectives :meth:`reduce_partial` lists, even and uneven splits alike, with combined
    reductions paying their share of the latency."""
    import random
    m = CostModel(load_mesh("h100-8x8", axes={"data": 2, "fsdp": 4, "model": 8}))
    specs = _all_specs(m.mesh.axis_names, len(shape))
    rnd = random.Random(len(shape) * 7 + shape[0])
    rows = []
    for _ in range(40):
        produced = rnd.choice(specs)
        partial = tuple(a for a in m.mesh.axis_names if rnd.random() < 0.4 and all(a not in x for x in produced))
        rows.append((produced, partial, groups))
    cols = rnd.sample(specs, 40)
    for share in (1, 3):
        table = m.reduce_table(shape, 2, rows, cols, share)
        for (produced, partial, _), row in zip(rows, table):
            for dst, cell in zip(cols, row):
                exact = sum(m.collective_time(c) - ((1 - 1 / share) * m.latency_time(c)
                                                    if c.kind in (ALL_REDUCE, REDUCE_SCATTER) else 0.0)
                            for c in m.reduce_partial(shape, 2, produced, partial, dst, groups))
                assert cell == pytest.approx(exact, rel=1e-9, abs=1e-15), (produced, partial, dst)
                # The itemised collectives of a chosen plan come from the same units.
                items = m.reduce_items(shape, 2, produced, partial, dst, groups, share)
                assert sum(sec for _, sec in items) == pytest.approx(cell, rel=1e-12, abs=1e-15)
                assert [c for c, _ in items] == m.reduce_partial(shape, 2, produced, partial, dst, groups)


@pytest.mark.parametrize("src", [P(("data", "model")), P(("model", "data"))])
@pytest.mark.parametrize("dst", [P(), P("data"), P("model"), P("data", "model"), P(None, "model"), P("model", "data")])
def test_a_reduce_ops_partial_sums_are_all_reduced_whole_then_sliced(src, dst):
    """A reduce_sum over a dimension split over both mesh axes (a bias or position-embedding
    gradient) is all-reduced over both at full size and sliced locally, whatever the result's
    sharding: XLA emits no reduce-scatter for it, unlike a dot's partial sums (the GPU compiler
    gives the same collectives: GPT-2's position-embedding gradient on h100-8)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from shardplan.compiler.cost import from_partition_spec
    from shardplan.compiler.hlo import collectives
    from shardplan.devices.mesh import make_jax_mesh
    mesh = make_jax_mesh(("data", "model"), (2, 4))
    f = jax.jit(lambda x: x.sum(0), in_shardings=NamedSharding(mesh, src), out_shardings=NamedSharding(mesh, dst))
    text = f.lower(jax.ShapeDtypeStruct((64, 32, 16), jnp.float32)).compile().as_text()
    compiled = sorted((c.kind, c.axes, c.nbytes) for c in collectives(text, mesh, read_cpu_reduce_scatter=False))
    predicted = sorted((c.kind, c.axes, c.nbytes) for c in M.reduce_partial(
        (32, 16), 4, ((), ()), ("data", "model"), from_partition_spec(dst, 2), REDUCE_OP))
    assert predicted == compiled


def test_a_scatter_add_into_a_table_split_along_whole_rows_moves_the_updates():
    """An embedding gradient (scatter-add of per-token rows into a table split along its
    embedding dimension) from updates split over the batch: XLA's operand-passthrough scatter
    moves the updates (an all-to-all) and scatters into the local shard; it does not all-reduce
    the whole table (GPT-2 on h100-8 compiled for GPU: one 24 MiB all-to-all, no 147 MiB all-reduce)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from shardplan.compiler.cost import from_partition_spec
    from shardplan.compiler.hlo import collectives
    from shardplan.compiler.pricing import Pricer
    from shardplan.devices.mesh import make_jax_mesh
    from shardplan.sharding.rules import apply_rule
    from shardplan.tracing.walk import build_graph
    mesh = make_jax_mesh(("data", "model"), (2, 4))
    vocab, dim = 512, 64

    def grad(ids, upd):
        return jnp.zeros((vocab, dim), upd.dtype).at[ids].add(upd)
    args = jax.ShapeDtypeStruct((8, 16), jnp.int32), jax.ShapeDtypeStruct((8, 16, dim), jnp.float32)
    src, dst = P(("data", "model")), P(None, ("data", "model"))
    f = jax.jit(grad, in_shardings=(NamedSharding(mesh, src), NamedSharding(mesh, src)),
                out_shardings=NamedSharding(mesh, dst))
    compiled = sorted((c.kind, c.axes, c.nbytes) for c in collectives(f.lower(*args).compile().as_text(), mesh)
                      if c.nbytes > 8 * 16 * 4)       # the ids' all-gather is not priced on this edge
    g = build_graph(jax.make_jaxpr(grad)(*args), ["ids", "upd"], apply_rule)
    pricer = Pricer(g, M)
    [edge] = [e for e in g.edges if e.primitive.startswith("scatter") and e.produced is not None]
    predicted = sorted((c.kind, c.axes, c.nbytes) for c, _ in pricer.edge_comms(
        edge, from_partition_spec(src, 3), from_partition_spec(dst, 2)))
    assert predicted == compiled == [(ALL_TO_ALL, ("data", "model"), 8 * 16 * dim * 4 / 8)]


def test_a_scatter_that_overwrites_rows_of_a_table_split_along_them_moves_the_updates():
    """``table.at[ids].set(rows)`` into a table split along its embedding dimension, from rows
    split over the batch: each device writes its own columns from the rows moved to the same
    split (an all-to-all), as XLA's operand-passthrough scatter does; the table is not gathered."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from shardplan.compiler.cost import from_partition_spec
    from shardplan.compiler.hlo import collectives
    from shardplan.compiler.pricing import Pricer
    from shardplan.devices.mesh import make_jax_mesh
    from shardplan.sharding.rules import apply_rule
    from shardplan.tracing.walk import build_graph
    mesh = make_jax_mesh(("data", "model"), (2, 4))
    vocab, dim = 512, 64

    def write(table, ids, rows):
        return table.at[ids].set(rows)
    args = (jax.ShapeDtypeStruct((vocab, dim), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.int32),
            jax.ShapeDtypeStruct((8, 16, dim), jnp.float32))
    src, dst = P(("data", "model")), P(None, ("data", "model"))
    f = jax.jit(write, in_shardings=(NamedSharding(mesh, dst), NamedSharding(mesh, src), NamedSharding(mesh, src)),
                out_shardings=NamedSharding(mesh, dst))
    compiled = sorted((c.kind, c.axes, c.nbytes) for c in collectives(f.lower(*args).compile().as_text(), mesh)
                      if c.nbytes > 8 * 16 * 4)       # the ids' all-gather is priced on their own edge
    g = build_graph(jax.make_jaxpr(write)(*args), ["table", "ids", "rows"], apply_rule)
    pricer = Pricer(g, M)
    [edge] = [e for e in g.edges if e.primitive == "scatter" and g.tensors[e.src].shape == (8, 16, dim)]
    predicted = sorted((c.kind, c.axes, c.nbytes) for c, _ in pricer.edge_comms(
        edge, from_partition_spec(src, 3), from_partition_spec(dst, 2)))
    assert predicted == compiled == [(ALL_TO_ALL, ("data", "model"), 8 * 16 * dim * 4 / 8)]
    from shardplan.compiler import targets
    if targets.available("gpu"):       # the GPU compiler, deviceless, partitions it the same way
        import shardplan
        gpu, _ = targets.target_mesh(shardplan.load_mesh("h100-8", axes={"data": 2, "model": 4}), "gpu")
        f = jax.jit(write, in_shardings=(NamedSharding(gpu, dst), NamedSharding(gpu, src), NamedSharding(gpu, src)),
                    out_shardings=NamedSharding(gpu, dst))
        assert sorted((c.kind, c.axes, c.nbytes) for c in collectives(f.lower(*args).compile().as_text(), gpu)
                      if c.nbytes > 8 * 16 * 4) == compiled


def test_top_k_reads_its_whole_operand_except_on_a_tpu():
    """XLA's CPU and GPU compilers run top_k as a custom call on the whole operand (all-gathered
    first, whatever the result's sharding: checked on both, the GPU deviceless); the TPU compiler
    splits it along its other dimensions. A router's [tokens, experts] logits split over the
    tokens: gathered on a GPU, not on a TPU."""
    import jax
    import jax.numpy as jnp

    from shardplan.sharding.rules import apply_rule
    from shardplan.tracing.walk import build_graph
    jaxpr = jax.make_jaxpr(lambda x: jax.lax.top_k(x, 2))(jax.ShapeDtypeStruct((128, 8), jnp.float32))
    split = (("data",), ())
    for device, need in (("NVIDIA H100 80GB HBM3", ((), ())), ("cpu", ((), ())), ("TPU v5e", split)):
        g = build_graph(jaxpr, ["x"], apply_rule, device=device)
        edges = [e for e in g.edges if e.primitive == "top_k"]
        assert len(edges) == 2 and all(e.required(split) == need for e in edges), device
