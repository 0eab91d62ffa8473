"""The names of the values every layer passes around, in one place.

They are aliases for readers and type checkers; none of them is checked at run time.
"""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Device", "PyTree", "Rank", "ShardKey", "Sharding"]

PyTree: TypeAlias = Any
"""A jax pytree: nested dicts, lists, tuples (and registered nodes) with arrays, shardings or
``None`` at the leaves."""

Device: TypeAlias = Any
"""A ``jax.Device``."""

Sharding: TypeAlias = Any
"""A ``jax.sharding.Sharding``."""

Rank = int
"""A device taking part in a transfer (``device.id`` in one jax program)."""

ShardKey = tuple[int, int]
"""``(tensor index, rank)``: one shard of one tensor of a transfer."""
