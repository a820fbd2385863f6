"""Typed exceptions. Each carries the offending objects and says how to fix the input."""

from __future__ import annotations


class ShardplanError(Exception):
    """Base class of every error shardplan raises on purpose."""


class MeshConfigError(ShardplanError, ValueError):
    """A mesh file, preset name or axis override is wrong.

    ``key`` names the config key (``"device.hbm_bytes"``, ``"axes[1].size"``) when one is at fault.
    """

    def __init__(self, message: str, *, source: str | None = None, key: str | None = None):
        where = " ".join(x for x in (source and f"{source}:", key and f"[{key}]") if x)
        super().__init__(f"{where} {message}".strip())
        self.source = source
        self.key = key


class InfeasibleBudgetError(ShardplanError):
    """No plan fits ``memory_budget``; ``min_feasible_bytes`` is the smallest budget that works;
    ``floor_bytes``, where known, the step's arguments split evenly over every device: no plan,
    whatever its pipeline, recomputation or sequence split, holds less."""

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int | None,
                 largest_tensors: list[tuple[str, int]], floor_bytes: int | None = None):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.largest_tensors = largest_tensors
        self.floor_bytes = floor_bytes

    def __reduce__(self):
        # copy and pickle: rebuilt from its message and attributes (its keyword-only ones included).
        return _rebuilt, (type(self), self.args), dict(self.__dict__)


def _rebuilt(cls, args):
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    return error


class PlanMismatchError(ShardplanError, ValueError):
    """A plan is applied to arguments of another structure, shape or dtype than it was made for."""


class PlanFileError(ShardplanError, ValueError):
    """A plan file cannot be read: missing, truncated, not a shardplan plan, or edited into an
    inconsistent state. The message names the file and the problem."""


class InvalidPlanError(ShardplanError, ValueError):
    """A plan whose parts do not agree, found when it is built: a PartitionSpec naming a mesh axis
    the plan's mesh lacks, a split that does not divide its dimension, a pipeline or context split
    its mesh cannot hold. The message names the tensor or setting."""


class DeviceCountError(ShardplanError, RuntimeError):
    """The mesh needs more devices than ``jax.devices()`` offers."""
