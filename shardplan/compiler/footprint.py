"""What a compiled program needs in device memory.

XLA reports a compiled program's memory in ``memory_analysis()``: arguments, outputs, the
aliased part (donated arguments), and ``temp_size_in_bytes``, the heap its buffer assignment
lays every temporary out in. The program needs argument + output + temp - alias bytes per
device. On the GPU and CPU compilers that sum is what the buffer assignment allocates.

libtpu's ``memory_analysis`` does not give that figure. Its ``temp_size_in_bytes`` exceeds the
heap its own buffer assignment allocates (the ``preallocated-temp`` allocation of the default
memory space) by amounts with no rule found: about the arguments' bytes on a scanned, donated toy
step; 3.16 GiB reported against a 2.57 GiB heap for gpt2-small on 256 v5e chips. Its ``peak_memory_in_bytes`` is
the live peak, under the heap where small buffers fragment it. What libtpu holds against the
chip's HBM, in the error it raises when a program does not fit ("the total memory required
for HLO temporaries (X)"), is argument + output - alias + the heap: checked on three programs at
the 15.75 GiB limit of a v5e, one of them with the ``memory_analysis`` sum at 18.1 GiB
compiling fine (two of them in ``tests/compiler/test_footprint.py``; RESULTS.md, session 22).

So on a TPU, :func:`compile` reads the heap from the buffer assignment libtpu writes when asked
to dump its compile (``xla_dump_to``, into a temporary folder it then removes), and
:func:`compiled_memory` counts it. Elsewhere both are the plain compile and the sum.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
import warnings
import weakref

# libtpu's heap, per compiled program, where :func:`compile` read it; and its live peak.
_HEAPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_DUMPED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# The default memory space's heap: one preallocated temporary allocation (other memory spaces,
# VMEM and SMEM, say ``color N``).
_HEAP_LINE = re.compile(r"^allocation \d+: size (\d+), preallocated-temp:", re.MULTILINE)


def compile(lowered, options: dict | None = None, *, platform: str):
    """``lowered.compile(compiler_options=options)``; on ``platform == "tpu"`` also reads the
    heap libtpu's buffer assignment lays out, which :func:`compiled_memory` then counts."""
    if platform != "tpu":
        return lowered.compile(compiler_options=options)
    with tempfile.TemporaryDirectory(prefix="shardplan-heap-") as folder:
        compiled = lowered.compile(compiler_options={**(options or {}), "xla_dump_to": folder})
        heap, dumped = heap_bytes(folder), dumped_heap(folder)
    if heap is None:
        # Nothing dumped: JAX's persistent compilation cache handed the program back uncompiled.
        warnings.warn("shardplan: libtpu wrote no buffer assignment for this compile (a persistent "
                      "compilation cache hit?); its memory is read from memory_analysis, which over-states a "
                      "TPU program's heap", stacklevel=2)
    else:
        try:
            _HEAPS[compiled] = heap
            if dumped is not None:
                _DUMPED[compiled] = dumped
        except TypeError:                   # not weakly referable: read as elsewhere
            pass
    return compiled


def dumped(compiled) -> "DumpedHeap | None":
    """The heap and its live peak :func:`compile` read for this program (a TPU's); else None."""
    try:
        return _DUMPED.get(compiled)
    except TypeError:
        return None


def heap_bytes(folder: str) -> int | None:
    """The default memory space's heap in the buffer assignment dumped under ``folder`` (the
    largest where several programs were dumped: an upper bound on the step's own); None where
    there is none."""
    heaps = []
    for path in glob.glob(os.path.join(folder, "*buffer-assignment.txt")):
        with open(path) as f:
            heaps.append(sum(int(size) for size in _HEAP_LINE.findall(f.read())))
    return max(heaps) if heaps else None


