"""The benchmark harness's output: the markdown table, the planner / best-baseline ratio, the
plots (matplotlib) and the files a run writes (``matrix.md``, ``results.csv``, ``results.json``:
each written whole, then moved into place)."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from typing import TYPE_CHECKING

from shardplan.compiler.cost import COLLECTIVE_KINDS

if TYPE_CHECKING:
    from shardplan.benchmarks.bench import Row


def ratio(rows: list[Row], key: str = "compiled_ms") -> tuple[float, str]:
    """Planner / best baseline that fits the budget, by compiled step time (``key``: the sum of
    the program's FLOP, byte and collective times, or ``"roofline_ms"``, its ops priced one by
    one; nan when none applies)."""
    mine = next((r for r in rows if r.plan == "shardplan" and r.status == "ok"), None)
    fits = [r for r in rows if r.plan != "shardplan" and r.status == "ok"]
    if mine is None or not fits:
        return float("nan"), ""
    best = min(fits, key=lambda r: getattr(r, key))
    return getattr(mine, key) / getattr(best, key), best.plan


def _fmt(x: float, digits: int = 2) -> str:
    return "" if x != x else f"{x:.{digits}f}"


def markdown(all_rows: list[Row]) -> str:
    lines = ["| cell | plan | status | predicted ms | compiled ms | compiled comm ms | memory GiB/dev "
             "| collectives (count, GiB) | solve s | CPU step ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in all_rows:
        coll = "" if r.collectives != r.collectives else f"{r.collectives:.0f}, {r.collective_gib:.3f}"
        lines.append(f"| {r.cell} | {r.plan}{f' ({r.choice})' if r.choice else ''} | {r.status} | "
                     f"{_fmt(r.predicted_ms)} | {_fmt(r.compiled_ms)} | "
                     f"{_fmt(r.comm_ms) if r.comm_ms_by_kind else ''} | {_fmt(r.memory_gib)} | {coll} | "
                     f"{_fmt(r.solve_s, 1)} | {_fmt(r.cpu_step_ms, 1)} |")
    lines += ["", "| cell | budget GiB/dev | planner / best baseline (compiled) | best baseline | "
              "the same, ops priced one by one | compiled by |", "|---|---|---|---|---|---|"]
    for cell in dict.fromkeys(r.cell for r in all_rows):
        rows = [r for r in all_rows if r.cell == cell]
        q, best = ratio(rows)
        qr, best_r = ratio(rows, "roofline_ms")
        lines.append(f"| {cell} | {_fmt(rows[0].budget_gib)} | {_fmt(q, 3) or 'n/a'} | {best} | "
                     f"{(_fmt(qr, 3) + ' (' + best_r + ')') if qr == qr else 'n/a'} | {rows[0].compiler} |")
    return "\n".join(lines)


def plots(all_rows: list[Row], out: str) -> list[str]:
    """PNG figures: step-time breakdown per plan and cell, and the planner/baseline ratio per cell."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = []
    ok = [r for r in all_rows if r.status in ("ok", "over budget") and r.comm_ms_by_kind]
    cells = list(dict.fromkeys(r.cell for r in ok))
    fig, axs = plt.subplots(len(cells), 1, figsize=(9, 2.2 * len(cells)), squeeze=False)
    for ax, cell in zip(axs[:, 0], cells):
        rs = [r for r in ok if r.cell == cell]
        left = [0.0] * len(rs)
        parts = [("compute + HBM", [r.compute_ms for r in rs])] + \
            [(k, [r.comm_ms_by_kind.get(k, 0.0) for r in rs]) for k in COLLECTIVE_KINDS]
        for name, values in parts:
            ax.barh([r.plan for r in rs], values, left=left, label=name)
            left = [a + b for a, b in zip(left, values)]
        ax.set_title(cell, fontsize=9)
        ax.tick_params(labelsize=8)
    axs[0, 0].legend(fontsize=7, loc="lower right")
    axs[-1, 0].set_xlabel("compiled step time priced on the cell's mesh (ms)")
    fig.tight_layout()
    files.append(os.path.join(out, "breakdown.png"))
    fig.savefig(files[-1], dpi=90)
    plt.close(fig)

    ratios = [(cell, *ratio([r for r in all_rows if r.cell == cell])) for cell in cells]
    ratios = [(c, q, b) for c, q, b in ratios if q == q]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(ratios) + 1.2))
    ax.barh([c for c, _, _ in ratios], [q for _, q, _ in ratios],
            color=["tab:green" if q <= 1.0 else "tab:red" for _, q, _ in ratios])
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("planner / best baseline that fits, compiled step time (lower is better)")
    ax.tick_params(labelsize=8)
    fig.tight_layout()
    files.append(os.path.join(out, "ratio.png"))
    fig.savefig(files[-1], dpi=90)
    plt.close(fig)
    return files


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def commit() -> str:
    """The checkout's commit (``+`` where its files differ from it), else ``unknown`` (installed)."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True, text=True, timeout=10)
        head = run("rev-parse", "--short", "HEAD")
        if head.returncode:
            return "unknown"
        edited = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("+" if edited else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_outputs(all_rows: list[Row], out: str, header: str) -> None:
    table = markdown(all_rows)
    _write_atomic(os.path.join(out, "matrix.md"), header + table + "\n")
    with open(os.path.join(out, "results.csv.tmp"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cell", "plan", "status", "predicted_ms", "compiled_ms", "compute_ms",
                    *[f"{k}_ms" for k in COLLECTIVE_KINDS], "memory_gib", "collectives", "collective_gib",
                    "solve_s", "cpu_step_ms", "roofline_ms"])
        for r in all_rows:
            w.writerow([r.cell, r.plan, r.status, r.predicted_ms, r.compiled_ms, r.compute_ms,
                        *[r.comm_ms_by_kind.get(k, "") for k in COLLECTIVE_KINDS], r.memory_gib, r.collectives,
                        r.collective_gib, r.solve_s, r.cpu_step_ms, r.roofline_ms])
    os.replace(os.path.join(out, "results.csv.tmp"), os.path.join(out, "results.csv"))
    _write_atomic(os.path.join(out, "results.json"),
                  json.dumps([dataclasses.asdict(r) for r in all_rows], indent=1, default=str))
