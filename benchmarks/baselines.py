"""Hand-written sharding plans for the reference models, as an expert would write them.

Each returns PartitionSpecs for the train state (params and AdamW state share a spec) and the
batch, on a mesh with axes ``data`` and ``model``:

- ``dp``: pure data parallel: everything replicated, the batch split over every mesh axis (and
  each layer's residual stream with it: :func:`activation_rules`).
- ``fsdp``: ZeRO-3: every parameter and its optimizer state split over every mesh axis along
  its largest evenly divisible dimension; the batch split over every mesh axis (and each
  layer's residual stream with it).
- ``megatron``: Megatron-LM tensor parallel over ``model`` (column-parallel qkv/fc/gate/up,
  row-parallel proj/out/down, vocab-parallel embedding and head), data parallel over ``data``,
  with Megatron's sequence parallelism inside the ``model`` group: the residual stream (the
  norm and residual regions) is split along the sequence over ``model``
  (:func:`activation_rules`, applied through ``shardplan.models.layers.constrain``), so XLA all-gathers
  before the column-parallel matmuls and reduce-scatters after the row-parallel ones.
- ``megatron-tp``: the same weights without the sequence-parallel constraints (activations left
  to XLA's propagation). It needs more activation memory and, compiled by XLA, is sometimes the
  faster of the two; both are kept so that neither flatters the planner.
- ``maxtext``: MaxText's default logical-axis rules with ``data`` as its ``fsdp`` axis and
  ``model`` as its ``tensor`` axis: weights' ``embed`` dimension over ``data`` (FSDP),
  ``mlp``/``heads``/``vocab`` dimensions over ``model`` (tensor parallel), the batch over
  ``data`` (and each layer's residual stream's batch: MaxText's ``activation_batch``); norms
  replicated.
- ``ep`` (mixture-of-experts models, meshes with an ``expert`` axis): MaxText's expert
  parallelism: each MoE layer's stacked expert weights split along the expert dimension over
  ``expert`` and along ``embed`` over ``data`` (FSDP), every other weight FSDP over ``data``
  and ``expert`` together (its largest dimension that divides), the batch over both, and the
  tokens in expert slots over ``data`` with the experts over ``expert`` (:func:`activation_rules`:
  the move between the two is XLA's all-to-all).
- ``cp-allgather``, ``cp-ulysses``, ``cp-ring`` (models written with ``shardplan.attention``,
  meshes with a ``seq`` axis): MaxText's context parallelism (``context_parallel_strategy``
  all_gather, ulysses and ring, causal load balance for the ring): the sequence of the batch and
  of every activation over ``seq``, the batch over ``data``, attention run by that strategy
  (:mod:`shardplan.parallel.context`), every parameter and its optimizer state FSDP over both axes.
- ``megatron-3d`` (:func:`megatron_3d`): Megatron-LM's 3D parallelism: tensor parallel over
  ``model`` (inside a node, the ``megatron-tp`` weights), pipeline stages split off ``data``
  (across nodes: a ``stage`` axis, each stage holding its contiguous block of layers), data
  parallel over the rest, run as shardplan's SPMD pipeline (:mod:`shardplan.parallel.pipeline`) with
  microbatches of one sequence per data-parallel rank as in the Megatron paper, and Megatron's
  sequence parallelism (each layer's residual stream split over the sequence on ``model``). Its interleaved
  schedule is the circular one with 2 rounds where the layers split that way; each data rank
  keeps its copy of its stage's weights and their gradients are summed once a step
  (``replicas``). The harness tries each stage count that divides the nodes and the layers and
  keeps the fastest that fits (where none fits, the leanest, with what each needed).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

COLUMN = ("qkv", "fc", "wq", "wk", "wv", "w_gate", "w_up", "Dense_0", "head")
ROW = ("proj", "out", "wo", "w_down", "Dense_1")
BASELINES = ("dp", "fsdp", "megatron", "megatron-tp", "maxtext")
MOE_BASELINES = ("ep",)           # for mixture-of-experts models on meshes with an ``expert`` axis
CP_BASELINES = ("cp-allgather", "cp-ulysses", "cp-ring")     # for shardplan.attention models, a ``seq`` axis
EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo")      # shardplan.models.moe's stacked experts, under ``moe``


def _keys(path) -> list[str]:
    """Path keys as strings, without NNX's trailing ``.value``."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return out[:-1] if out and out[-1] == "value" else out


