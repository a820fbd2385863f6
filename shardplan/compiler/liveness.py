"""XLA's memory and fusion model: which tensors are stored, and when each is live.

While :mod:`shardplan.tracing.walk` walks a jaxpr it records, per level (the step, each loop body),
which tensors every equation defines and when each is last read. :func:`fuse` then drops the
results XLA fuses into their readers (never stored) and lets a result take over a dying
operand's buffer; :func:`checkpoints` picks the fullest points of the schedule, the memory
checkpoints the ILP holds under the budget.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from shardplan.compiler import splitk


@dataclasses.dataclass
class Level:
    """Liveness bookkeeping of one jaxpr being walked."""

    defined: list[list[int]] = dataclasses.field(default_factory=list)   # per eqn, tensors it defines
    last_use: dict[int, int] = dataclasses.field(default_factory=dict)   # tensor -> last eqn index using it
    inner_peak: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # eqn index -> body's peak set
    inner_host: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # the same in host memory
    # eqn index -> the results of the ops running at the body's peak (a dot's split-K partial sums
    # live while it runs)
    inner_running: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # eqn index -> the matmul results held at the body's peak (:func:`summing_kernels`)
    inner_held: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # eqn index -> the matmul results whose partial sums wait at the body's peak for a combined
    # collective (:func:`combined_matmuls`)
    inner_combining: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # eqn index -> a body's other points the level's checkpoints weigh: ``(live, running, held,
    # combining)`` where a combined collective's partial sums wait (:func:`combining_point`)
    inner_alts: dict[int, list[tuple]] = dataclasses.field(default_factory=dict)
    made_by: dict[int, tuple[str, list[int]]] = dataclasses.field(default_factory=dict)  # tensor -> (primitive, inputs)
    # (carry's initial value, loop's result, loop's eqn index): the result took over the buffer
    # (walk's loop rule); where nothing reads the result, the buffer lives through the loop still
    takeovers: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    # what an op computes -> its first results; a recomputed result -> its first (walk._recomputed)
    computed: dict[tuple, list[int]] = dataclasses.field(default_factory=dict)
    twin: dict[int, int] = dataclasses.field(default_factory=dict)


# Primitives XLA fuses into a loop fusion with their producers: the producer's result is computed
# inside the consumer's kernel and never stored, if every reader is one of these.
FUSIBLE = frozenset("""
abs add add_any and atan2 broadcast_in_dim cbrt ceil clamp convert_element_type copy cos div eq erf erf_inv erfc exp
exp2 expand_dims expm1 floor ge gt integer_pow iota is_finite le log log1p logistic lt max min mul ne neg
nextafter not or pow reduce_and reduce_max reduce_min reduce_or reduce_prod reduce_sum rem reshape
reduce_precision round rsqrt select_n sign sin sqrt square squeeze stop_gradient sub tan tanh transpose xor
""".split())
# Ops whose result XLA writes into their first operand's buffer when the operand dies there.
IN_PLACE = frozenset({"scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul", "scatter-min",
                       "scatter-max", "dynamic_update_slice"})
# Results XLA would rather store than recompute in each of several readers (its "expensive" ops).
EXPENSIVE = frozenset("""
cos div erf erf_inv exp exp2 expm1 integer_pow log log1p logistic pow rem rsqrt sin sqrt tan tanh
""".split())
# Of those, the ones XLA's GPU fusion counts cheap in float32 and float16 (one hardware
# instruction each: GpuPriorityFusion::IsExpensive), so it computes them again in each reader.
GPU_CHEAP = frozenset(("div", "exp", "rsqrt", "sqrt"))
DOTS = frozenset(("dot_general", "conv_general_dilated"))
# Readers that take a fusible producer into their own kernel besides the fusible ops: a gather
# computes only the elements it picks (XLA's loop fusion: a cross entropy's label logit gathered
# from float32 logits converted in the gather's kernel, never stored; tests/compiler/test_liveness.py).
# Not on a TPU (:func:`fuse`).
GATHERS = frozenset(("gather", "dynamic_slice"))
REDUCTIONS = frozenset(("reduce_and", "reduce_max", "reduce_min", "reduce_or", "reduce_prod", "reduce_sum"))


def fuse(g, level: Level, kept: set) -> None:
    """Drop from the liveness schedule the results XLA fuses into their readers.

    A result of an elementwise op (or broadcast, reshape, convert ...) whose readers are all
    fusible is computed inside each reader's kernel and never stored; its inputs live instead
    until its last reader. An expensive result read more than once is stored (XLA does not
    duplicate it). Later results first, so a fused chain hands liveness back to its start.
    """
    fused, prologue = set(), set()
    tpu = g.compiler == "tpu"
    if tpu:
        _output_fused_matmuls(g, level, kept, fused)
    elif g.compiler == "gpu":
        _late_matmuls(g, level, kept)
    scattered = _scatters_into_addend(g, level, kept, fused)
    if tpu:
        # libtpu computes the scatter as a compare-select inside the add's own kernel: the add
        # is an elementwise op like any other there.
        scattered = set()
    where = {t: i for i, ts in enumerate(level.defined) for t in ts}
    for i in range(len(level.defined) - 1, -1, -1):
        for t in level.defined[i]:
            made = level.made_by.get(t)
            if made is not None and t in fused:
                # fused by a rule above: its inputs live until its last reader
                _read_until(level, made[1], level.last_use.get(t, i))
                continue
            if made is None or t in kept or t in scattered or made[0] not in FUSIBLE or made[0] in REDUCTIONS:
                continue
            readers = g.readers.get(t, [])
            # XLA folds a transpose into the dots that read it (its TransposeFolding pass); its
            # GPU compiler converts a matmul's operand inside the matmul's kernel (a Triton GEMM
            # fusion), which reads the unconverted tensor: that one is stored. Not a narrowing
            # convert (float32 to bfloat16: "Narrowing conversion", XLA's
            # IsConversionWorthFusing): that one is stored converted, by its producer's kernel.
            # libtpu computes any elementwise chain into a matmul operand inside the matmul's
            # kernel (its convolution fusion takes the operand's producers), converts both ways
            # and expensive ops too (tests/compiler/test_liveness.py, the compiled programs).
            into_dots = tpu or made[0] == "transpose" or (made[0] == "convert_element_type" and g.compiler == "gpu"
                                                          and not _narrowing(g, t, made[1]))
            fold = (FUSIBLE | DOTS) if tpu else (FUSIBLE | GATHERS | DOTS) if into_dots else FUSIBLE | GATHERS
            # A kernel holding a matmul (a TPU's output fusion) is never computed twice, nor
            # inside another matmul's kernel: its result is stored.
            holds = tpu and (len(readers) > 1 or any(p in DOTS for p, _ in readers)) \
                and _holds_matmul(level, fused, made[1])
            gathers = [o for p, outs in readers if p in GATHERS for o in outs]
            if tpu and gathers and not holds and all(p in fold or p in GATHERS for p, _ in readers):
                # libtpu's gather is a kernel of its own that reads a stored operand: the result
                # is stored for the gathers alone, and computed again in its other readers
                # (a cross entropy's float32 logits live from the head's matmul to the label
                # gather; the backward matmuls convert the bfloat16 logits in their kernels).
                end = level.last_use.get(t, i)
                _read_until(level, made[1], end)
                level.last_use[t] = max(where.get(o, end) for o in gathers)
                continue
            if not readers or any(p not in fold for p, _ in readers) or holds:
                continue
            if len(readers) > 1 and _expensive(g, t, made[0]):
                continue
            if any(o in prologue for _, outs in readers for o in outs):
                continue
            fused.add(t)
            if into_dots and not tpu and made[0] == "convert_element_type" and any(p in DOTS for p, _ in readers):
                prologue.add(t)
            _read_until(level, made[1], level.last_use.get(t, i))
    if fused:
        level.defined = [[t for t in ts if t not in fused] for ts in level.defined]
        g.fused |= fused
    # A stored elementwise result takes over the buffer of a same-size operand that dies in
    # its kernel (XLA shares an elementwise fusion's output with such an operand). Not on a GPU
    # where the kernel also reads a row reduction of that operand: XLA's GPU compiler computes
    # such a diamond (a softmax or its gradient) in one Triton kernel, which shares no buffer
    # (test_sequence's attention: the scores' float32 gradient beside the float32 scores).
    for i, ts in enumerate(level.defined):
        for t in ts:
            made = level.made_by.get(t)
            if made is None or made[0] not in FUSIBLE or made[0] in REDUCTIONS:
                continue
            reads = _kernel_reads(level, fused, made[1])
            diamond = set()
            if g.compiler == "gpu":
                for r in reads:
                    if level.made_by.get(r, ("",))[0] in REDUCTIONS:
                        diamond.update(_kernel_reads(level, fused, level.made_by[r][1]))
            for x in reads:
                if x in level.made_by and x not in kept and x not in diamond and level.last_use.get(x) == i \
                        and g.tensors[x].nbytes == g.tensors[t].nbytes:
                    level.last_use[x] = i - 1
                    break


def _holds_matmul(level: Level, fused: set, inputs: list[int]) -> bool:
    """Whether a kernel computing a result of ``inputs`` computes a matmul too: one of them, or
    of the fused results on the way to them, is a matmul fused into its reader."""
    stack, seen = [x for x in inputs if x in fused], set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        made = level.made_by.get(x)
        if made is None:
            continue
        if made[0] in DOTS:
            return True
        stack.extend(y for y in made[1] if y in fused)
    return False


def _read_until(level: Level, inputs: list[int], end: int) -> None:
    """A fused result's inputs are read where it is: they live until ``end`` at least."""
    for x in inputs:
        if x in level.last_use:
            level.last_use[x] = max(level.last_use[x], end)


