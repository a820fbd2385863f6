import pytest

from shardplan.cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, Comm, CostModel
from shardplan.mesh import load_mesh
from shardplan.sizes import parse_bytes

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


def test_dropping_a_major_axis_gathers_the_minor_one_too():
    shape = (16, 8)
    # ('data', 'model') -> ('data',): the minor axis leaves cleanly
    [c] = M.reshard(shape, 4, (("data", "model"), ()), (("data",), ()))
    assert (c.kind, c.axes) == (ALL_GATHER, ("model",))
    # ('data', 'model') -> ('model',): blocks reorder, so both are gathered (then sliced by model)
    [c] = M.reshard(shape, 4, (("data", "model"), ()), (("model",), ()))
    assert (c.kind, c.axes, c.nbytes) == (ALL_GATHER, ("data", "model"), 16 * 8 * 4)