def _param_spec(kind: str, keys: list[str], shape: tuple[int, ...], axes: dict[str, int], stacked: bool) -> P:
    rank = len(shape)
    if rank == 0 or kind == "dp":
        return P()
    lead = 1 if stacked and "layers" in keys else 0
    all_axes = tuple(a for a, n in axes.items() if n > 1)
    if kind == "fsdp" or kind in CP_BASELINES:
        n = math.prod(axes[a] for a in all_axes)
        dims = sorted(range(lead, rank), key=lambda d: -shape[d])
        for d in dims:
            if shape[d] % n == 0 and n > 1:
                return P(*([None] * d + [all_axes if len(all_axes) > 1 else all_axes[0]]))
        return P()
    m = axes.get("model", 1)
    leaf = keys[-1]
    if kind == "ep":
        return _ep_spec(keys, shape, axes, lead)
    if kind == "maxtext":
        return _maxtext_spec(keys, shape, axes, lead)
    layer = next((k for k in reversed(keys[:-1]) if not k.isdigit()), "")

    def on(d):
        return P(*([None] * d + ["model"])) if shape[d] % m == 0 and m > 1 else P()
    if leaf == "embedding":
        return on(0)                                     # vocab-parallel embedding
    if layer in COLUMN:
        return on(rank - 1)      # kernel [in, out] and bias [out]: split out (the head: vocab-parallel)
    if layer in ROW and leaf == "kernel":
        return on(lead)                                  # kernel [in, out]: split in
    return P()


def _ep_spec(keys: list[str], shape: tuple[int, ...], axes: dict[str, int], lead: int) -> P:
    """MaxText's expert parallelism: experts over ``expert``, ``embed`` over ``data`` (FSDP);
    other weights FSDP over ``data`` and ``expert`` along their largest dimension that divides."""
    def fits(d, names):
        n = math.prod(axes.get(a, 1) for a in names)
        return n > 1 and shape[d] % n == 0
    entries: list = [None] * len(shape)
    if "moe" in keys and keys[-1] in EXPERT_WEIGHTS and len(shape) - lead == 3:
        e, embed = lead, (lead + 1 if keys[-1] != "wo" else lead + 2)      # [E, d, f] or [E, f, d]
        entries[e] = "expert" if fits(e, ("expert",)) else None
        entries[embed] = "data" if fits(embed, ("data",)) else None
        return P(*entries)
    both = tuple(a for a in ("data", "expert") if axes.get(a, 1) > 1)
    for d in sorted(range(lead, len(shape)), key=lambda d: -shape[d]):
        if both and fits(d, both):
            entries[d] = both if len(both) > 1 else both[0]
            return P(*entries)
    return P()


def _maxtext_spec(keys: list[str], shape: tuple[int, ...], axes: dict[str, int], lead: int) -> P:
    """MaxText's default rules: embed -> fsdp ('data'), mlp/heads/vocab -> tensor ('model')."""
    leaf = keys[-1]
    layer = next((k for k in reversed(keys[:-1]) if not k.isdigit()), "")
    if leaf == "embedding":
        logical = ("tensor", "fsdp")                     # (vocab, embed)
    elif leaf in ("wpe",):
        logical = (None, "fsdp")                         # (seq, embed)
    elif layer in COLUMN and leaf == "kernel":
        logical = ("fsdp", "tensor")                     # (embed, mlp|heads|vocab)
    elif layer in ROW and leaf == "kernel":
        logical = ("tensor", "fsdp")                     # (mlp|heads, embed)
    elif layer in COLUMN and leaf == "bias":
        logical = ("tensor",)
    else:
        logical = (None,) * (len(shape) - lead)          # norms, row biases: replicated
    mesh_axis = {"fsdp": "data", "tensor": "model"}
    entries = [None] * lead
    for d, name in enumerate(logical, start=lead):
        a = mesh_axis.get(name)
        entries.append(a if a and axes.get(a, 1) > 1 and shape[d] % axes[a] == 0 else None)
    return P(*entries)


