"""The tables of ``benchmarks/RESULTS.md``, written from the results files.

    python -m shardplan.benchmarks.report            # rewrite the generated tables in RESULTS.md
    python -m shardplan.benchmarks.report --check    # exit 1 where RESULTS.md differs from the files

RESULTS.md marks each generated table ``<!-- generated: NAME -->`` ... ``<!-- end generated: NAME -->``
and this command rewrites what lies between from the file it reads (each table says which, and
the date, commit, jax version and compiler it was measured with):

- ``matrix``: one table per compiler, planner against the best hand plan that fits, per cell;
  ``matrix-rows``: every plan of every cell (``results/results.json``, ``results/matrix.md``'s
  provenance line; written by :mod:`shardplan.benchmarks.bench`);
- ``fidelity``: the seeded corpus's errors per compiler (``results/fidelity_<compiler>.json``,
  :mod:`shardplan.benchmarks.fidelity`);
- ``device``: the runs on a lent accelerator (``results/device_check_*.json``,
  :mod:`shardplan.benchmarks.device_check`).

The prose around them is written by hand and says what the tables show.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

if not __package__:   # run as a script from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PAGE = os.path.join(HERE, "RESULTS.md")
_MARK = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end generated: \2 -->)", re.S)


def _fmt(x, digits: int = 2) -> str:
    return "" if x is None or x != x else f"{x:.{digits}f}"


def _matrix_rows():
    from shardplan.benchmarks.bench import Row
    with open(os.path.join(RESULTS, "results.json")) as f:
        rows = [Row(**{k: (float("nan") if v is None else v) for k, v in r.items()}) for r in json.load(f)]
    with open(os.path.join(RESULTS, "matrix.md")) as f:
        provenance = f.readline().strip()
    return rows, provenance


def matrix() -> str:
    """Per compiler: each cell's planner and best fitting hand plan, compiled and priced."""
    from shardplan.benchmarks.bench_output import ratio
    rows, provenance = _matrix_rows()
    out = [f"From `benchmarks/results/results.json` ({provenance.rstrip('.')})."]
    for compiler in dict.fromkeys(r.compiler or "unrecorded" for r in rows):
        cells = [c for c in dict.fromkeys(r.cell for r in rows) if
                 (next(r for r in rows if r.cell == c).compiler or "unrecorded") == compiler]
        out += ["", f"**{compiler}**", "",
                "| cell | planner ms (compiled) | best hand plan that fits, ms | planner / best | "
                "planner memory GiB/dev / budget | planning s |", "|---|---|---|---|---|---|"]
        for cell in cells:
            here = [r for r in rows if r.cell == cell]
            mine = next((r for r in here if r.plan == "shardplan"), None)
            q, best = ratio(here)
            best_row = next((r for r in here if r.plan == best), None)
            if mine is None:
                continue
            shown = mine.status if mine.status != "ok" else _fmt(mine.compiled_ms)
            out.append(f"| {cell} | {shown} | {f'{best} {_fmt(best_row.compiled_ms)}' if best_row else 'none fits'} | "
                       f"{_fmt(q, 3) or 'n/a'} | {_fmt(mine.memory_gib)} / {_fmt(mine.budget_gib)} | "
                       f"{_fmt(mine.solve_s, 1)} |")
    return "\n".join(out)


def matrix_rows() -> str:
    """Every plan of every cell, as the harness wrote it."""
    from shardplan.benchmarks.bench_output import markdown
    rows, provenance = _matrix_rows()
    return f"{provenance}\n\n" + markdown(rows).split("\n\n")[0]


def fidelity() -> str:
    """The corpus's error per compiler, and its worst memory cells."""
    from shardplan.benchmarks.fidelity import summary
    tables, notes, sources = [], [], []
    for path in sorted(glob.glob(os.path.join(RESULTS, "fidelity_*.json"))):
        with open(path) as f:
            data = json.load(f)
        for compiler, rows in data["rows"].items():
            table, worst = summary(compiler, rows)
            tables.append(table)
            notes.append(worst)
        sources.append(f"`results/{os.path.basename(path)}` (jax {data.get('jax', '?')}, "
                       f"fresh draw --seed {data.get('seed', '?')})")
    return "\n".join([f"From {', '.join(sources)}.", "",
                      "| compiler | models | planned and compiled | memory error: median / 90th pct / worst | "
                      "collective bytes error: median / 90th pct / worst | compiled over the budget | "
                      "over it with fit_compiled |",
                      "|---|---|---|---|---|---|---|", *tables, "", "Worst memory cells:", "", *notes])


def device() -> str:
    """Each model run on a lent accelerator: predicted against measured step and memory."""
    out = ["Predicted: the time model of the day the run was made, as the run recorded it.", "",
           "| run | device, jax | model (batch, mesh, recomputation) | predicted step ms | measured step ms | "
           "measured / predicted | memory predicted GiB | peak in use GiB |", "|---|---|---|---|---|---|---|---|"]
    for path in sorted(glob.glob(os.path.join(RESULTS, "device_check_*.json"))):
        with open(path) as f:
            data = json.load(f)
        facts = data.get("facts", {})
        for m in data.get("models", []):
            if "measured_s" not in m:
                continue
            out.append(f"| `{os.path.basename(path)}` | {facts.get('device_kind', '?')}, {facts.get('jax', '?')} | "
                       f"{m['model']} ({m.get('batch')}, {m.get('mesh')}, {m.get('remat_setting', 'unrecorded')}) | "
                       f"{_fmt(m['predicted_s'] * 1e3, 3)} | {_fmt(m['measured_s'] * 1e3, 3)} | "
                       f"{_fmt(m.get('time_ratio'), 2)} | {_fmt(m.get('memory_predicted', float('nan')) / 2**30)} | "
                       f"{_fmt(m.get('memory_peak_in_use', float('nan')) / 2**30)} |")
    return "\n".join(out)


TABLES = {"matrix": matrix, "matrix-rows": matrix_rows, "fidelity": fidelity, "device": device}


def render(text: str) -> str:
    """``text`` with every generated table written afresh from the results files."""
    def fill(m):
        name = m.group(2)
        if name not in TABLES:
            raise SystemExit(f"RESULTS.md names a generated table {name!r}; known: {', '.join(TABLES)}")
        return m.group(1) + TABLES[name]().rstrip() + "\n" + m.group(4)
    return _MARK.sub(fill, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where RESULTS.md differs from the results files")
    ap.add_argument("--page", default=PAGE, help="the page to write (default: benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    with open(args.page) as f:
        text = f.read()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{args.page} differs from the results files: run python -m shardplan.benchmarks.report",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        tmp = args.page + ".tmp"
        with open(tmp, "w") as f:
            f.write(new)
        os.replace(tmp, args.page)
        print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
