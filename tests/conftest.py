import os

import pytest

# 8 fake CPU devices for real sharded runs; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Plans cached on disk go to a directory of this test session's own, never the user's cache; under
# pytest-xdist (-n 2), one of each worker's own: a test that expects to plan must not read a plan
# another worker cached a moment before.
if "SHARDPLAN_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["SHARDPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardplan-test-cache-")
    # Removed when the process that made it ends (the xdist workers' are inside it).
    atexit.register(shutil.rmtree, os.environ["SHARDPLAN_CACHE_DIR"], True)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["SHARDPLAN_CACHE_DIR"] = os.path.join(os.environ["SHARDPLAN_CACHE_DIR"],
                                                     os.environ["PYTEST_XDIST_WORKER"])


# -- test tiers (markers registered in pyproject.toml) -------------------------------------------
# Files of unit tests: rules, cost formulas, solver pieces, plan files, error paths. Their tests
# that plan a model end to end or compile one carry @pytest.mark.slow; every test of the other
# files plans or compiles models (parity, user steps, families, targets, benchmarks) and is slow.
FAST_FILES = frozenset(f"test_{name}.py" for name in """
    api audit checkpoint cli constraints context cost einsum_attention exact footprint graph hardware hlo layout
    liveness loop_ties manual mesh moe_sort offload plan_files planner recompute relayout rewrites sizes solver
    splitk tpu_bf16_pass traffic unrolled weak_scaling xla_bugs layering families fidelity rules report""".split())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name not in FAST_FILES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
        if any("[aot]" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.compile)
        if item.path.name == "test_multihost.py":
            item.add_marker(pytest.mark.multihost)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n 2``, each test file runs whole in one worker: its module fixtures (planned and
    compiled models) are made once."""
    from xdist.scheduler import LoadFileScheduling
    return LoadFileScheduling(config, log)
