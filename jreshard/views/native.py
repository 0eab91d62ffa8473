"""The compiled float32 <-> bfloat16 casts, where the build made them, behind a numpy check.

``pip install`` compiles ``jreshard/views/_casts.c`` when a C compiler is found (it is
optional: without one, or when running from a checkout that was never built, every
cast goes through numpy and ml_dtypes, with the same bits). The kernels cast a
refit's float32 master weights to bfloat16 about twice as fast as ml_dtypes on one
core, vectorised for the CPU they run on, with the GIL released so copy threads
run them side by side.

:func:`cast_into` takes a pair of arrays only when it can prove the kernel's
access pattern covers them exactly (same shape, aligned, every axis but the last
a row stride, the last one contiguous), and says ``False`` otherwise so the
caller uses numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np

_compiled: ModuleType | None
try:
    import jreshard.views._casts as _compiled
except ImportError:  # not built (no compiler, or a checkout run in place)
    _compiled = None

__all__ = ["KERNELS", "SCATTER", "SCATTER_RAW", "available", "cast_into"]

_Kernel = Callable[[int, int, int, int, int, int], None]


def _kernels() -> dict[tuple[str, str], _Kernel]:
    if _compiled is None:
        return {}
    return {("float32", "bfloat16"): _compiled.f32_to_bf16, ("bfloat16", "float32"): _compiled.bf16_to_f32}


KERNELS: dict[tuple[str, str], _Kernel] = _kernels()


def _scatter_f32_bf16(src: int, src_stride: int, rows: int, row_elems: int, table: np.ndarray) -> None:
    assert _compiled is not None and table.dtype == np.int64 and table.flags.c_contiguous and table.shape[1:] == (5,)
    _compiled.f32_to_bf16_scatter(src, src_stride, rows, row_elems, table.ctypes.data, len(table))


# (source dtype, cast chain) -> ``kernel(src address, row stride, rows, row elements, table)``: cast the rows and
# copy each table entry's run to its address (see jreshard.engine.viewcopy.Scatter). A table row is (band row, first
# column, columns, destination address, end of the destination buffer); the kernel checks every row against the
# band and the buffer's end before it writes anything.
SCATTER: dict[tuple[str, tuple[str, ...]], Callable[[int, int, int, int, np.ndarray], None]] = (
    {} if _compiled is None else {("float32", ("bfloat16",)): _scatter_f32_bf16}
)


# The same kernels taking the table's address and row count (``kernel(src, row stride, rows, row elements, table
# address, table rows)``), for callers that fill one table for many blocks (jreshard.engine.viewcopy.Scatters).
SCATTER_RAW: dict[tuple[str, tuple[str, ...]], Callable[[int, int, int, int, int, int], None]] = (
    {} if _compiled is None else {("float32", ("bfloat16",)): _compiled.f32_to_bf16_scatter}
)


def available() -> bool:
    """Whether the compiled casts were built and load here."""
    return bool(KERNELS)


def cast_into(out: np.ndarray, x: np.ndarray) -> bool:
    """``out[...] = x.astype(out.dtype)`` with a compiled kernel; ``False`` (nothing written) where none applies.

    Example:
      >>> import ml_dtypes
      >>> x = np.array([[1.0, 2.5, -3.0]], np.float32)
      >>> out = np.empty((1, 3), ml_dtypes.bfloat16)
      >>> cast_into(out, x) == available(), out.tolist() if available() else [[1.0, 2.5, -3.0]]
      (True, [[1.0, 2.5, -3.0]])
    """
    kernel = KERNELS.get((x.dtype.name, out.dtype.name))
    if kernel is None or x.shape != out.shape or not (x.flags.aligned and out.flags.aligned):
        return False
    if x.size == 0:
        return True
    rows = _rows(x.shape, x.strides, out.strides, x.itemsize, out.itemsize)
    if rows is None:
        return False
    outer, (n, cols, s_stride, d_stride) = rows
    base_s, base_d = x.ctypes.data, out.ctypes.data
    for s_off, d_off in outer:
        kernel(base_s + s_off, s_stride, base_d + d_off, d_stride, n, cols)
    return True


def _rows(
    shape: tuple[int, ...], s_strides: tuple[int, ...], d_strides: tuple[int, ...], s_item: int, d_item: int
) -> tuple[list[tuple[int, int]], tuple[int, int, int, int]] | None:
    """The array as blocks of rows: (byte offsets of each block, (rows, cols, row strides)); ``None`` if not so.

    Axes of extent 1 are dropped, then neighbouring axes that are one run in both
    arrays are merged. The last axis must be contiguous in both; the axis before it
    gives the rows; at most one more axis (looped over here) is allowed.
    """
    axes = [(n, s, d) for n, s, d in zip(shape, s_strides, d_strides, strict=True) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, s, d in axes:
        if merged and merged[-1][1] == s * n and merged[-1][2] == d * n:
            m = merged.pop()
            merged.append((m[0] * n, s, d))
        else:
            merged.append((n, s, d))
    if not merged:
        merged = [(1, s_item, d_item)]
    cols, s_last, d_last = merged[-1]
    if (s_last, d_last) != (s_item, d_item) or len(merged) > 3:
        return None
    n, s_row, d_row = merged[-2] if len(merged) >= 2 else (1, 0, 0)
    if len(merged) == 3:
        k, s_out, d_out = merged[0]
        return [(i * s_out, i * d_out) for i in range(k)], (n, cols, s_row, d_row)
    return [(0, 0)], (n, cols, s_row, d_row)