def _scatters_into_addend(g, level: Level, kept: set, fused: set) -> set[int]:
    """XLA's ``add(scatter-add(zeros, I, U), A) -> scatter-add(A, I, U)`` (its algebraic
    simplifier, on the CPU and GPU compilers): the scatter runs in place on the other addend's
    buffer, so neither the zeros nor the scatter's own result is stored. A cross entropy's
    gradient is one: the gather of the label logits transposes to a scatter-add into zeros, added
    to the softmax term (``tests/compiler/test_liveness.py``, the compiled programs). Marks the
    scatter and its zeros fused, its indices and updates read where the add is; returns the adds,
    now scatters: stored, never fused into their readers."""
    where = {t: i for i, ts in enumerate(level.defined) for t in ts}
    adds = set()
    for t, i in list(where.items()):
        made = level.made_by.get(t)
        if made is None or made[0] not in ("scatter-add", "scatter_add") or t in kept or not made[1] \
                or made[1][0] not in g.zeros:
            continue
        readers = g.readers.get(t, [])
        if len(readers) != 1 or readers[0][0] not in ("add", "add_any") or len(readers[0][1]) != 1:
            continue
        (r,) = readers[0][1]
        if r not in where or g.tensors[r].shape != g.tensors[t].shape or g.tensors[r].dtype != g.tensors[t].dtype:
            continue
        zeros = made[1][0]
        fused.add(t)
        if [o for _, outs in g.readers.get(zeros, []) for o in outs] == [t] and zeros not in kept:
            fused.add(zeros)
        for x in made[1][1:]:
            if x in level.last_use:
                level.last_use[x] = max(level.last_use[x], where[r])
        adds.add(r)
    return adds