def compiled_memory(compiled) -> float:
    """Bytes per device a compiled program needs: argument + output + temp - alias, with temp
    libtpu's heap where :func:`compile` read it; elsewhere the compiler's own peak where it
    reports a larger one (libtpu with VMEM placement on, compiled without :func:`compile`,
    reports no temporaries for small programs, only a peak)."""
    m = compiled.memory_analysis()
    kept = float(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
    try:
        heap = _HEAPS.get(compiled)
    except TypeError:                       # not weakly referable (a stand-in): never recorded
        heap = None
    if heap is not None:
        return kept + heap
    return max(kept + float(m.temp_size_in_bytes), float(getattr(m, "peak_memory_in_bytes", 0) or 0))


def compiled_temp(compiled) -> float:
    """What the program holds besides its arguments: :func:`compiled_memory` less them."""
    return compiled_memory(compiled) - float(compiled.memory_analysis().argument_size_in_bytes)


def compiled_host_memory(compiled) -> float:
    """Bytes per device a compiled program holds in host memory (offloaded residuals)."""
    m = compiled.memory_analysis()
    return float(sum(getattr(m, f"host_{k}_size_in_bytes", 0) or 0 for k in ("argument", "output", "temp"))
                 - (getattr(m, "host_alias_size_in_bytes", 0) or 0))


# A value of the heap in a dumped buffer assignment: ``value: <id name{index} (phi) @pos>
# (size=S,offset=O)``; loop-carried values (a while's parameters and results) say ``(phi)``.
_VALUE = re.compile(r"^\s*value: <\d+ (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", re.MULTILINE)
# A value's live range in the dumped ``HloLiveRange``: ``name{index}:start-end``.
_RANGE = re.compile(r"^\s+(\S+?\{\S*\}):(\d+)-(\d+)$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class DumpedHeap:
    """The default memory space's heap in one dumped buffer assignment, beside the bytes live in
    it at its fullest point: ``heap / live_peak - 1`` is what the layout adds (fragmentation,
    alignment) over the schedule's liveness. ``at_peak``: the buffers live there, largest first,
    as ``(bytes, first step, last step, shape, value names)`` (aliased values share one buffer).
    ``tuple_slots``: the heap's distinct places of tuple-shaped values (a loop's state, a kernel's
    several results: tables of buffer addresses; libtpu gives each a slot of its own).
    ``buffers``: every buffer of the heap, as ``at_peak``'s, in no order."""

    heap: int
    live_peak: int
    peak_step: int
    at_peak: tuple
    tuple_slots: int = 0
    buffers: tuple = ()


def dumped_heap(folder: str) -> DumpedHeap | None:
    """The heap and its live peak in the buffer assignment XLA dumped under ``folder``
    (``xla_dump_to``: ``*buffer-assignment.txt`` with its ``*live-range.txt``; the program with
    the largest heap where several were dumped); None where there is none.

    Every value laid out in the ``preallocated-temp`` allocation counts, loop-carried ones too
    (``(phi)``): a scan's carry and its stacked outputs live across the whole loop. Values at
    one offset and size whose live ranges meet are one buffer (a while's operand, parameters
    and result alias). Checked on XLA's GPU compiler: the heap is its live peak within 0.2%
    (llama-tiny, GPT-3 175B; RESULTS.md, session 27)."""
    best = None
    for path in glob.glob(os.path.join(folder, "*buffer-assignment.txt")):
        ranges_path = path.replace("buffer-assignment.txt", "live-range.txt")
        if not os.path.exists(ranges_path):
            continue
        with open(path) as f:
            text = f.read()
        found = _dumped_heap(text, ranges_path)
        if found is not None and (best is None or found.heap > best.heap):
            best = found
    return best


def _dumped_heap(text: str, ranges_path: str) -> DumpedHeap | None:
    match = _HEAP_LINE.search(text)
    if match is None:
        return None
    end = text.find("\nallocation ", match.end())
    block = text[match.start():] if end < 0 else text[match.start():end]
    with open(ranges_path) as f:
        ranges = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _RANGE.finditer(f.read())}
    by_chunk: dict[tuple[int, int], list] = {}
    for m in _VALUE.finditer(block):
        name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
        if name in ranges:
            by_chunk.setdefault((int(m.group(3)), int(m.group(2))), []).append((*ranges[name], name, m.group(4)))
    buffers = []                     # (bytes, start, end, shape, names)
    for (_, size), values in by_chunk.items():
        values.sort()
        start, end, names, shape = values[0][0], values[0][1], [values[0][2]], values[0][3]
        for s, e, name, _ in values[1:]:
            if s <= end + 1:
                end, names = max(end, e), names + [name]
            else:
                buffers.append((size, start, end, shape, tuple(names)))
                start, end, names = s, e, [name]
        buffers.append((size, start, end, shape, tuple(names)))
    change: dict[int, int] = {}
    for size, start, end, _, _ in buffers:
        change[start] = change.get(start, 0) + size
        change[end + 1] = change.get(end + 1, 0) - size
    live, peak, step = 0, 0, 0
    for t in sorted(change):
        live += change[t]
        if live > peak:
            peak, step = live, t
    at_peak = tuple(sorted((b for b in buffers if b[1] <= step <= b[2]), key=lambda b: -b[0]))
    slots = len({offset for (offset, _), values in by_chunk.items() if values[0][3].startswith("(")})
    return DumpedHeap(int(match.group(1)), peak, step, at_peak, slots, tuple(buffers))