def activation_rules(kind: str, axes: dict[str, int]) -> dict[str, str | None] | None:
    """Logical activation name -> mesh axes for baseline ``kind`` (``None``: replicated; a name
    the rules do not mention is left to XLA); ``None`` where the baseline pins no activation."""
    if kind == "ep":
        # MaxText's expert parallelism: tokens over every axis (as the batch, :func:`hand_plan`),
        # in expert slots over data with the experts over ``expert`` (the dispatch between the
        # two is XLA's all-to-all).
        rows = tuple(a for a, n in axes.items() if n > 1)
        return {"batch": rows or None, "exp_batch": "data" if axes.get("data", 1) > 1 else None,
                "exp": "expert" if axes.get("expert", 1) > 1 else None}
    if kind in CP_BASELINES:
        return {"batch": "data" if axes.get("data", 1) > 1 else None, "seq": "seq", "embed": None}
    if kind in ("dp", "fsdp"):
        # The residual stream split as the batch is (every axis), as one writes data parallelism
        # and FSDP. Left to XLA's propagation, the weights' layout spreads into the activations:
        # GPT-3 175B's FSDP step on 1024 GPUs gathered each layer's whole activation, 48 GiB,
        # eight times a layer (52 TiB a step; 975 GiB with this rule).
        rows = tuple(a for a, n in axes.items() if n > 1)
        return {"batch": rows or None}
    if kind == "maxtext":
        return {"batch": "data" if axes.get("data", 1) > 1 else None}     # MaxText's activation_batch
    if kind != "megatron":
        return None
    return {"batch": "data" if axes.get("data", 1) > 1 else None,
            "seq": "model" if axes.get("model", 1) > 1 else None, "embed": None}


def context_config(kind: str):
    """The :class:`shardplan.ContextConfig` a context-parallel baseline traces its attention in
    (``None`` for the others)."""
    if kind not in CP_BASELINES:
        return None
    from shardplan.parallel.sequence import ContextConfig
    strategy = kind.removeprefix("cp-")
    return ContextConfig(strategy, seq_axes=("seq",), batch_axes=("data",),
                         load_balance="zigzag" if strategy == "ring" else None)


def hand_plan(kind: str, abstract_state, batch, axes: dict[str, int], stacked: bool):
    """(state specs, batch specs) pytrees for baseline ``kind``."""
    if kind not in BASELINES + MOE_BASELINES + CP_BASELINES:
        raise ValueError(f"unknown baseline {kind!r}; choose one of {BASELINES + MOE_BASELINES + CP_BASELINES}")

    def state_leaf(path, x):
        return _param_spec(kind, _keys(path), tuple(x.shape), axes, stacked)
    state_specs = jax.tree_util.tree_map_with_path(state_leaf, abstract_state)
    all_axes = tuple(a for a, n in axes.items() if n > 1)
    batch_axes = ("data",) if kind in ("megatron", "megatron-tp", "maxtext") else all_axes
    batch_axes = tuple(a for a in batch_axes if axes.get(a, 1) > 1)
    spec = P(batch_axes if len(batch_axes) > 1 else (batch_axes[0] if batch_axes else None))
    if kind in CP_BASELINES:         # [batch, seq] tokens: rows over data, the sequence over seq
        return state_specs, jax.tree.map(lambda x: P("data", "seq") if len(x.shape) >= 2 else P("data"), batch)
    return state_specs, jax.tree.map(lambda _: spec, batch)


def megatron_3d(abstract_state, batch, axes: dict[str, int], stages: int):
    """(state specs, batch specs) for Megatron 3D on ``{"stage": stages, **axes}`` (``axes``:
    ``data`` already divided by ``stages``): the ``megatron-tp`` weights with each stacked
    layer parameter's layer dimension over ``stage``."""
    state_specs, batch_specs = hand_plan("megatron-tp", abstract_state, batch, axes, stacked=True)

    def staged(path, spec, x):
        if "layers" in _keys(path) and len(x.shape) >= 1 and x.shape[0] % stages == 0:
            return P("stage", *tuple(spec)[1:]) if len(spec) else P("stage")
        return spec
    state_specs = jax.tree_util.tree_map_with_path(staged, state_specs, abstract_state,
                                                   is_leaf=lambda v: isinstance(v, P))
    return state_specs, batch_specs