def _kernel_reads(level: Level, fused: set, inputs: list[int]) -> list[int]:
    """The stored tensors a kernel reads that computes, with every fused result on the way, a
    result of ``inputs`` (depth first from the last input)."""
    stack, seen, reads = list(inputs), set(), []
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in fused:
            stack.extend(level.made_by[x][1])
        else:
            reads.append(x)
    return reads


_LAYOUT = frozenset(("transpose", "reshape", "convert_element_type", "copy", "copy_p"))


def _added_later(g, level: Level, t: int, kept: set) -> tuple[list[int], int] | None:
    """A matmul result read only by an add (through layout changes, each read once): ``(the
    chain from the matmul to the add's operand, the add's index)``; else None."""
    chain, last = [t], t
    while True:
        readers = g.readers.get(last, [])
        if len(readers) != 1 or len(readers[0][1]) != 1 or last in kept:
            return None
        prim, (out,) = readers[0]
        if prim in _LAYOUT and out in level.last_use:
            chain.append(out)
            last = out
            continue
        end = level.last_use.get(last)
        return (chain, end) if prim in ("add", "add_any") and end is not None else None


def _late_matmuls(g, level: Level, kept: set) -> None:
    """On a GPU, a matmul whose one reader is an add runs right before that add: XLA's GPU
    scheduler (bottom-up) places it next to its reader, so where the add waits for a later
    operand, the matmul's operands live until then and its result only there. A tied
    embedding's head gradient, added to the embedding's gradient after the backward loop, keeps
    the logits' gradient live through that loop (``tests/compiler/test_liveness.py``, the
    compiled program; seed 55 of the GPU corpus, -30.6% before)."""
    where = {t: i for i, ts in enumerate(level.defined) for t in ts}
    for t, i in list(where.items()):
        made = level.made_by.get(t)
        if made is None or made[0] != "dot_general" or t in kept:
            continue
        found = _added_later(g, level, t, kept)
        if found is None or found[1] <= i + 1:
            continue
        chain, end = found
        # ``where`` is not updated as chains move: a chain's tensors are each read once, so no
        # tensor belongs to two matmuls' chains and none is looked up after it moved.
        for x in chain:
            level.defined[where[x]].remove(x)
            level.last_use[x] = end
        level.defined[end][0:0] = chain          # before the add's own result, in order
        for x in made[1]:
            if x in level.last_use:
                level.last_use[x] = max(level.last_use[x], end)


