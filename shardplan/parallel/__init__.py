"""The parallelism families beyond per-tensor shardings: recomputation and offload, pipelines, context
(sequence) parallel attention, the protocol the search composes them by, and their defaults."""
