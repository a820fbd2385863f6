"""A train step named on the command line: ``--step path/to/file.py:make`` or ``--step package.module:make``.

``make()`` is the user's own function, called with no arguments. It returns the step and the
arguments of one call, ``(step, args)``, or with ``jax.jit``'s options for it, ``(step, args,
{"donate_argnums": (0,)})`` (``donate_argnums`` and ``static_argnums`` are taken). The
arguments may be arrays or ``jax.ShapeDtypeStruct``\\ s (nothing need be allocated: planning
only traces the step)::

    def make():
        state = jax.eval_shape(create_state, jax.random.key(0))
        batch = {"tokens": jax.ShapeDtypeStruct((256, 2049), jnp.int32)}
        return train_step, (state, batch), {"donate_argnums": (0,)}

Every process of a multi-host run imports and calls it the same way, so it must build the same
step and arguments everywhere (no process-dependent shapes).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable

from shardplan.errors import ShardplanError

JIT_OPTIONS = ("donate_argnums", "static_argnums")


class StepError(ShardplanError):
    """``--step`` names no function, or its function does not return a step and its arguments."""


@dataclasses.dataclass(frozen=True)
class NamedStep:
    fn: Callable
    args: tuple
    jit: dict                   # jax.jit options: donate_argnums, static_argnums


def load_step(reference: str) -> NamedStep:
    """The step ``reference`` names (``FILE.py:FUNC`` or ``MODULE:FUNC``), from calling ``FUNC()``."""
    where, sep, func = reference.rpartition(":")
    if not sep or not where or not func.isidentifier():
        raise StepError(f"--step {reference!r}: give FILE.py:FUNCTION or MODULE:FUNCTION, a function that returns "
                        "(step, args) or (step, args, {'donate_argnums': ...})")
    module = _module(where, reference)
    make = getattr(module, func, None)
    if not callable(make):
        raise StepError(f"--step {reference!r}: {where} has no function {func!r}")
    made = make()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise StepError(f"--step {reference!r}: {func}() returned {type(made).__name__}; return (step, args) or "
                        "(step, args, {'donate_argnums': ...}), args a tuple of the step's arguments")
    fn, args, jit = made if len(made) == 3 else (*made, {})
    if not callable(fn):
        raise StepError(f"--step {reference!r}: the step {func}() returned first is a {type(fn).__name__}, "
                        "not a function")
    if not isinstance(args, (tuple, list)):
        raise StepError(f"--step {reference!r}: {func}() returned args as a {type(args).__name__}; give a tuple of "
                        "the step's arguments, e.g. (state, batch)")
    if not isinstance(jit, dict) or set(jit) - set(JIT_OPTIONS):
        unknown = sorted(set(jit) - set(JIT_OPTIONS)) if isinstance(jit, dict) else jit
        raise StepError(f"--step {reference!r}: its jit options {unknown!r} are not among {', '.join(JIT_OPTIONS)}")
    return NamedStep(fn, tuple(args), dict(jit))


def _module(where: str, reference: str):
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise StepError(f"--step {reference!r}: no file {where}")
        name = "_shardplan_step_" + os.path.splitext(os.path.basename(where))[0]
        spec = importlib.util.spec_from_file_location(name, where)
        module = importlib.util.module_from_spec(spec)
        # Its own directory first, as `python FILE.py` would have it: its sibling modules import.
        folder = os.path.dirname(os.path.abspath(where))
        sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(folder)
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name and where.startswith(e.name):
            raise StepError(f"--step {reference!r}: no module {where!r} on the Python path (give a FILE.py path, "
                            "or run from the directory that holds the module)") from None
        raise