def _output_fused_matmuls(g, level: Level, kept: set, fused: set) -> None:
    """On a TPU, a matmul whose one reader is an add is computed inside the add's kernel (libtpu's
    convolution fusion with its elementwise consumer): its result is never stored, and the
    matmul runs where the add does, so its operands live until then. Where the add waits for a
    later operand, the matmul waits with it: a tied embedding's head gradient, added to the
    embedding's gradient after the backward loop, keeps the logits' gradient live through that
    loop (gpt-tiny and gpt2-small on 256 v5e chips: the logits, f32[1024,50304] per chip on
    gpt2-small, live from the loss to after the backward loop; RESULTS.md, session 29)."""
    for ts in level.defined:
        for t in ts:
            made = level.made_by.get(t)
            if made is None or made[0] != "dot_general" or t in kept:
                continue
            # Layout changes between the matmul and the add (a transposed weight gradient) are
            # folded into the kernel too.
            found = _added_later(g, level, t, kept)
            if found is None:
                continue
            chain, end = found
            fused.update(chain)
            for x in made[1]:
                if x in level.last_use:
                    level.last_use[x] = max(level.last_use[x], end)


def _narrowing(g, t: int, ins: list[int]) -> bool:
    """Whether ``t`` converts its operand to a smaller element type (fewer bytes)."""
    return bool(ins) and g.tensors[t].nbytes < g.tensors[ins[0]].nbytes


def _expensive(g, t: int, prim: str) -> bool:
    """Whether XLA stores ``t`` (made by ``prim``) rather than compute it in each of its readers."""
    if prim not in EXPENSIVE or g.compiler == "tpu":       # libtpu computes it again in each reader
        return False
    return not (g.compiler == "gpu" and prim in GPU_CHEAP and g.tensors[t].dtype in (np.float32, np.float16))


def peak(g, level: Level, exclude: set[int], *,
         host: bool = False) -> tuple[list[int], list[int], list[int], list[int]]:
    """The live set of the level's fullest point, counted with every tensor replicated (``host``:
    of host memory), with the results of the ops running there and the matmul results held there
    (:func:`live_sets`)."""
    best, best_bytes = ([], [], [], []), -1
    for live, *rest in live_sets(g, level, host=host):
        live = [t for t in live if t not in exclude]
        n = sum(g.tensors[t].nbytes for t in live)
        if n > best_bytes:
            best, best_bytes = (live, *rest), n
    return best


