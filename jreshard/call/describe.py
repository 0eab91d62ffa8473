"""Values in error messages: type, dtype, shape and sharding, never the data of an array."""

from __future__ import annotations

import jax
import numpy as np

from jreshard.types import TreeLeaf

__all__ = ["describe"]

_SMALL = (bool, int, float, complex, np.generic, jax.sharding.Sharding, jax.sharding.PartitionSpec)


def describe(v: TreeLeaf) -> str:
    """A short description of a value for messages: its type, dtype and shape (and sharding), never its data."""
    if isinstance(v, jax.ShapeDtypeStruct):
        return f"ShapeDtypeStruct({v.dtype}{list(v.shape)}, sharding={v.sharding})"
    if isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer):
        return f"{type(v).__name__} {v.dtype}{list(v.shape)} on {v.sharding}"
    if isinstance(v, np.ndarray):
        return f"{type(v).__name__} {v.dtype}{list(v.shape)}"
    if v is None or isinstance(v, _SMALL):
        return f"{v!r}"
    text = repr(v)
    return f"{type(v).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
