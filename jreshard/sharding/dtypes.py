"""Dtype names without importing jax: numpy's own, plus the ml_dtypes extras
(bfloat16, float8_*) that jax uses. A layout stores the dtype by name."""

from __future__ import annotations

import numpy as np

from jreshard.sharding.caches import cache

__all__ = ["dtype_name", "numpy_dtype", "packed_bits", "storage_bytes", "value_bits"]


@cache(max_size=1024)
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for ``name`` ("float32", "bfloat16", "float8_e4m3fn", ...)."""
    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes
    except ImportError as err:  # pragma: no cover - ml_dtypes ships with jax
        raise TypeError(f"dtype {name!r} needs the ml_dtypes package") from err
    try:
        return np.dtype(getattr(ml_dtypes, name))
    except AttributeError:
        raise TypeError(f"unknown dtype {name!r}") from None


def dtype_name(dtype: object) -> str:
    """Canonical name of a numpy/jax/ml_dtypes dtype or dtype name."""
    if isinstance(dtype, str):
        return numpy_dtype(dtype).name
    if isinstance(dtype, np.dtype):
        return _name_of(dtype)
    return np.dtype(dtype).name  # type: ignore[call-overload]


@cache(max_size=1024)
def _name_of(dtype: np.dtype) -> str:
    return dtype.name  # (numpy computes it in Python each time it is read: microseconds)


@cache(max_size=1024)
def value_bits(dtype: np.dtype) -> int:
    """Bits per value of ``dtype``: ``8 * itemsize``, except for the sub-byte types that devices pack.

    numpy and ml_dtypes give every dtype ``itemsize >= 1``; ``int4`` values take 4 bits in a
    device buffer (two a byte), ``int2`` 2, ``float4_e2m1fn`` 4.

    >>> import ml_dtypes
    >>> value_bits(np.dtype(ml_dtypes.int4)), value_bits(np.dtype(ml_dtypes.float4_e2m1fn)), value_bits(np.dtype("f4"))
    (4, 4, 32)
    """
    dtype = np.dtype(dtype)
    bits = 8 * dtype.itemsize
    if dtype.itemsize != 1 or dtype.kind == "b":
        return bits
    import ml_dtypes

    for info in (ml_dtypes.iinfo, ml_dtypes.finfo):  # (ml_dtypes' sub-byte types have numpy kind "V")
        try:
            return int(info(dtype).bits)
        except (TypeError, ValueError):
            continue
    return bits


def packed_bits(dtype: np.dtype) -> int | None:
    """Bits per value of a packed sub-byte dtype (``int4``: 4), ``None`` for a dtype of whole bytes."""
    bits = value_bits(np.dtype(dtype))
    return bits if bits < 8 else None


def storage_bytes(dtype: np.dtype, count: int) -> int:
    """Bytes a device buffer of ``count`` values of ``dtype`` holds: ``ceil(count * bits / 8)``.

    The one place a shard's byte size is computed from its dtype; for packed sub-byte dtypes it
    is less than ``count * itemsize`` (which is what ``nbytes`` reports for them).

    >>> import ml_dtypes
    >>> storage_bytes(np.dtype(ml_dtypes.int4), 5), storage_bytes(np.dtype("float32"), 5)
    (3, 20)
    """
    return -(-int(count) * value_bits(np.dtype(dtype)) // 8)
