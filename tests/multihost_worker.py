"""One process of the 2-process tests (tests/plans/test_multihost.py): 4 CPU devices, gloo collectives.

    python tests/multihost_worker.py PROCESS_ID PORT MODE OUT

MODE ``plan`` (or ``plan-batch:N``: this process traces batch N; ``pipeline``: in a 2-stage
pipeline): the step is planned by process 0 only (the solver is refused on process 1) and
three steps run on a global batch assembled from each process's rows; MODE ``given:PATH``:
the step runs under the plan file PATH. Writes a JSON result to OUT.
"""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

pid, port, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)

import shardplan  # noqa: E402
from shardplan.models.train import reference  # noqa: E402
from shardplan.planning import planner  # noqa: E402

if pid != 0:
    def refuse(*a, **k):
        raise AssertionError("the solver ran on process 1")
    planner.plan_jaxpr = refuse

HARDWARE = shardplan.load_mesh("cpu-8", axes={"data": 2, "model": 4})
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
ref = reference("gpt-tiny", scan=True)
result = {"process": pid}
start = time.perf_counter()
try:
    batch_size = 8
    if mode == "pipeline":            # a 2-stage pipeline: the stage axis crosses the processes
        f = shardplan.auto(ref.train_step, mesh=mesh, hardware=HARDWARE, donate_argnums=(0,), cache=False,
                           pipeline=shardplan.PipelineConfig(2, 4))
    elif mode.startswith("plan"):     # "plan", or "plan-batch:N": this process traces batch N instead
        f = shardplan.auto(ref.train_step, mesh=mesh, hardware=HARDWARE, donate_argnums=(0,), cache=False)
        batch_size = int(mode.split(":")[1]) if ":" in mode else 8
    else:
        f = shardplan.auto(ref.train_step, mesh=mesh, plan=mode.split(":", 1)[1], donate_argnums=(0,))
    plan = f.make_plan(jax.eval_shape(ref.init, jax.random.key(0)), ref.batch(batch_size, abstract=True))
    if plan.pipeline is not None:     # the plan's own axes (a stage axis split off), over the same devices
        mesh = plan.jax_mesh()
    state = jax.jit(ref.init, out_shardings=plan.in_shardings(mesh)[0])(jax.random.key(0))
    whole = jax.tree.map(np.asarray, ref.batch(8))       # what every host could load; each takes its rows
    shardings = plan.in_shardings(mesh)[1]
    local = jax.tree.map(lambda x, sh: x[shardplan.local_rows(sh, x.shape)], whole, shardings)
    batch = shardplan.global_batch(plan, local, arg=1, mesh=mesh)
    losses = []
    for _ in range(3):
        state, metrics = f(state, batch)
        losses.append(float(metrics["loss"]))
    result.update(digest=plan.digest(), losses=losses,
                  local_rows=[str(shardplan.local_rows(sh, x.shape)) for x, sh in
                              zip(jax.tree.leaves(whole), jax.tree.leaves(shardings))])
except shardplan.ShardplanError as e:
    result.update(error=f"{type(e).__name__}: {e}")
result["seconds"] = time.perf_counter() - start
with open(out, "w") as fh:
    json.dump(result, fh)
