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
compiling fine (two of them in ``tests/test_footprint.py``; RESULTS.md, session 22).

So on a TPU, :func:`compile` reads the heap from the buffer assignment libtpu writes when asked
to dump its compile (``xla_dump_to``, into a temporary folder it then removes), and
:func:`compiled_memory` counts it. Elsewhere both are the plain compile and the sum.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
import warnings
import weakref

# libtpu's heap, per compiled program, where :func:`compile` read it.
_HEAPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

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
        heap = heap_bytes(folder)
    if heap is None:
        # Nothing dumped: JAX's persistent compilation cache handed the program back uncompiled.
        warnings.warn("shardplan: libtpu wrote no buffer assignment for this compile (a persistent "
                      "compilation cache hit?); its memory is read from memory_analysis, which over-states a "
                      "TPU program's heap", stacklevel=2)
    else:
        try:
            _HEAPS[compiled] = heap
        except TypeError:                   # not weakly referable: read as elsewhere
            pass
    return compiled


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
