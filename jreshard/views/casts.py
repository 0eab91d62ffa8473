"""Element casts with ``jnp.astype``'s semantics, in numpy, and where a cast chain runs.

A view's leaf carries a *cast chain*: the source dtype, then each dtype an
``astype`` on the way asked for. Casts are elementwise, so they commute with every
index map of a view and can run anywhere along the way. The chain is cut once: the
sender applies the casts before the cut, the receiver the rest; the bytes on the
wire are in the dtype at the cut, the narrowest dtype of the chain (the first one
when several tie). For one cast that reads: at the sender when the target is
narrower, at the receiver otherwise.

numpy (with ml_dtypes) rounds float to float like XLA (round to nearest even,
overflow to inf or, for ``float8_e4m3fn``, to NaN). Two things differ and
:func:`cast` fixes them: float to integer (numpy wraps, XLA saturates and maps NaN
to 0), and the bits of a NaN (XLA keeps the sign and the top payload bits and sets
the quiet bit, where numpy does not for float32 <-> float16 and bfloat16 -> float16;
into ``float8_e5m2`` from the 16- and 8-bit floats every NaN becomes ``0x7f``). The tests compare
every bit pattern of the 8- and 16-bit types, and random float32 bit patterns with
the special values, against ``jnp.astype``, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import jreshard.views.native as native
from jreshard.sharding.dtypes import dtype_name, numpy_dtype

__all__ = ["CAST_DTYPES", "cast", "cast_chain", "check_cast_dtype", "wire_cut"]

CAST_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8")


def check_cast_dtype(dtype: object, what: str) -> str:
    """The canonical name of ``dtype``, one of :data:`CAST_DTYPES`.

    Raises:
      TypeError: a dtype views cannot cast to or from.
    """
    try:
        name = dtype_name(dtype)
    except TypeError:
        name = repr(dtype)
    if name not in CAST_DTYPES:
        raise TypeError(f"{what}: dtype {name} is not one views cast between; choose one of {CAST_DTYPES}")
    return name


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` cast to ``dtype`` exactly as ``jnp.astype`` does (a new array).

    Example:
      >>> cast(np.array([300.0, -2.7, np.nan], np.float32), "int8").tolist()
      [127, -2, 0]
    """
    with np.errstate(all="ignore"):  # overflow to inf and NaN are part of the semantics
        return _cast(x, numpy_dtype(dtype))


def _cast(x: np.ndarray, to: np.dtype) -> np.ndarray:
    if x.dtype == to:
        return x.copy()
    if to.kind in "iu" and x.dtype.kind not in "iub":
        info = np.iinfo(to)
        wide = x.astype(np.float32)
        wide = np.nan_to_num(np.trunc(wide), nan=0.0, posinf=info.max, neginf=info.min)
        return np.clip(wide, info.min, info.max).astype(to)
    out = x.astype(to)
    if x.dtype.kind == "V" or x.dtype.kind == "f":
        _xla_nans(x, out)
    return out


# The pairs where numpy's NaN bits differ from XLA's (found by comparing every bit pattern).
_PAYLOAD_PAIRS = {("float32", "float16"), ("bfloat16", "float16"), ("float16", "float32")}
_E5M2_CANONICAL = {"float16", "bfloat16", "float8_e4m3fn"}
_MANT = {"float32": 23, "float16": 10, "bfloat16": 7}
_EXP_BITS = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}


def _xla_nans(x: np.ndarray, out: np.ndarray) -> None:
    """Rewrite the NaNs of ``out`` (cast from float ``x``) to the bits XLA gives them."""
    src, dst = x.dtype.name, out.dtype.name
    if (src, dst) not in _PAYLOAD_PAIRS and not (dst == "float8_e5m2" and src in _E5M2_CANONICAL):
        return
    nan = np.isnan(x.astype(np.float32)) if x.dtype.itemsize < 4 else np.isnan(x)
    if not nan.any():
        return
    ubits = out.view(np.dtype(f"uint{8 * out.dtype.itemsize}"))
    if dst == "float8_e5m2":
        ubits[nan] = 0x7F
        return
    s_bits = x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))[nan].astype(np.uint64)
    ms, mt, n = _MANT[src], _MANT[dst], 8 * x.dtype.itemsize
    payload = s_bits & ((1 << ms) - 1)
    payload = payload >> (ms - mt) if ms > mt else payload << (mt - ms)
    sign = (s_bits >> (n - 1)) << (8 * out.dtype.itemsize - 1)
    ubits[nan] = (sign | _EXP_BITS[dst] | (1 << (mt - 1)) | payload).astype(ubits.dtype)


def cast_chain(x: np.ndarray, chain: Sequence[str]) -> np.ndarray:
    """Apply the casts of ``chain`` in order (``x`` itself when the chain is empty)."""
    for d in chain:
        x = cast(x, d)
    return x


def wire_cut(source_dtype: str, chain: Sequence[str]) -> int:
    """Where the chain is cut: the sender applies ``chain[:k]``, the receiver ``chain[k:]``.

    ``k`` is the first position of the narrowest dtype among ``source_dtype, *chain``.

    Example:
      >>> wire_cut("float32", ("bfloat16",)), wire_cut("bfloat16", ("float32",)), wire_cut("float16", ("bfloat16",))
      (1, 0, 0)
    """
    sizes = [numpy_dtype(d).itemsize for d in (source_dtype, *chain)]
    return sizes.index(min(sizes))


def cast_into(out: np.ndarray, x: np.ndarray, chain: Sequence[str]) -> None:
    """``out[...] = cast_chain(x, chain)``, in one pass where numpy's own cast is already exact.

    float32 <-> bfloat16 runs the compiled kernel of :mod:`jreshard.views.native` where it
    was built; another float-to-float cast whose NaN bits numpy gets right is a ``np.copyto``
    (no temporary); anything else goes through :func:`cast_chain`.
    """
    if not chain:
        np.copyto(out, x)
        return
    src = x.dtype.name
    if len(chain) == 1 and out.dtype.name == chain[0] and native.cast_into(out, x):
        return
    if len(chain) == 1 and _direct(src, chain[0]):
        with np.errstate(all="ignore"):
            np.copyto(out, x, casting="unsafe")
        return
    out[...] = cast_chain(x, chain)


def _direct(src: str, dst: str) -> bool:
    if numpy_dtype(dst).kind in "iu" or numpy_dtype(src).kind in "iu":
        return src == dst
    return (src, dst) not in _PAYLOAD_PAIRS and not (dst == "float8_e5m2" and src in _E5M2_CANONICAL)
