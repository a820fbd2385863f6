"""Planning many steps in one process (a notebook, a sweep) does not grow its memory without bound."""

import gc
import os

import jax
import numpy as np
import optax
import pytest

import shardplan
from shardplan.models.train import reference


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_ten_plans_in_one_process_keep_memory_bounded(tmp_path):
    meshes = [{"data": 8}, {"data": 2, "model": 4}, {"data": 4, "model": 2}, {"model": 8}]
    cases = [(model, scan, opt, meshes[k % len(meshes)])
             for k, (model, scan, opt) in enumerate([(m, s, o) for m in ("gpt-tiny", "mlp-tiny")
                                                     for s in (False, True) for o in ("adamw", "sgd")][:5] * 2)]
    rss = []
    for model, scan, opt, axes in cases:
        tx = optax.adamw(1e-3) if opt == "adamw" else optax.sgd(0.1)
        ref = reference(model, scan=scan, optimizer=tx)
        step = shardplan.auto(ref.train_step, mesh=shardplan.load_mesh("cpu-8", axes=axes), donate_argnums=(0,),
                              time_limit=2, cache=tmp_path)
        state, metrics = step(ref.init(jax.random.key(0)), ref.batch(8))
        assert np.isfinite(float(metrics["loss"]))
        del step, state, metrics, ref
        gc.collect()
        rss.append(_rss_mib())
    assert rss[-1] - rss[0] <= 300, f"resident memory after each plan (MiB): {[round(r) for r in rss]}"
