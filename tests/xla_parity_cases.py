"""Sharding kinds and dtypes for the xla backend's parity tests (tests/test_xla.py).

A reusable list (a parity suite for every backend can share it): :data:`DTYPES` names every dtype jax
holds that a transfer must move bit for bit, :data:`PAIRS` the sharding kinds (``NamedSharding``
with several specs and meshes, replicated and partially replicated, ``SingleDeviceSharding``,
``GSPMDSharding``, device orders, disjoint and overlapping device sets, device subsets), each
built from the 8 CPU devices of the test process. :func:`host_value` gives a deterministic value
of any of them (raw random bytes for the floats, so NaN payloads and negative zeros are in it),
and :func:`same_bits` is the oracle's comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

__all__ = ["DTYPES", "LANE_DTYPES", "PAIRS", "X64_DTYPES", "Pair", "host_value", "same_bits", "same_values"]

# dtypes that need jax_enable_x64 (jax.enable_x64(True) around the test).
X64_DTYPES = ("int64", "uint64", "float64", "complex128")
SUB_BYTE = ("int4", "uint4", "int2", "uint2", "float4_e2m1fn")
FLOAT8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e8m0fnu")
DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "uint8",
    "uint16",
    "uint32",
    "float16",
    "bfloat16",
    "float32",
    "complex64",
    *FLOAT8,
    *SUB_BYTE,
    *X64_DTYPES,
)

# A few dtypes that travel as bytes in different ways (a widened sub-byte value, 1 and 2-byte lanes, a
# complex's two parts): for sweeps over sharding kinds, where compiling all of DTYPES for every pair
# would cost too long (a few seconds a pair on 2 cores); every dtype runs on a few pairs.
LANE_DTYPES = ("int4", "float8_e5m2", "bfloat16", "complex64")


@dataclasses.dataclass(frozen=True)
class Pair:
    """A source and a destination sharding kind for arrays of ``shape``, built from the devices."""

    name: str
    shape: tuple[int, ...]
    src: Callable[[Sequence[Any]], jax.sharding.Sharding]
    dst: Callable[[Sequence[Any]], jax.sharding.Sharding]


def _named(devs: Sequence[Any], idx: Sequence[int], mesh_shape: tuple[int, ...], axes: tuple[str, ...], *spec: Any):
    mesh = Mesh(np.array([devs[i] for i in idx], dtype=object).reshape(mesh_shape), axes)
    return NamedSharding(mesh, P(*spec))


def _gspmd(named: NamedSharding, ndim: int) -> jax.sharding.Sharding:
    from jax._src.sharding_impls import GSPMDSharding  # not public in jax 0.10; the kind still exists

    return GSPMDSharding(tuple(named._device_assignment), named._to_xla_hlo_sharding(ndim))


R8, R4A, R4B = range(8), range(4), range(4, 8)
PAIRS: tuple[Pair, ...] = (
    Pair(
        "fsdp4 -> dp2 x tp2, disjoint",
        (8, 16),
        lambda d: _named(d, R4A, (4,), ("x",), "x"),
        lambda d: _named(d, R4B, (2, 2), ("dp", "tp"), None, "tp"),
    ),
    Pair(
        "replicated -> sharded, disjoint",
        (8, 16),
        lambda d: _named(d, R4A, (4,), ("x",)),
        lambda d: _named(d, R4B, (4,), ("y",), "y"),
    ),
    Pair(
        "partially replicated -> columns, overlapping devices",
        (8, 16),
        lambda d: _named(d, range(4), (2, 2), ("a", "b"), "a"),
        lambda d: _named(d, range(2, 6), (4,), ("x",), None, "x"),
    ),
    Pair(
        "rows -> columns, the same 8 devices",
        (8, 16),
        lambda d: _named(d, R8, (8,), ("x",), "x"),
        lambda d: _named(d, R8, (8,), ("x",), None, "x"),
    ),
    Pair(
        "reversed device order -> natural order",
        (8, 16),
        lambda d: _named(d, range(7, -1, -1), (8,), ("x",), "x"),
        lambda d: _named(d, R8, (4, 2), ("a", "b"), "a", "b"),
    ),
    Pair(
        "two axes on one dimension -> the other dimension",
        (8, 16),
        lambda d: _named(d, R8, (2, 4), ("a", "b"), ("a", "b")),
        lambda d: _named(d, [1, 3, 5, 7, 0, 2, 4, 6], (2, 4), ("a", "b"), None, ("b", "a")),
    ),
    Pair(
        "single device -> all 8",
        (8, 16),
        lambda d: SingleDeviceSharding(d[2]),
        lambda d: _named(d, R8, (8,), ("x",), None, "x"),
    ),
    Pair(
        "all 8 -> single device inside them",
        (8, 16),
        lambda d: _named(d, R8, (4, 2), ("a", "b"), "b", "a"),
        lambda d: SingleDeviceSharding(d[5]),
    ),
    Pair(
        "GSPMD partially replicated -> GSPMD on other devices",
        (8, 16),
        lambda d: _gspmd(_named(d, R4A, (2, 2), ("a", "b"), "a"), 2),
        lambda d: _gspmd(_named(d, R4B, (2, 2), ("a", "b"), "b", "a"), 2),
    ),
    Pair(
        "a subset -> another subset (devices 1,2 -> 5,6)",
        (8, 16),
        lambda d: _named(d, [1, 2], (2,), ("x",), "x"),
        lambda d: _named(d, [6, 5], (2,), ("x",), None, "x"),
    ),
    Pair(
        "3-d, two sharded dimensions -> one, overlapping",
        (4, 8, 8),
        lambda d: _named(d, R8, (2, 4), ("a", "b"), "a", "b"),
        lambda d: _named(d, range(3, 7), (2, 2), ("p", "q"), None, None, ("p", "q")),
    ),
    Pair(
        "rank-0 replicated -> one device",
        (),
        lambda d: _named(d, R4A, (4,), ("x",)),
        lambda d: SingleDeviceSharding(d[6]),
    ),
)


def host_value(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """A deterministic numpy value of ``dtype`` (an ml_dtypes one where numpy has none)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    dt = np.dtype(getattr(ml_dtypes, dtype) if hasattr(ml_dtypes, dtype) else dtype)
    if dtype in SUB_BYTE:
        info = ml_dtypes.iinfo(dt) if "int" in dtype else None
        if info is not None:
            return rng.integers(int(info.min), int(info.max) + 1, n).astype(dt).reshape(shape)
        codes = rng.integers(0, 16, n).astype(np.uint8)  # every float4 code: the raw nibble
        return codes.view(dt).reshape(shape)
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def same_bits(a: Any, b: Any) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and signed zeros included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def same_values(a: Any, b: Any) -> bool:
    """Equal dtype, shape and bytes, except that two NaNs are equal whatever their payloads: the
    comparison with ``jax.device_put``, which does not keep NaN payloads of every float8 dtype
    (float8_e5m2 between meshes of different device orders, jax 0.10.2 on CPU)."""
    a, b = np.asarray(a), np.asarray(b)
    if same_bits(a, b):
        return True
    if a.dtype != b.dtype or a.shape != b.shape or a.dtype.kind not in "fcV":
        return False
    try:
        with np.errstate(invalid="ignore"):
            return bool(np.array_equal(a, b, equal_nan=True))
    except TypeError:
        return False