def live_sets(g, level: Level, *, host: bool = False, indexed: bool = False):
    """``(live, running, held, combining)`` at each point of the level's schedule: the tensors in
    device memory (host-offloaded ones apart, where the target holds them apart:
    :attr:`~shardplan.ir.graph.Graph.host_apart`; with ``host``, those in host memory instead), the
    results of the ops running there (the point's own, and a loop body's at its peak), the
    results of matmuls run earlier whose partial sums wait there for the kernel that sums them
    (:func:`summing_kernels`), where that kernel reads another matmul too, and the matmul results
    whose partial sums wait there for the reductions that feed one combined collective
    (:func:`combined_matmuls`). With ``indexed``, each point carries its eqn's index in the level's
    schedule as a fifth element."""
    live: set[int] = set()
    inner = level.inner_host if host else level.inner_peak
    # Split-K partial sums are device memory, on NVIDIA GPUs only.
    waiting = set() if host or splitk.gpu_of(g.device) is None else _waiting(g, level)
    last, group = (None, []) if host else combined_matmuls(g, level)
    for i, defined in enumerate(level.defined):
        if host:
            live.update(t for t in defined if t in level.last_use and g.tensors[t].host)
        else:
            live.update(t for t in defined if t in level.last_use
                        and not (g.host_apart and g.tensors[t].host and t not in g.fetched_early))
        held = [t for t in live if t not in defined and t in waiting]
        combining = [t for t in group if t not in defined] if i == last else []
        here = sorted(live)
        at = (i,) if indexed else ()
        yield (here + inner.get(i, []), list(defined) + level.inner_running.get(i, []),
               held + level.inner_held.get(i, []), combining + level.inner_combining.get(i, []), *at)
        for alt in ([] if host else level.inner_alts.get(i, [])):
            yield (here + alt[0], list(defined) + alt[1], held + alt[2], combining + alt[3], *at)
        live = {t for t in live if level.last_use.get(t, -1) > i}


def combining_point(g, level: Level, exclude: set[int]) -> tuple | None:
    """The level's point where a combined collective's partial sums wait
    (:func:`combined_matmuls`), in :func:`peak`'s form; None where there is none. Their bytes
    depend on the plan, so the enclosing level weighs this point beside the level's fullest one
    (``Level.inner_alts``)."""
    best = None
    for live, running, held, combining in live_sets(g, level):
        if combining and (best is None or len(combining) > len(best[3])):
            best = ([t for t in live if t not in exclude], running, held, combining)
    return best


def combined_matmuls(g, level: Level) -> tuple[int | None, list[int]]:
    """On a Hopper GPU, the matmuls of a loop body whose partial-sum reductions XLA combines into
    one collective per trip, and the index of the point where the last of them is computed: there
    every earlier one's split-K partial sums are live too. Else ``(None, [])``.

    The matmuls are the weight gradients of a scan body over layers that flow only into the
    stacked gradient (:func:`feeds_stacked_output`): XLA's combiner reduces
    them in one all-reduce (or reduce-scatter) of their concatenation. On sm_90 the GPU
    compiler's scheduler (its latency-hiding scheduler, with the analytical estimator of Hopper
    GPUs) runs all of those matmuls, then all of their split-K reductions, then the
    concatenation and the collective, so their float32 partial sums are live together
    (llama-tiny's backward scan body on the H100: the partial sums of its four weight-gradient
    matmuls, 1.9 MiB, live at once). On an A100 each reduction follows its matmul, with the
    latency-hiding scheduler on or off. Checked on both targets' dumps by
    ``tests/compiler/test_splitk.py::test_hoppers_scheduler_keeps_the_combined_gradients_partial_sums_together``.
    At the top level the H100 keeps each reduction after its matmul too (a step of four
    attention weights: XLA merges the three that read one operand into one matmul, and reduces
    the fourth over other devices), so the top level has no such group.
    Whether a matmul's result is reduced at all depends on its PartitionSpecs: the planner counts
    its partial sums here only for the options that reduce it (:mod:`shardplan.sharding.strategies`)."""
    gpu = splitk.gpu_of(g.device)
    if gpu is None or gpu.arch == "ampere":
        return None, []
    at, group = {}, []
    for i, ts in enumerate(level.defined):
        for t in ts:
            made = level.made_by.get(t)
            if made is not None and made[0] == "dot_general" and g.loop_of[t] and feeds_stacked_output(g, t):
                at[t] = i
                group.append(t)
    if len(group) < 2:
        return None, []
    return max(at.values()), group


