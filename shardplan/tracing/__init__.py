"""From the user's step to a graph: tracing as ``jax.jit`` takes it, walking the jaxpr, layer stacks, manual
(``shard_map``) regions, rewrites, and attention written out as einsums."""
