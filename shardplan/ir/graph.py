"""The train step as a graph: every tensor, how their dimensions must agree, and the ops between them.

Built by :func:`shardplan.tracing.walk.build_graph` from the step's jaxpr, read-only afterwards:

* tensors, each with shape, dtype, a name (input path or Flax name stack), a path (where it is
  in the step, :func:`shardplan.tracing.walk.eqn_path`) and a trip-count multiplier;
* *groups*: tensors joined by same-shape elementwise ops, which share one sharding (their
  dimensions fall into *dimension classes*, so a group's sharding maps mesh axes to classes);
* edges between groups for every other op, priced by the op's rule (:mod:`shardplan.sharding.rules`),
  and ``dot_general`` ops, which choose their own strategy;
* memory checkpoints: the sets of tensors live at the fullest points of the schedule
  (:mod:`shardplan.compiler.liveness`).

A scan over layers is walked once: its body's tensors carry the trip count as multiplier.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

Spec = tuple[tuple[str, ...], ...]


@dataclasses.dataclass
class Tensor:
    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    name: str
    role: str           # "input", "output" or "activation"
    source: str         # "file:line (function)" of the op that made it, or the input path
    mult: float         # how many times it is produced per step (trip counts of enclosing scans)
    path: str = ""      # where it is in the step: see :func:`eqn_path`
    host: bool = False  # held in the host's memory (a residual offloaded by a jax.checkpoint policy)

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclasses.dataclass(frozen=True)
class PairEdge:
    """An op seen as a relation between two tensors.

    Exactly one of ``required`` / ``produced`` is set: ``required(dst_spec)`` gives the spec the op
    needs of ``src`` to make ``dst`` locally; ``produced(src_spec)`` gives the spec of the result the
    op makes from ``src`` and the mesh axes over which that result is still a partial sum.
    """

    src: int
    dst: int
    primitive: str
    mult: float
    required: Callable[[Spec], Spec] | None = None
    produced: Callable[[Spec], tuple[Spec, tuple[str, ...]]] | None = None
    # With ``required``: the spec of ``dst`` the op makes when ``src`` stays as it is (``None``
    # where it cannot); XLA then reshards the result instead of the operand when that is cheaper.
    # With ``produced`` (a scatter-add): the spec ``src`` (the updates) is resharded to for a
    # ``dst`` spec under XLA's operand-passthrough scatter (``None`` where it does not apply).
    passthrough: Callable[[Spec, Spec], Spec | None] | None = None
    # With ``required``: another computation of the op (a :mod:`shardplan.tracing.rewrites` strategy)
    # that runs on ``src`` as it is: ``(kind, spec of dst it makes, mesh axes it is partial
    # over)`` for a (src spec, dst spec) pair, ``None`` where it does not apply.
    rewrite: Callable[[Spec, Spec], tuple[str, Spec, tuple[str, ...]] | None] | None = None
    # ``required`` takes the mesh's axis sizes too: ``required(dst_spec, sizes)`` (a reshape, whose
    # operand's split depends on which of its dims each mesh axis's factor fits in).
    sized: bool = False

    def need(self, dst_spec: Spec, sizes: Mapping[str, int]) -> Spec:
        """The spec the op needs of ``src`` to make ``dst`` at ``dst_spec`` locally, on a mesh of
        these axis sizes (``required`` with them where it takes them)."""
        return self.required(dst_spec, sizes) if self.sized else self.required(dst_spec)


@dataclasses.dataclass(frozen=True)
class DotOp:
    """A ``dot_general`` or convolution: dims are (lhs dim, rhs dim, out dim) with None where absent.

    ``fixed`` holds the indices of dims that are never sharded (a convolution's spatial and
    window dims, grouped features); ``sizes`` the iteration extent of each dim where it is not
    the operand's dim size (a convolution's output positions, a grouped feature dim).
    """

    lhs: int
    rhs: int
    out: int
    dims: tuple[tuple[int | None, int | None, int | None], ...]
    mult: float
    source: str
    fixed: frozenset[int] = frozenset()
    sizes: tuple[int, ...] | None = None
    # float32 operands at DEFAULT precision: a TPU multiplies them in one bfloat16 pass and
    # libtpu rounds them to bfloat16 before it moves them (shardplan.sharding.strategies.moved_itemsize).
    bf16_pass: bool = False


@dataclasses.dataclass(frozen=True)
class ManualRegion:
    """A ``shard_map`` in the step (:mod:`shardplan.tracing.manual`): its mesh axes and sizes, its body
    (per-device shapes), how many times it runs a step, the first of its results, where it is,
    the tensors behind its operands and results."""

    mesh: tuple[tuple[str, int], ...]
    body: object
    mult: float
    out: int | None
    source: str
    operands: tuple[int | None, ...] = ()
    results: tuple[int | None, ...] = ()
    temp_bytes: float = 0.0        # the body's own temporaries per device (shardplan.tracing.manual.body_peak)


class _UnionFind:
    def __init__(self):
        self.parent: list[int] = []

    def add(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, x: int) -> int:
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


class Graph:
    """Build with :func:`shardplan.tracing.walk.build_graph`; read-only afterwards."""

    def __init__(self):
        self.tensors: list[Tensor] = []
        self.edges: list[PairEdge] = []
        # Reductions of a tensor to a scalar (a loss): their all-reduce depends on the tensor's
        # spec alone (a scalar has no other); the plan's collectives count it (not the ILP).
        self.to_scalar: list[PairEdge] = []
        self.dots: list[DotOp] = []
        self.manual: list[ManualRegion] = []     # shard_map regions (shardplan.tracing.manual)
        self.inputs: list[int] = []
        self.outputs: list[int | None] = []
        self.points: list[list[int]] = []
        self.running: list[set[int]] = []        # per point: the results of the ops running there
        # per point: matmul results whose split-K partial sums wait there for their reader
        # (shardplan.compiler.liveness.summing_kernels)
        self.held: list[set[int]] = []
        # per point: matmul results whose partial sums wait there for the reductions of one
        # combined collective (shardplan.compiler.liveness.combined_matmuls)
        self.combining: list[set[int]] = []
        self.host_points: list[list[int]] = []    # the fullest live sets of host memory (host offload)
        self.point_index: list[int] = []          # per point: its index in the top level's schedule
        self.scheduled: dict[int, int] = {}       # a top-level result -> the index of the op making it
        # reduction result -> how many reductions XLA's combiners merge with it
        # (shardplan.compiler.combine.combined_reductions)
        self.combined: dict[int, int] = {}
        self.eqn_inputs: dict[tuple[str, int], int] = {}    # (eqn path, operand index) -> tensor
        self._paths: set[str] = set()                       # every tensor's path, each once
        self.prefix = ""           # the path of the jaxpr being walked (see eqn_path)
        self.stacked: dict[int, int] = {}   # body tensors a scan stacks into an output -> its length
        self.loop_of: list[int] = []     # tensor -> the scan body (walk) it lives in; 0 at top level
        self.readers: dict[int, list[tuple[str, list[int]]]] = {}   # tensor -> (primitive, its outputs)
        self.level_outputs: set[int] = set()   # results of a jaxpr (the step's, a loop body's, a branch's)
        self.fused: set[int] = set()        # results XLA computes inside their readers' kernels (never stored)
        self.zeros: set[int] = set()        # broadcasts of a literal zero (jnp.zeros)
        # the step's ops with a tuple result (loops, multi-output kernels: liveness.multi_output_kernels)
        self.tuple_results = 0
        self.made_by: dict[int, tuple[str, list[int]]] = {}   # a result -> (the primitive that made it, its inputs)
        self.stacked_into: dict[int, int] = {}          # a stacked body tensor -> the scan's result
        self.scanned_into: dict[int, list[int | None]] = {}   # a scan's operand -> body inputs (None: const, carry)
        self._slices: dict[int, int] | None = None   # stacked_input's map, made once the graph is built
        # Inputs of a differentiated jax.checkpoint with prevent_cse: JAX lowers them behind an
        # optimization barrier, where XLA needs each in a buffer of its own (traffic.copied_slices).
        self.barriered: set[int] = set()
        self.shifts: set[int] = set()       # rolled by one along dimension 0 (tracing.walk.SHIFT_CALL)
        self.transfers: set[int] = set()    # results of a copy between device and host memory (host offload)
        # Copies to host memory outside any loop: the GPU and TPU compilers fetch them back early,
        # so they stay in device memory too.
        self.fetched_early: set[int] = set()
        self.compiler = "cpu"      # the kind of XLA compiler the mesh's programs go through: cpu, gpu, tpu
        self.donated_outputs: frozenset[int] = frozenset()   # outputs written into donated input buffers
        self.current_loop = 0
        # tensor -> the differentiated jax.checkpoint (prevent_cse) it is made in; 0 outside any.
        # XLA's partitioner reshards a value once per computation, but a checkpoint's inputs reach
        # its body through an optimization barrier: a reshard there is of another value.
        self.region_of: list[int] = []
        self.current_region = 0
        self._regions = 0
        self.call_source = ""      # where the call being walked inline was made (see source_of)
        self._loops = 0
        self.warnings: list[str] = []
        self.device = ""           # the mesh's device name (shardplan.tracing.walk.build_graph)
        self._groups = _UnionFind()
        self._dims = _UnionFind()
        self._dim_offset: list[int] = []
        self._pinned: set[int] = set()      # dimension keys that must stay unsharded
        self._required: dict[int, tuple[tuple[str, ...], str]] = {}   # dimension key -> (mesh axes, source)
        self._warned: set[str] = set()

    # -- construction --------------------------------------------------------------------------
    def new_tensor(self, aval, name: str, role: str, source: str, mult: float, path: str) -> int:
        tid = len(self.tensors)
        shape = tuple(int(s) for s in getattr(aval, "shape", ()))
        dtype, is_key = storage_dtype(getattr(aval, "dtype", np.float32))
        if path in self._paths:
            raise AssertionError(f"two tensors at path {path}")
        self._paths.add(path)
        host = str(getattr(aval, "memory_space", "")).endswith("Host")
        self.tensors.append(Tensor(tid, shape, dtype, name, role, source, mult, path, host))
        self.loop_of.append(self.current_loop)
        self.region_of.append(self.current_region)
        self._groups.add()
        self._dim_offset.append(len(self._dims.parent))
        for _ in shape:
            self._dims.add()
        if is_key:      # random keys stay replicated: each device draws the bits of its own shard
            for d in range(len(shape)):
                self.pin(tid, d)
        return tid

    def dim_key(self, tid: int, dim: int) -> int:
        return self._dim_offset[tid] + dim

    def union(self, a: int | None, b: int | None, dim_map: Sequence[tuple[int, int]] | None = None) -> None:
        """Make ``a`` and ``b`` share a sharding; ``dim_map`` pairs their dims (default: identical shapes)."""
        if a is None or b is None or a == b:
            return
        ta, tb = self.tensors[a], self.tensors[b]
        if ta.rank == 0 or tb.rank == 0:
            return
        if dim_map is None:
            dim_map = [(d, d) for d in range(ta.rank)]
        self._groups.union(a, b)
        for da, db in dim_map:
            self._dims.union(self.dim_key(a, da), self.dim_key(b, db))

    def pin(self, tid: int, dim: int) -> None:
        """Dimension ``dim`` of ``tid`` is never sharded (a scan's layer axis)."""
        self._pinned.add(self.dim_key(tid, dim))

    def require(self, tid: int, dim: int, axes: tuple[str, ...], source: str) -> None:
        """Dimension ``dim`` of ``tid`` is sharded over exactly ``axes`` (``()``: not at all), as
        a ``with_sharding_constraint`` at ``source`` says."""
        self._required.setdefault(self.dim_key(tid, dim), (tuple(axes), source))

    def add_edge(self, edge: PairEdge) -> None:
        if self.tensors[edge.src].rank and self.tensors[edge.dst].rank:
            self.edges.append(edge)
        elif self.tensors[edge.src].rank and edge.produced is not None:
            self.to_scalar.append(edge)

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.warnings.append(message)
            if jax.process_index() == 0:       # under jax.distributed, said once, by process 0
                warnings.warn(message, stacklevel=3)

    @property
    def host_apart(self) -> bool:
        """Whether host memory is apart from the device's (GPU, TPU): host tensors then take no
        device memory. XLA's CPU compiler keeps them with the rest."""
        return self.compiler != "cpu"

    # -- queries -------------------------------------------------------------------------------
    def group_of(self, tid: int) -> int:
        return self._groups.find(tid)

    def stacked_input(self, tid: int) -> int | None:
        """The step input a loop body's ``tid`` is a per-trip slice of (a scanned layer's weight)."""
        if self._slices is None:
            inputs = set(self.inputs)
            self._slices = {b: t for t, bodies in self.scanned_into.items() if t in inputs
                            for b in bodies if b is not None}
        return self._slices.get(tid)

    def dim_class(self, tid: int, dim: int) -> int:
        return self._dims.find(self.dim_key(tid, dim))

    def pinned_classes(self) -> set[int]:
        return {self._dims.find(k) for k in self._pinned}

    def required_classes(self) -> dict[int, tuple[str, ...]]:
        """Dimension class -> the mesh axes a sharding constraint gives it. Where constraints
        that cannot both hold meet in one class (two specs for tensors that share a sharding),
        the first constraint holds and a warning names the other."""
        out: dict[int, tuple[tuple[str, ...], str]] = {}
        for key, (axes, source) in sorted(self._required.items()):
            c = self._dims.find(key)
            if c in out and out[c][0] != axes:
                kept, where = out[c]
                self.warn_once(f"constraint {source}", f"shardplan: the sharding constraint at {source} "
                               f"({axes or 'unsharded'}) contradicts the one at {where} ({kept or 'unsharded'}) "
                               "on tensors that share a sharding; the first one is kept")
                continue
            out.setdefault(c, (axes, source))
        return {c: axes for c, (axes, _) in out.items()}

    def groups(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for t in self.tensors:
            out.setdefault(self.group_of(t.id), []).append(t.id)
        return out



def storage_dtype(dtype) -> tuple[np.dtype, bool]:
    """The numpy dtype a tensor is stored as, and whether it is a typed random key.

    A typed key (``jax.random.key``: ``key<fry>``) is stored as its implementation's words
    (two uint32 for threefry): an opaque record of that size.
    """
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return np.dtype((np.void, dtype.itemsize)), True
    return np.dtype(dtype), False


# Library frames skipped when naming where an op comes from: the user's line is the useful one.