def summing_kernels(g, level: Level, t: int) -> frozenset[int] | None:
    """Where ``t`` is a matmul's result whose one reader is an elementwise op: the stored results
    of the kernels that compute that reader (it, or the ops it is fused into, followed through
    fused elementwise ops); else None.

    On a GPU, XLA sums a small split-K matmul's float32 partial sums (:mod:`shardplan.compiler.splitk`,
    at most :data:`~shardplan.compiler.splitk.SUMMED_IN_READER` of them) inside those kernels: the
    matmul's result is never stored. Where two matmuls feed one such kernel, the first one's
    partial sums wait for the kernel, live while the second runs (llama-tiny's ``dx`` from its
    gate and up projections, summed by one add in the backward scan). Where nothing else the
    kernel reads is a matmul, XLA runs the kernel right after the matmul (a weight gradient
    summed into ``w - lr * g``), and nothing waits."""
    made = level.made_by.get(t)
    readers = g.readers.get(t, [])
    if made is None or made[0] != "dot_general" or len(readers) != 1 or readers[0][0] not in FUSIBLE:
        return None
    kernels, stack, seen = set(), list(readers[0][1]), set()
    while stack:
        r = stack.pop()
        if r in seen:
            continue
        seen.add(r)
        if r not in g.fused:
            kernels.add(r)
            continue
        for prim, outs in g.readers.get(r, []):
            if prim not in FUSIBLE:          # fused into a matmul's kernel (a transpose, a convert)
                return None
            stack.extend(outs)
    return frozenset(kernels) or None


def _waiting(g, level: Level) -> set[int]:
    """The matmul results of the level whose partial sums wait for their summing kernel
    (:func:`summing_kernels`): those of kernels that read two matmuls or more."""
    kernels = {t: summing_kernels(g, level, t) for ts in level.defined for t in ts}
    count: dict[int, int] = {}
    for ks in kernels.values():
        for k in ks or ():
            count[k] = count.get(k, 0) + 1
    return {t for t, ks in kernels.items() if ks and any(count[k] > 1 for k in ks)}


def checkpoints(g, level: Level, always: set[int], num_points: int, *, host: bool = False,
                also: frozenset[int] = frozenset()) -> list[tuple[list[int], list[int], list[int], list[int], int]]:
    """The ``num_points`` fullest distinct live sets of the top level (``always``: the arguments
    and constants, counted apart), fullest first (``host``: of host memory), each with the results
    of the ops running there, the matmul results held there (:func:`live_sets`) and its index in
    the schedule, and the fullest point where partial sums wait for a combined collective, if none
    of those is one; and the points at the schedule's indices ``also`` (where what the plan holds
    beyond its tensors peaks: :mod:`shardplan.compiler.held`)."""
    scored = []
    for live, *rest in live_sets(g, level, host=host, indexed=True):
        live = [t for t in live if t not in always]
        scored.append((sum(g.tensors[t].nbytes for t in live), live, rest))
    scored.sort(key=lambda x: -x[0])
    seen, points = set(), []
    for _, live, rest in scored:
        key = tuple(live)
        if key not in seen:
            seen.add(key)
            points.append((live, *rest))
        if len(points) >= num_points:
            break
    # The fullest point where a combined collective's partial sums wait (their bytes depend on
    # the plan, unseen in this ranking) is weighed too.
    if not any(p[3] for p in points):
        points += [(live, *rest) for _, live, rest in scored if rest[2]][:1]
    have = {p[4] for p in points}
    points += [(live, *rest) for _, live, rest in scored if rest[3] in also and rest[3] not in have][:len(also)]
    return points or [([], [], [], [], 0)]


