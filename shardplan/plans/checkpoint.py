"""Checkpoints of a train state on its planned shardings, with orbax-checkpoint.

``save(path, state)`` writes a pytree of (sharded) arrays; ``restore(path, abstract_state,
shardings)`` reads it back with every array on the sharding given for it, resharded on load: the
checkpoint holds whole arrays, not one mesh's shards, so a state saved under one plan or mesh shape
restores under any other.

>>> plan = step.make_plan(abstract_state, abstract_batch)                     # doctest: +SKIP
>>> checkpoint.save("/ckpt/run1", state, step=1000)                           # doctest: +SKIP
>>> state = checkpoint.restore("/ckpt/run1", abstract_state, plan.in_shardings()[0])  # doctest: +SKIP

Both are collective in a multi-host run: every process calls them with the same path (a
filesystem all hosts share, or ``gs://...``); orbax writes each array's shards from the processes
that hold them and coordinates the commit. ``save`` returns once the checkpoint is complete.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from shardplan.errors import ShardplanError

__all__ = ["CheckpointError", "CheckpointExistsError", "CheckpointMismatchError", "CheckpointNotFoundError",
           "latest_step", "restore", "save"]


class CheckpointError(ShardplanError):
    """A checkpoint cannot be written or read as asked; ``path`` is the checkpoint's directory."""

    def __init__(self, message: str, *, path: str):
        super().__init__(message)
        self.path = path


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No finished checkpoint at ``path`` (or not the ``step`` asked for)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """``save`` would overwrite a checkpoint (or a step) that is already there."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint and the target differ; ``leaf`` is the first leaf path (dotted) where they do."""

    def __init__(self, message: str, *, path: str, leaf: str | None = None):
        super().__init__(message, path=path)
        self.leaf = leaf


# -- paths -------------------------------------------------------------------------------------------
def _path(path) -> epath.Path:
    """orbax wants absolute paths; ``gs://...`` and other URLs pass as they are."""
    text = os.fspath(path)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def _manager(root: epath.Path, *, create: bool) -> ocp.CheckpointManager:
    """A synchronous manager of numbered steps under ``root`` (orbax's ``root/<step>/`` layout)."""
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=create)
    return ocp.CheckpointManager(root, options=options, item_handlers=ocp.StandardCheckpointHandler())


def _steps(root: epath.Path) -> list[int]:
    if not root.is_dir():
        return []
    with _manager(root, create=False) as m:
        return sorted(m.all_steps())


def latest_step(path) -> int | None:
    """The highest finished step saved under ``path`` with ``save(..., step=)``; ``None`` if none."""
    steps = _steps(_path(path))
    return steps[-1] if steps else None


# -- save --------------------------------------------------------------------------------------------
def _dotted(keypath) -> str:
    return ".".join(ocp.tree.str_keypath(keypath))


def save(path, state: Any, *, step: int | None = None) -> str:
    """Write ``state`` (a pytree of ``jax.Array``, numpy arrays, Python scalars, ``None``) and wait
    until it is complete; returns the checkpoint's directory.

    ``step=None``: the checkpoint is ``path`` itself. ``step=N``: it is step ``N`` under ``path``
    (orbax ``CheckpointManager`` layout, so steps accumulate and ``restore`` finds the latest).
    Existing checkpoints are never overwritten (:class:`CheckpointExistsError`). orbax writes into
    a temporary directory and renames it (or, on object stores, writes a commit marker) only once
    every array is written, so an interrupted or failed save leaves nothing that reads as a
    checkpoint; a failed save raises. Save before the state goes into a step that donates it.
    """
    where = _path(path)
    for keypath, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(x, jax.Array) and x.is_deleted():
            raise CheckpointError(f"cannot save {_dotted(keypath)}: the array was deleted (donated to a step that "
                                  "ran since); save the state before passing it to a donating step",
                                  path=str(where))
    if step is None:
        if where.exists():
            raise CheckpointExistsError(f"{where} already exists; save to a new path (or pass step=)",
                                        path=str(where))
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:
            c.save(where, args=ocp.args.StandardSave(state))
        return str(where)
    step = int(step)
    with _manager(where, create=True) as m:
        if step in m.all_steps():
            raise CheckpointExistsError(f"step {step} already exists under {where}", path=str(where))
        if not m.save(step, args=ocp.args.StandardSave(state), force=True):
            raise CheckpointError(f"orbax did not save step {step} under {where}", path=str(where))
        m.wait_until_finished()
    return str(where / str(step))


