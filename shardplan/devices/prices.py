"""Prices per device-hour, read from a user's TOML file: what :func:`shardplan.frontier` costs a
cluster with. No price is built into shardplan: prices change, differ by provider, region and
commitment, and only the user knows theirs. ``meshes/prices/example.toml`` shows the format, each
figure with its source and the date it was read.

    currency = "USD"                       # optional; shown beside every cost

    [hardware.h100-8]                      # a preset name, a mesh name or a device name
    per_device_hour = 2.99                 # price of one device for one hour
    source = "https://lambda.ai/pricing"   # where the figure comes from
    date = "2025-06-01"                    # when it was read

>>> prices = load_prices("meshes/prices/example.toml")        # doctest: +SKIP
>>> prices.for_mesh("h100-8", load_mesh("h100-8")).per_device_hour   # doctest: +SKIP
2.99
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import tomllib
from collections.abc import Mapping
from typing import Any

from shardplan.devices.mesh import MeshSpec
from shardplan.errors import ShardplanError

_TOP_KEYS = {"currency", "note", "hardware"}
_ENTRY_KEYS = {"per_device_hour", "source", "date", "note"}
_EXAMPLE = '[hardware.h100-8]\nper_device_hour = 2.99\nsource = "https://..."\ndate = "2025-06-01"'


class PriceFileError(ShardplanError, ValueError):
    """A prices file is missing, not TOML, or has a wrong or missing key; or a hardware kind has
    no price in it. The message names the file, the key and the fix."""

    def __init__(self, message: str, *, source: str, key: str | None = None):
        where = f"{source}:" + (f" [{key}]" if key else "")
        super().__init__(f"{where} {message}")
        self.source = source
        self.key = key


@dataclasses.dataclass(frozen=True)
class Price:
    """One device's price for one hour, with where and when it was read."""

    key: str                 # the name it is listed under in the file
    per_device_hour: float
    source: str
    date: str
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Prices:
    """The prices of one file, by the name each is listed under."""

    path: str
    currency: str
    entries: Mapping[str, Price]

    def for_mesh(self, hardware: str, mesh: MeshSpec) -> Price:
        """The price of ``hardware`` (as the user named it: a preset name or mesh file), looked up
        by that name, then by its mesh's name, then by its device's name."""
        names = [str(hardware), os.path.splitext(os.path.basename(str(hardware)))[0], mesh.name, mesh.device.name]
        for name in names:
            if name in self.entries:
                return self.entries[name]
        raise PriceFileError(
            f"no price for hardware {hardware!r} (device {mesh.device.name!r}); add a table "
            f"[hardware.{_bare(names[1])}] with per_device_hour, source and date (listed: "
            f"{', '.join(self.entries) or 'none'})", source=self.path, key=f"hardware.{_bare(names[1])}")


def _bare(name: str) -> str:
    """``name`` as a TOML key: bare where it can be, else quoted."""
    return name if name.replace("-", "").replace("_", "").isalnum() else '"' + name.replace('"', '\\"') + '"'


def load_prices(path: str | os.PathLike) -> Prices:
    """Read and check a prices file; a :class:`PriceFileError` names the file, the key and the fix."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            raw = f.read(1 << 20)
    except OSError as e:
        raise PriceFileError(f"cannot be read ({e.strerror or e}); give a prices file such as "
                             "meshes/prices/example.toml", source=source) from None
    try:
        data = tomllib.loads(raw.decode("utf-8").removeprefix("\ufeff"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise PriceFileError(f"is not valid TOML ({' '.join(str(e).split())}); see meshes/prices/example.toml",
                             source=source) from None
    return prices_from_dict(data, source=source)


def prices_from_dict(data: Mapping[str, Any], *, source: str = "<dict>") -> Prices:
    """Check a parsed prices file and build :class:`Prices` (the first problem is raised)."""
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise PriceFileError(f"unknown key {unknown[0]!r}; the keys are currency, note and [hardware.NAME] tables",
                             source=source, key=unknown[0])
    currency = data.get("currency", "USD")
    if not isinstance(currency, str) or not currency:
        raise PriceFileError(f"must be a currency code such as \"USD\", got {currency!r}", source=source,
                             key="currency")
    table = data.get("hardware")
    if not isinstance(table, Mapping) or not table:
        raise PriceFileError(f"no prices: add one table per hardware kind, e.g.\n{_EXAMPLE}", source=source,
                             key="hardware")
    entries = {}
    for name, entry in table.items():
        key = f"hardware.{_bare(name)}"
        if not isinstance(entry, Mapping):
            raise PriceFileError(f"must be a table with per_device_hour, source and date, e.g.\n{_EXAMPLE}",
                                 source=source, key=key)
        extra = sorted(set(entry) - _ENTRY_KEYS)
        if extra:
            raise PriceFileError(f"unknown key {extra[0]!r}; a price has per_device_hour, source, date and note",
                                 source=source, key=f"{key}.{extra[0]}")
        value = entry.get("per_device_hour")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise PriceFileError(f"must be a positive number (the price of one device for one hour), got {value!r}",
                                 source=source, key=f"{key}.per_device_hour")
        for field in ("source", "date"):
            if isinstance(entry.get(field), datetime.date):        # date = 2025-06-01, unquoted
                entry = {**entry, field: entry[field].isoformat()}
            if not isinstance(entry.get(field), str) or not entry[field].strip():
                what = "where the price comes from" if field == "source" else "when it was read"
                raise PriceFileError(f"missing: say {what} (a string; prices change)", source=source,
                                     key=f"{key}.{field}")
        entries[str(name)] = Price(str(name), float(value), entry["source"], entry["date"], str(entry.get("note", "")))
    return Prices(source, currency, entries)