def multi_output_kernels(g, level: Level) -> int:
    """How many kernels with several results XLA's multi-output fusion makes of the level's ops.

    The stored results of elementwise ops and reductions become one kernel where they read one
    stored tensor over the same iteration space (siblings: an optimizer's new parameter and its
    moments, a layer norm's mean and variance) or where one reads the other directly (producer
    and consumer: a stored result and its sum), unless one depends on the other through a third
    kernel (the merged kernel would wait on itself). A scan body's result stacked into the scan's
    output is written in place (a dynamic update slice) by the kernel that reads it over its whole
    iteration space. Each kernel of several results has a tuple result, whose table of buffer
    addresses the TPU compiler keeps in a heap slot of its own (RESULTS.md, session 28)."""
    stored = [t for ts in level.defined for t in ts]
    index = {t: k for k, t in enumerate(stored)}
    above: dict[int, int] = {}          # stored tensor -> bit mask of the stored tensors it depends on
    parent: dict = {}
    members: dict = {}

    def find(t):
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    def join(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra
            members[ra] += members.pop(rb)

    first_reader: dict[tuple[int, int], int] = {}
    for t in stored:
        prim, ins = level.made_by.get(t, ("", []))
        leaves, todo, seen, behind = [], [(x, False) for x in ins], set(), set()
        while todo:
            x, through_matmul = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            if x in g.fused and x in level.made_by:
                inner = through_matmul or level.made_by[x][0] == "dot_general"
                todo.extend((y, inner) for y in level.made_by[x][1])
            else:
                leaves.append(x)
                if through_matmul:
                    behind.add(x)
        # each stored leaf with what it depends on
        through = {x: above[x] | (1 << index[x]) for x in leaves if x in index}
        above[t] = 0
        for mask in through.values():
            above[t] |= mask
        if prim not in FUSIBLE or not g.tensors[t].rank:
            continue
        parent[t], members[t] = t, [t]
        space = math.prod(g.tensors[ins[0]].shape) if prim in REDUCTIONS and ins else math.prod(g.tensors[t].shape)
        for x in leaves:
            # (what a matmul fused into the kernel reads, a TPU's convolution fusion, is not read
            # over the kernel's iteration space)
            if not g.tensors[x].rank or math.prod(g.tensors[x].shape) != space or x in behind:
                continue
            others = 0          # what t reads other than x directly: x is reached that way too?
            for y, mask in through.items():
                if y != x:
                    others |= mask
            direct = x in parent and level.made_by[x][0] not in REDUCTIONS and not (others >> index[x]) & 1
            for other in ((x,) if direct else ()) + ((first_reader[(x, space)],) if (x, space) in first_reader else ()):
                if find(other) != find(t) and not any(m != x and (above[t] >> index[m]) & 1
                                                      for m in members[find(other)]):
                    join(other, t)
            first_reader.setdefault((x, space), t)
    for t in stored:
        key = (t, math.prod(g.tensors[t].shape))
        if t not in g.stacked or (key not in first_reader and (t not in parent or not g.readers.get(t))):
            continue
        parent[("stack", t)], members[("stack", t)] = ("stack", t), [("stack", t)]
        join(first_reader.get(key, t), ("stack", t))
    return sum(1 for r, ms in members.items() if parent[r] == r and len(ms) > 1)


# Ops a per-layer gradient may pass through on its way to a scan's stacked output: layout
# changes, casts and accumulation.
ACCUMULATE = {"add", "add_any", "convert_element_type", "reshape", "transpose", "copy", "copy_p",
               "squeeze", "expand_dims"}


def feeds_stacked_output(g, tid: int) -> bool:
    """Whether ``tid``, made in a scan body of ``g`` (a :class:`~shardplan.ir.graph.Graph`), only flows
    into a tensor the scan stacks into an output.

    Such a tensor is a per-layer gradient on its way to the stacked gradient. Every path from
    it inside the body passes only through layout and accumulation ops; nothing else in the
    body reads it, so its reduction is independent of every other one in the body, and XLA's
    collective combiners merge them all into one collective per trip.
    """
    loop = g.loop_of[tid]
    if not loop:
        return False
    stack, seen, reached = [tid], {tid}, False
    while stack:
        t = stack.pop()
        reached |= t in g.stacked
        if t not in g.stacked and not g.readers.get(t):
            return False      # a body output that is carried to the next trip, not stacked
        for prim, outs in g.readers.get(t, []):
            if prim not in ACCUMULATE:
                return False
            for o in outs:
                if g.loop_of[o] != loop:
                    return False
                if o not in seen:
                    seen.add(o)
                    stack.append(o)
    return reached
