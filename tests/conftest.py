import os

# 8 fake CPU devices for real sharded runs; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Plans cached on disk go to a directory of this test session's own, never the user's cache.
if "SHARDPLAN_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["SHARDPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="shardplan-test-cache-")
