"""A :class:`~shardplan.planning.frontier.Frontier` reported: a table of the Pareto frontier (and
of every size where asked), JSON, and a plot of time against cost (matplotlib, the ``bench``
extra, imported only here). Every time and cost is shown with the time model's measured band."""

from __future__ import annotations

import json
import os

from shardplan.util.sizes import format_bytes


def duration(seconds: float) -> str:
    """A duration in the unit that reads best: ``41.2 d``, ``5.3 h``, ``12 min``, ``40 s``."""
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.3g} s"


def _step(seconds: float) -> str:
    return f"{seconds:.3f}" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _band(result, value: float, show) -> str:
    """``value`` and its band: ``41.2 d (23.9 d-64.3 d)``."""
    if result.band is None:
        return show(value)
    return f"{show(value)} ({show(value * result.band.low)} to {show(value * result.band.high)})"


def money(amount: float) -> str:
    """An amount of money: ``1.25 M``, ``310.4 k``, ``12.50``."""
    if amount >= 1e6:
        return f"{amount / 1e6:,.2f} M"
    return f"{amount / 1e3:,.1f} k" if amount >= 1e3 else f"{amount:,.2f}"


def _axes(axes) -> str:
    return "x".join(f"{k}={v}" for k, v in (axes or {}).items())


def table(result, every: bool = False) -> str:
    """Markdown: the frontier, cheapest first (``every``: every planned size too), then the sizes
    that do not fit and those skipped, then what the figures rest on."""
    cur = result.currency
    lines = [f"Frontier of time against cost: {result.tokens:.3g} tokens, {result.tokens_per_step:,} tokens a step, "
             f"{result.model_flops:.3g} model FLOPs a step; prices from {result.prices_path}", "",
             f"| hardware | devices | mesh axes | plan | step | tokens/s | MFU | memory/device (budget) | "
             f"time to train | cost {cur} | {cur}/device-h | device measured | on frontier |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    shown = [p for p in result.points if p.status == "planned" and (every or p.frontier)]
    for p in sorted(shown, key=lambda p: p.cost):
        lines.append(
            f"| {p.hardware} | {p.devices} | {_axes(p.axes)} | {p.plan} | {_step(p.step_s)} | {p.tokens_per_s:,.0f} | "
            f"{p.mfu:.0%} | {format_bytes(p.memory_bytes)} ({format_bytes(p.budget_bytes)}) | "
            f"{_band(result, p.train_s, duration)} | {_band(result, p.cost, money)} | {p.per_device_hour:g} | "
            f"{'yes' if p.calibrated else 'never calibrated'} | {'yes' if p.frontier else ''} |")
    no_fit = [p for p in result.points if p.status == "does not fit"]
    if no_fit:
        lines += ["", "Does not fit (least memory a device would need):", ""]
        for p in no_fit:
            least = "unknown" if p.least_bytes is None else \
                ("at least " if p.least_is_floor else "") + format_bytes(p.least_bytes)
            lines.append(f"- {p.hardware} x {p.devices}: {least} (budget {format_bytes(p.budget_bytes)}): {p.reason}")
    skipped = [p for p in result.points if p.status == "skipped"]
    if skipped:
        lines += ["", "Skipped:", ""]
        lines += [f"- {p.hardware} x {p.devices}: {p.reason}" for p in skipped]
    lines += ["", _notes(result)]
    return "\n".join(lines)


def _notes(result) -> str:
    band = ("Time band: none ships with this version (no device measurements)" if result.band is None else
            f"Time band (in brackets): {result.band.describe()}; the cost scales with the time")
    uncalibrated = sorted({p.hardware for p in result.points if not p.calibrated})
    if uncalibrated:
        band += (f". Never calibrated on a device: {', '.join(uncalibrated)} (priced on datasheet figures; "
                 "the band was not measured there, and may not hold)")
    planned = [p for p in result.points if p.status == "planned"]
    return (f"{band}. Prices change: {result.prices_path} says where and when each was read. "
            f"{len(planned)} sizes planned in {sum(p.planning_s for p in planned):.1f} s; "
            f"{result.wall_s:.1f} s in all.")


def to_json(result) -> str:
    """Every point, the prices with their sources, the band and the settings."""
    band = None if result.band is None else {
        "low": result.band.low, "median": result.band.median, "high": result.band.high, "rows": result.band.rows,
        "devices": list(result.band.devices), "runs": list(result.band.runs), "what": result.band.describe()}
    return json.dumps({
        "tokens": result.tokens, "tokens_per_step": result.tokens_per_step, "model_flops_per_step": result.model_flops,
        "currency": result.currency, "prices_file": result.prices_path,
        "prices": {h: {"key": p.key, "per_device_hour": p.per_device_hour, "source": p.source, "date": p.date}
                   for h, p in result.prices.items()},
        "time_band": band, "wall_s": result.wall_s,
        "points": [{k: v for k, v in vars(p).items()} for p in result.points],
    }, indent=1)


def plot(result, path: str | os.PathLike) -> None:
    """Time to train against cost, log-log: every planned size, the frontier joined, each point
    labelled by hardware, devices and plan, the band drawn through each point."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the frontier plot needs matplotlib: pip install 'shardplan[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planned = [p for p in result.points if p.status == "planned"]
    kinds = sorted({p.hardware for p in planned})
    colours = {h: plt.get_cmap("tab10")(i % 10) for i, h in enumerate(kinds)}
    fig, ax = plt.subplots(figsize=(10, 7))
    for p in planned:
        days = p.train_s / 86400
        if result.band is not None:
            ax.plot([p.cost * result.band.low, p.cost * result.band.high],
                    [days * result.band.low, days * result.band.high], color=colours[p.hardware], alpha=0.25, lw=3)
        ax.scatter(p.cost, days, color=colours[p.hardware], marker="o" if p.frontier else "x",
                   s=40 if p.frontier else 25, label=p.hardware)
        ax.annotate(f"{p.hardware} x {p.devices}" + ("" if p.calibrated else " (never calibrated)")
                    + f"\n{_axes(p.axes)}; {p.plan}", (p.cost, days), fontsize=6, xytext=(4, 3),
                    textcoords="offset points")
    front = result.pareto
    ax.plot([p.cost for p in front], [p.train_s / 86400 for p in front], color="black", lw=1, label="frontier")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"cost to train {result.tokens:.3g} tokens ({result.currency})")
    ax.set_ylabel("days to train")
    ax.set_title("Time against cost (o: on the frontier); each bar: the time model's measured band", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=130)
    plt.close(fig)
