"""Plans cached on disk, keyed by what determines them: the traced step, the mesh, the budget, the options.

A plan depends only on the step's jaxpr (shapes, dtypes, equations; not the values of its
constants), which inputs are donated and returned anew, the :class:`~shardplan.devices.mesh.MeshSpec`
it is priced on, the memory budget and the planner's options; the solver is deterministic. So a
second planning of the same step, in this process or the next, reads the plan back instead of
solving. The directory is ``$SHARDPLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardplan``, else
``~/.cache/shardplan``; ``cache=False`` on :func:`shardplan.auto` / :func:`shardplan.plan` turns it
off. An entry that cannot be read back is ignored with a warning and replaced, never trusted.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import warnings

import jax

from shardplan.plans.plan import Plan

SCHEMA = "shardplan.plans.cache/1"


def cache_dir(cache) -> str | None:
    """The directory for ``cache`` (``True``: the default one, a path: that one, ``False``/``None``: off)."""
    if cache is False or cache is None:
        return None
    if cache is not True:
        return os.fspath(cache)
    if os.environ.get("SHARDPLAN_CACHE_DIR"):
        return os.environ["SHARDPLAN_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardplan")


def plan_key(traced, mesh_spec, budget: int, options) -> str:
    """A hash of everything a plan depends on."""
    h = hashlib.sha256()
    for part in (SCHEMA, str(traced.closed.jaxpr), [(c.shape, str(c.dtype)) for c in traced.closed.consts
                                                      if hasattr(c, "shape")],
                 traced.names, traced.arg_of, traced.donated, traced.state_pairs, traced.out_names,
                 repr(mesh_spec), budget, repr(options), jax.__version__, _code_version()):
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def load(directory: str | None, key: str) -> Plan | None:
    if directory is None:
        return None
    path = os.path.join(directory, key + ".json")
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return Plan.from_json(f.read())
    except Exception as e:   # any unreadable entry: say so, then plan afresh (the entry is rewritten)
        warnings.warn(f"shardplan: ignoring the unreadable cached plan {path} ({type(e).__name__}: {e}); "
                      "planning again", stacklevel=3)
        return None


def store(directory: str | None, key: str, plan: Plan) -> None:
    """Write the plan atomically (a reader never sees half a file); only process 0 writes."""
    if directory is None or jax.process_index() != 0:
        return
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(plan.to_json())
        os.replace(tmp, os.path.join(directory, key + ".json"))
        tmp = None
    except OSError as e:   # a cache that cannot be written only costs time
        warnings.warn(f"shardplan: cannot write the plan cache in {directory} ({e.strerror}); "
                      "pass cache=False to stop trying", stacklevel=3)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


@functools.cache
def _code_version() -> str:
    """A hash of shardplan's own source: a changed cost model or solver never reads old plans."""
    h = hashlib.sha256()
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder, _, names in sorted(os.walk(package)):
        for name in sorted(names):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(os.path.relpath(os.path.join(folder, name), package).encode() + b"\0" + f.read())
    return h.hexdigest()[:16]
