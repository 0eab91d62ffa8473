"""Dtype names without importing jax: numpy's own, plus the ml_dtypes extras
(bfloat16, float8_*) that jax uses. A layout stores the dtype by name."""

from __future__ import annotations

import numpy as np

from jreshard._cache import cache

__all__ = ["dtype_name", "numpy_dtype"]


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
    return np.dtype(dtype).name  # type: ignore[call-overload]
