"""The plan as a record and everything that stores or shares it: plan files, the on-disk cache, checkpoints on
the planned shardings, one plan for every process under ``jax.distributed``."""