# -- restore -----------------------------------------------------------------------------------------
def _restore_target(abstract_state, shardings, where: epath.Path):
    """``abstract_state``'s leaves as orbax restore targets: arrays and ``ShapeDtypeStruct`` become
    ``ShapeDtypeStruct`` on their sharding; Python scalars and numpy arrays stay as they are."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        shard_leaves = [shardings] * len(leaves)
    else:
        sharded, shard_tree = jax.tree_util.tree_flatten_with_path(shardings)
        shard_leaves = [sh for _, sh in sharded]
        if shard_tree != treedef:
            a, b = ([_dotted(k) for k, _ in flat] for flat in (leaves, sharded))
            first = next((x for x, y in zip(a, b) if x != y), None)
            if first is None and len(a) != len(b):
                first = (a if len(a) > len(b) else b)[min(len(a), len(b))]
            where_ = f"first difference at {first}" if first else "same leaf paths, other node types"
            raise CheckpointMismatchError(
                f"shardings do not mirror abstract_state ({where_}); for a planned step pass "
                "plan.in_shardings(mesh)[0], the state argument's shardings", path=str(where), leaf=first)
    targets = []
    for (keypath, x), sh in zip(leaves, shard_leaves):
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            sh = sh if sh is not None else getattr(x, "sharding", None)
            if not isinstance(sh, jax.sharding.Sharding):
                raise CheckpointMismatchError(
                    f"no sharding for {_dotted(keypath)}: pass shardings= (plan.in_shardings(mesh)[0]) or "
                    "jax.ShapeDtypeStruct leaves with .sharding set", path=str(where), leaf=_dotted(keypath))
            x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        targets.append(x)
    return jax.tree_util.tree_unflatten(treedef, targets)


def _check_against(saved_tree, target, where: epath.Path) -> None:
    """The first leaf path where the checkpoint's tree and the target differ, as a clear error."""
    saved = ocp.tree.to_flat_dict(saved_tree)
    wanted = {tuple(ocp.tree.str_keypath(k)): x for k, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    for key, x in wanted.items():
        name = ".".join(key)
        if key not in saved:
            raise CheckpointMismatchError(f"the checkpoint at {where} has no leaf {name} (the target has it)",
                                          path=str(where), leaf=name)
        meta = saved[key]
        shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
        if shape is None or not hasattr(x, "shape"):
            continue
        if tuple(shape) != tuple(x.shape):
            raise CheckpointMismatchError(f"{name}: the checkpoint at {where} has shape {tuple(shape)}, the target "
                                          f"{tuple(x.shape)}", path=str(where), leaf=name)
        # A Python scalar is stored as a 64-bit scalar; it restores into any scalar dtype.
        if type(meta) is not ocp.metadata.ScalarMetadata and np.dtype(dtype) != np.dtype(x.dtype):
            raise CheckpointMismatchError(f"{name}: the checkpoint at {where} has dtype {np.dtype(dtype)}, the target "
                                          f"{np.dtype(x.dtype)} (restore as saved, then cast)",
                                          path=str(where), leaf=name)
    for key in saved:
        if key not in wanted:
            name = ".".join(key)
            raise CheckpointMismatchError(f"the checkpoint at {where} has a leaf {name} the target does not",
                                          path=str(where), leaf=name)


def restore(path, abstract_state: Any, shardings: Any = None, *, step: int | None = None) -> Any:
    """Read a checkpoint written by :func:`save` into ``abstract_state``'s structure, each array on
    its sharding in ``shardings``, whatever mesh or plan it was saved under.

    ``abstract_state``: the state's pytree of ``jax.ShapeDtypeStruct`` (``jax.eval_shape(init, rng)``)
    or arrays; only structure, shapes and dtypes are used. Python scalars and numpy arrays among its
    leaves come back as such. ``shardings``: a matching pytree of ``jax.sharding.Sharding`` -- for a
    planned step, ``plan.in_shardings(mesh)[0]`` (the state argument's) -- or one ``Sharding`` for
    every array; ``None``: each leaf's own ``.sharding``. ``step``: which step under ``path``;
    ``None``: ``path`` itself if it is a checkpoint, else the latest step under it.

    Raises :class:`CheckpointNotFoundError` when there is no finished checkpoint there and
    :class:`CheckpointMismatchError` naming the first leaf whose path, shape or dtype differs.
    """
    where = _path(path)
    if not where.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {where}: the path does not exist", path=str(where))
    target = _restore_target(abstract_state, shardings, where)
    steps = _steps(where)
    if step is None and steps:      # a root of numbered steps (a checkpoint itself has none)
        step = steps[-1]
    if step is not None:
        step = int(step)
        if step not in steps:
            raise CheckpointNotFoundError(f"no finished step {step} under {where} (steps there: {steps or 'none'})",
                                          path=str(where))
        with _manager(where, create=False) as m:
            _check_against(m.item_metadata(step).tree, target, where / str(step))
            return m.restore(step, args=ocp.args.StandardRestore(target))
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:
        meta = c.metadata(where).item_metadata if ocp.step.is_path_finalized(where) else None
        if meta is None:
            raise CheckpointNotFoundError(f"no finished checkpoint at {where} (no orbax checkpoint there, nor "
                                          "steps saved with step=)", path=str(where))
        _check_against(meta.tree, target, where)
        return c.restore(where, args=ocp.args.StandardRestore(target))
