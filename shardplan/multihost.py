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
from shardplan.plan import Plan

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


def share_plan(make: Callable[[], tuple[Plan, object]], bind: Callable[[Plan], tuple[Plan, object]]):
    """``make()`` on process 0; on the others, its plan received and ``bind``-ed to their own
    trace. A failure on process 0 (an infeasible budget, say) is raised on every process."""
    if jax.process_count() == 1:
        return make()
    if jax.process_index() == 0:
        try:
            plan, graph = make()
        except BaseException as e:
            _broadcast_bytes(_FAILED + f"{type(e).__name__}: {e}".encode())
            raise
        _broadcast_bytes(plan.to_json().encode())
        return plan, graph
    data = _broadcast_bytes(None)
    if data.startswith(_FAILED):
        raise ShardplanError(f"process 0 could not plan the step: {data[len(_FAILED):].decode()}")
    return bind(Plan.from_json(data.decode(), source="the plan from process 0"))


def check_same_plan(plan: Plan) -> None:
    """Every process holds a plan with the same :meth:`Plan.digest`, or every process raises."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils
    mine = np.frombuffer(bytes.fromhex(plan.digest()), dtype=np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    differ = [p for p in range(len(every)) if not np.array_equal(every[p], every[0])]
    if differ:
        raise PlanMismatchError(
            f"the plans differ between processes: process {differ[0]} holds plan {every[differ[0]].tobytes().hex()}, "
            f"process 0 holds {every[0].tobytes().hex()} (this is process {jax.process_index()}). Every process "
            "must run the same plan: give all of them the same plan= file, or let process 0 plan for all")
