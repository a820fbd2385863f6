"""How far a predicted step time lands from the step a device ran: the measured error band of
the time model, from the device checks that ship with the package
(``benchmarks/results/device_check_<device>_<n>.json``, each model's ``predicted_s`` and
``measured_s``). The memory band of the seeded corpus is :mod:`shardplan.compiler.bands`; this is
its counterpart for step time, which only a device can measure.

What it covers, and what it does not: every shipped measurement ran on one device (no
collective was measured), on the device's calibrated figures, and its prediction is the time model
of the day the run was made. A configuration measured in several runs counts once, in its latest
run. Launch-bound steps (under ``min_measured_s``; llama-tiny ran 1.5 ms against 0.017 ms
predicted) are left out: a training step is never that short.

>>> band = step_time_band()                  # doctest: +SKIP
>>> band.low, band.high                      # doctest: +SKIP
(0.58, 1.56)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import re

from shardplan.devices.mesh import MeshSpec

_RUN = re.compile(r"^device_check_(.+)_(\d+)\.json$")


@dataclasses.dataclass(frozen=True)
class TimeBand:
    """Measured / predicted step time over the device checks: ``low``, ``median`` and ``high``
    of the ratio, over ``rows`` configurations measured on ``devices``; ``left_out`` launch-bound
    rows not counted; ``runs``, the files read."""

    rows: int
    low: float
    median: float
    high: float
    devices: tuple[str, ...]
    runs: tuple[str, ...]
    left_out: int

    def describe(self) -> str:
        """One line: the band and what it rests on."""
        return (f"measured / predicted step time {self.low:.2f}-{self.high:.2f} (median {self.median:.2f}) over "
                f"{self.rows} steps measured on one {', '.join(self.devices)} (no collectives measured; "
                f"{', '.join(self.runs)})")


def _runs() -> list[tuple[str, int, dict]]:
    """``(file name, run number, parsed JSON)`` of every shipped device check, oldest run first."""
    try:
        folder = importlib.resources.files("shardplan.benchmarks").joinpath("results")
        names = sorted((p.name for p in folder.iterdir() if _RUN.match(p.name)),
                       key=lambda n: (_RUN.match(n).group(1), int(_RUN.match(n).group(2))))
        out = []
        for name in names:
            try:
                out.append((name, int(_RUN.match(name).group(2)), json.loads(folder.joinpath(name).read_text())))
            except (OSError, ValueError):
                continue
        return out
    except (OSError, ModuleNotFoundError):
        return []


def _config(m: dict) -> str:
    """What identifies a measured step: model, batch, overrides, recomputation, mesh."""
    return json.dumps([m.get("model"), m.get("batch"), m.get("overrides"), m.get("remat_setting"), m.get("mesh")],
                      sort_keys=True)


@functools.cache
def step_time_band(min_measured_s: float = 0.01) -> TimeBand | None:
    """The band of measured / predicted step time over the shipped device checks (``None``: none
    ships). Each configuration counts once, in the latest run that measured it."""
    latest: dict[str, tuple[float, str, str]] = {}
    left_out: set[str] = set()
    for name, _, data in _runs():
        device = str((data.get("facts") or {}).get("device_kind", "unknown device"))
        for m in data.get("models", ()):
            measured, predicted = m.get("measured_s"), m.get("predicted_s")
            if not isinstance(measured, (int, float)) or not isinstance(predicted, (int, float)) or predicted <= 0:
                continue
            key = _config(m)
            if measured < min_measured_s:
                left_out.add(key)
                continue
            latest[key] = (measured / predicted, name, device)
    if not latest:
        return None
    ratios = sorted(r for r, _, _ in latest.values())
    n = len(ratios)
    median = ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2
    return TimeBand(rows=n, low=ratios[0], median=median, high=ratios[-1],
                    devices=tuple(sorted({d for _, _, d in latest.values()})),
                    runs=tuple(sorted({f for _, f, _ in latest.values()})), left_out=len(left_out - set(latest)))


@functools.cache
def measured_devices() -> frozenset[str]:
    """The device kinds a shipped device check ran on (``"NVIDIA H200"``)."""
    return frozenset(str((d.get("facts") or {}).get("device_kind")) for _, _, d in _runs()
                     if (d.get("facts") or {}).get("device_kind"))


def calibrated(mesh: MeshSpec) -> bool:
    """Whether ``mesh``'s device was ever measured: its figures come from ``shardplan mesh
    calibrate`` (a ``[calibration]`` table), or a shipped device check ran on its kind of device."""
    if mesh.calibration:
        return True
    name = mesh.device.name.lower()
    return any(kind.lower() in name for kind in measured_devices())
