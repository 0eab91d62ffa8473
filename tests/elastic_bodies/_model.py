"""The parameters both sides of the elastic tests declare, and their exact values at each version."""

import os

import numpy as np

SHAPES = {"embed": (64, 16), "wq": (16, 16), "w1": (16, 32), "w2": (32, 16), "norm": (16,)}


def value(name: str, shape: tuple, version: int) -> np.ndarray:
    """A version differs from the one before in about 2 of every 11 elements (deltas are on by default);
    with ``$JRESHARD_DENSE`` set, in every element (deltas do not pay: ``delta="auto"`` backs off)."""
    salt = sum(map(ord, name))
    i = np.arange(np.prod(shape))
    if os.environ.get("JRESHARD_DENSE"):
        return ((i % 997) + salt * 0.5 + version * 0.25).astype(np.float32).reshape(shape)
    return ((i % 997) + salt * 0.5 + version * 1000 * (i % 11 == version % 11)).astype(np.float32).reshape(shape)


def options():
    from jreshard import Options

    return Options(timeout_s=10.0, chunk_bytes=256, staging_bytes=1 << 14)
