"""Plan files: the text a :class:`~shardplan.plans.plan.Plan` is saved as, read back and checked.

A plan file is JSON with a ``format`` and a ``schema`` (:data:`PLAN_FORMAT`, :data:`SCHEMA_VERSION`);
it is written atomically (a reader never sees half a file) and read with an error that names the
file and what is wrong with it (:class:`~shardplan.errors.PlanFileError`).
"""

from __future__ import annotations

import json
import os
import tempfile

from shardplan.errors import PlanFileError

PLAN_FORMAT = "shardplan.plan"
SCHEMA_VERSION = 2


def parse(text: str, source: str) -> dict:
    """The plan data of a plan file's text; :class:`PlanFileError` naming ``source`` where it is not
    JSON (truncated?), not a plan, or of another schema."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{source}: not valid JSON (truncated?): {e.msg} (line {e.lineno}, "
                            f"column {e.colno})") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(f"{source}: not a shardplan plan (format {found!r}, expected {PLAN_FORMAT!r})")
    if data.get("schema") != SCHEMA_VERSION:
        raise PlanFileError(f"{source}: plan schema {data.get('schema')!r}, this shardplan reads schema "
                            f"{SCHEMA_VERSION}: plan the step again")
    return data


def dump(data: dict) -> str:
    """The text of a plan file holding ``data`` (its format and schema stamped on)."""
    return json.dumps({"format": PLAN_FORMAT, "schema": SCHEMA_VERSION, **data}, indent=1)


def read(path: str) -> str:
    """A plan file's text; :class:`PlanFileError` naming the file where it cannot be read as text."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise PlanFileError(f"{path}: cannot read the plan file ({e.strerror})") from None
    except UnicodeDecodeError:
        raise PlanFileError(f"{path}: not a text file, so not a shardplan plan") from None


def write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file beside it, renamed over it; nothing
    is left behind where the write fails."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".shardplan-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)          # as open() would make it (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
