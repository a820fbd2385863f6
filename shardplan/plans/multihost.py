"""One plan for every process under ``jax.distributed`` (JAX's multi-controller runtime).

Every process runs the same program, so every process must hold the same plan. Process 0 plans
(its progress, warnings and files are the only ones); the plan travels to the others as JSON
over a collective (``multihost_utils.broadcast_one_to_all``), each checks it against its own
trace of the step, and before the first step all processes compare the digests of the plans
they hold (:func:`check_same_plan`): plans that differ (a ``plan=`` file that is not the same
on every host, say) stop every process with an error within seconds, never a hung collective.
With one process all of this is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from shardplan.errors import PlanMismatchError, ShardplanError
from shardplan.plans.plan import Plan

_FAILED = b"shardplan-error:"


def _broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's ``data``, on every process (the others pass ``None``)."""
    from jax.experimental import multihost_utils
    source = jax.process_index() == 0
    size = np.array([len(data) if source else 0], dtype=np.int64)
    size = int(multihost_utils.broadcast_one_to_all(size)[0])
    buffer = np.zeros(size, dtype=np.uint8)
    if source:
        buffer[:] = np.frombuffer(data, dtype=np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer)))


def _agree(given: Plan | None) -> None:
    """The first collective of every path: each process says whether it was given a plan (and
    its digest). Processes that disagree on that raise before any other collective (one
    broadcasting a plan that no other waits for would hang them all)."""
    from jax.experimental import multihost_utils
    record = np.zeros(17, dtype=np.uint8)
    if given is not None:
        record[0] = 1
        record[1:] = np.frombuffer(bytes.fromhex(given.digest()[:32]), dtype=np.uint8)
    every = np.asarray(multihost_utils.process_allgather(record)).reshape(jax.process_count(), -1)
    modes = every[:, 0]
    if len(set(modes.tolist())) > 1:
        given_to = [p for p in range(len(modes)) if modes[p]]
        raise PlanMismatchError(
            f"the processes disagree on the plan: process(es) {given_to} were given plan=, the others plan the "
            f"step themselves (this is process {jax.process_index()}). Give every process the same plan= or none")
    _raise_if_differ(every[:, 1:])


def _raise_if_differ(digests: np.ndarray) -> None:
    differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
    if differ:
        raise PlanMismatchError(
            f"the plans differ between processes: process {differ[0]} holds plan {digests[differ[0]].tobytes().hex()}, "
            f"process 0 holds {digests[0].tobytes().hex()} (this is process {jax.process_index()}). Every process "
            "must run the same plan: give all of them the same plan= file, or let process 0 plan for all")


def check_given_plan(plan: Plan) -> None:
    """A plan given to every process (``plan=``): all processes must hold the same one."""
    if jax.process_count() > 1:
        _agree(plan)


def share_plan(make: Callable[[], tuple[Plan, object]], bind: Callable[[Plan], tuple[Plan, object]]):
    """``make()`` on process 0; on the others, its plan received and ``bind``-ed to their own
    trace, then checked to be the same everywhere. A failure on process 0 (an infeasible
    budget, say) is raised on every process."""
    if jax.process_count() == 1:
        return make()
    _agree(None)
    if jax.process_index() == 0:
        try:
            plan, graph = make()
        except BaseException as e:
            _broadcast_bytes(_FAILED + f"{type(e).__name__}: {e}".encode())
            raise
        _broadcast_bytes(plan.to_json().encode())
        bound_everywhere(lambda: None)
    else:
        data = _broadcast_bytes(None)
        if data.startswith(_FAILED):
            raise ShardplanError(f"process 0 could not plan the step: {data[len(_FAILED):].decode()}")
        plan, graph = bound_everywhere(lambda: bind(Plan.from_json(data.decode(),
                                                                   source="the plan from process 0")))
    _check_same(plan)
    return plan, graph


def bound_everywhere(bind: Callable):
    """``bind()`` (a plan checked against this process's trace) on every process; if it fails on
    any, every process raises (the failing ones their own error), instead of the others waiting
    in the step's first collective for ever."""
    if jax.process_count() == 1:
        return bind()
    from jax.experimental import multihost_utils
    error = None
    try:
        result = bind()
    except ShardplanError as e:
        error, result = e, None
    ok = np.asarray(multihost_utils.process_allgather(np.array([error is None], dtype=np.uint8))).ravel()
    if error is not None:
        raise error
    failed = [p for p in range(len(ok)) if not ok[p]]
    if failed:
        raise PlanMismatchError(f"process(es) {failed} could not use the plan (their own error says why); "
                                f"process {jax.process_index()} stops too")
    return result


def _check_same(plan: Plan) -> None:
    """Every process holds a plan with the same :meth:`Plan.digest`, or every process raises."""
    from jax.experimental import multihost_utils
    mine = np.frombuffer(bytes.fromhex(plan.digest()[:32]), dtype=np.uint8)
    _raise_if_differ(np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1))


def global_batch(plan: Plan, local, *, arg: int = 1, mesh: jax.sharding.Mesh | None = None):
    """Argument ``arg`` of the planned step as global arrays, from each process's own share.

    ``local`` has the argument's pytree structure; each leaf holds this process's part of the
    global leaf: the rows (or other slices) of the devices this process owns under the plan's
    sharding, in order (``jax.make_array_from_process_local_data``). With one process it is
    the whole leaf. The plan must be bound to the step (``f.make_plan(...)`` or a first call).
    """
    shardings = plan.in_shardings(mesh)
    if not 0 <= arg < len(shardings):
        raise ValueError(f"arg={arg}: the step takes {len(shardings)} positional arguments")
    rows = iter(plan.inputs[sum(len(jax.tree.leaves(s)) for s in shardings[:arg]):])
    leaves, tree = jax.tree.flatten(local)
    targets = jax.tree.leaves(shardings[arg])
    if len(leaves) != len(targets):
        raise PlanMismatchError(f"argument {arg} has {len(targets)} leaves in the plan, the local batch {len(leaves)}")
    out = [jax.make_array_from_process_local_data(sh, np.asarray(x), next(rows).shape)
           for x, sh in zip(leaves, targets)]
    return jax.tree.unflatten(tree, out)


def local_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The slice of a global array of ``shape`` whose shards this process's devices hold
    (contiguous under a mesh laid out process by process): what to load on this host."""
    index = sharding.addressable_devices_indices_map(shape).values()
    out = []
    for d, n in enumerate(shape):
        starts = [i[d].start or 0 for i in index]
        stops = [n if i[d].stop is None else i[d].stop for i in index]
        out.append(slice(min(starts), max(stops)))
    return tuple(out)
