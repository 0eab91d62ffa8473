"""The parameters of the elastic fault suite's programs: one (rows, 1024) float32 tensor, ``$JRESHARD_MIB``
MiB, a value per version; and the hash that tells versions apart."""

from __future__ import annotations

import hashlib
import os

import numpy as np


def shape() -> tuple[int, int]:
    rows = max(2, int(float(os.environ.get("JRESHARD_MIB", "1")) * 256))
    return rows - rows % 2, 1024


def value(v: int) -> np.ndarray:
    r, c = shape()
    return np.arange(r * c, dtype=np.float32).reshape(r, c) % 8191 + 10000.0 * v


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def held(tree, steps: int) -> list[int]:
    """Every version (0..steps) whose value ``tree`` holds: exactly one, or it is a mix."""
    h = digest(np.asarray(tree["w"]))
    return [v for v in range(steps + 1) if digest(value(v)) == h]
