"""Where a profiled step's device time goes: matmuls, other kernels, copies.

    python benchmarks/kernel_split.py benchmarks/results/device_check_h200_5.json [--hlo-dir DIR]

Reads the per-kernel device times ``device_check.py`` records for models run with ``@profile=N``
and the compiled programs it writes beside its JSON (``hlo_*.txt.gz``). A kernel is a matmul
when it is a cuBLAS kernel or a fusion whose computation holds a dot or convolution; a copy when
the CUDA driver's memcpy or memset runs it (XLA's ``copy`` of a buffer of zeros into a scan's
stacked buffer, and a matmul's result copied into one, run so); anything else is a fusion of
elementwise ops, reductions and the like.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys

if not __package__:   # run as a script from a checkout: import the checkout's shardplan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardplan.compiler.hlo import _computations  # the audit's reading of compiled HLO text

_CUBLAS = re.compile(r"nvjet|sm90_|sm80_|cutlass|xmma|cublas|gemv")


def split(row: dict, text: str) -> dict[str, float]:
    """Milliseconds per step by kind of kernel."""
    comps, _ = _computations(text)
    fusions = {}
    for lines in comps.values():
        for line in lines:
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*? fusion\(.*calls=%([\w.\-]+)", line)
            if m:
                fusions[re.sub(r"[.\-]", "_", m.group(1))] = m.group(2)

    def has_dot(comp: str, depth: int = 0) -> bool:
        for line in comps.get(comp, []):
            if re.search(r" (dot|convolution)\(", line):
                return True
            if depth < 4 and any(has_dot(c, depth + 1) for c in re.findall(r"calls=%([\w.\-]+)", line)):
                return True
        return False

    out = {"matmul": 0.0, "other kernels": 0.0, "copies": 0.0, "unmatched": 0.0}
    for name, k in row["kernels"].items():
        ms = k["ns"] / 1e6
        if _CUBLAS.search(name):
            out["matmul"] += ms
        elif "memcpy" in name or "Memset" in name or "memset" in name:
            out["copies"] += ms
        elif name in fusions:
            out["matmul" if has_dot(fusions[name]) else "other kernels"] += ms
        else:
            out["unmatched"] += ms
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--hlo-dir", help="where the hlo_*.txt.gz files are (default: beside the JSON)")
    args = ap.parse_args()
    where = args.hlo_dir or os.path.dirname(os.path.abspath(args.json))
    print(f"{'model':<32} {'remat':<9} {'step ms':>8} {'kernels':>8} {'matmul':>8} {'other':>8} {'copies':>8}")
    for row in json.load(open(args.json))["models"]:
        if "kernels" not in row:
            continue
        with gzip.open(os.path.join(where, row["hlo_file"]), "rt") as f:
            parts = split(row, f.read())
        name = row["model"] + "".join(f":{k}={v}" for k, v in row.get("overrides", {}).items()) + f":{row['batch']}"
        print(f"{name:<32} {row['remat_setting']:<9} {row['measured_s'] * 1e3:>8.1f} {sum(parts.values()):>8.1f} "
              f"{parts['matmul']:>8.1f} {parts['other kernels']:>8.1f} {parts['copies']:>8.1f}"
              + (f"  (unmatched {parts['unmatched']:.1f})" if parts["unmatched"] else ""))


if __name__ == "__main__":
    main()
