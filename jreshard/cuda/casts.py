"""GPU casts: the cast rows of a descriptor table, one CuPy ``RawKernel`` launch per table.

A *cast row* of a descriptor table (:mod:`jreshard.schedule.kernels`, ``CAST`` column not
0) moves elements, not bytes: it reads each element in the first dtype of its chain and
writes the last, applying every cast of the chain in turn, with ``jnp.astype``'s bits
(:func:`jreshard.views.casts.cast`: round to nearest even, overflow to inf, or to NaN for
``float8_e4m3fn``, float to ``int8`` truncating and saturating with NaN to 0, XLA's NaN
bits). Byte rows keep the byte-copy kernel of :mod:`jreshard.cuda.kernels`; a table
that holds both is split (:func:`split`) and each part launches its own kernel.

The conversions are plain C on the bits (:data:`CAST_SOURCE`, no ``cuda_bf16.h`` or
``cuda_fp8.h``, no float arithmetic, so flush-to-zero and fast-math flags cannot change a
bit), and the same source compiles as host C++: the tests compare it, for every bit pattern
of the 8- and 16-bit dtypes and random float32 patterns with the special values, with
:func:`jreshard.views.casts.cast`. Every float dtype here widens exactly to float32, so a
float-to-float cast is "widen to float32, round once"; NaNs take the bits XLA gives them
(:func:`jreshard.views.casts.cast`'s docstring), chosen per pair in ``jr_nan``.

Cast launch table columns (:data:`~jreshard.cuda.kernels.LAUNCH_COLUMNS` per row, the
byte launch table's layout with ``CHAIN`` where it has ``WIDTH``):

==========  =================================================================
``SRC``     address of the row's first source element
``DST``     address of the row's first destination element
``UNITS``   elements in the row
``CHAIN``   the row's ``CAST`` column: the dtype read, then each dtype cast to
``NDIM``    used dimensions
``TILE``    first tile of this row; tiles are numbered across rows
``SHAPE``   8 columns from ``SHAPE0``: the extents in elements
``SSTRIDE`` 8 columns: the source byte strides (staging: C strides of SHAPE times the staged itemsize)
``DSTRIDE`` 8 columns: the destination byte strides
==========  =================================================================

A tile is ``THREADS * UNROLL`` consecutive elements of one row; thread ``t`` of the block
casts elements ``first + k * THREADS + t`` for ``k < UNROLL``, each unravelled over the
extents (a division per dimension and element: cast rows carry a view's casts, the byte
rows stay on the vectorised kernel). An element whose address is not a multiple of its
size (staging packs the rows of one message back to back, whatever their dtypes) is read
and written byte by byte, little-endian. :func:`element_addresses` is the kernel's index
math in numpy; the tests check it against ``kernels.pack_cpu``/``unpack_cpu``/``copy_cpu``.

Everything that calls CUDA here is not run on GPU.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jreshard.cuda import kernels as CK
from jreshard.schedule import kernels as K
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.types import CudaKernel, CudaStream, CupyModule
from jreshard.views.casts import CAST_DTYPES

__all__ = [
    "CAST_SOURCE",
    "CHAIN",
    "byte_rows",
    "copy_launch",
    "element_addresses",
    "grid_size",
    "itemsizes",
    "launch",
    "launch_uploaded",
    "pack_launch",
    "split",
    "unpack_launch",
]

CHAIN = CK.WIDTH  # the column the byte launch table uses for the unit width
ITEMSIZE = {1 + i: int(numpy_dtype(d).itemsize) for i, d in enumerate(CAST_DTYPES)}  # per 4-bit dtype code

CAST_SOURCE = r"""
#define JR_COLS 32
#define JR_SRC 0
#define JR_DST 1
#define JR_UNITS 2
#define JR_CHAIN 3
#define JR_NDIM 4
#define JR_TILE 5
#define JR_SHAPE 8
#define JR_SSTR 16
#define JR_DSTR 24
#define JR_THREADS 256
#define JR_UNROLL 4
/* dtype codes (kernels.chain_code): 1 float32, 2 bfloat16, 3 float16, 4 float8_e4m3fn, 5 float8_e5m2, 6 int8 */
typedef unsigned int jr_u32;

__device__ __forceinline__ int jr_size(const int c) { return c == 1 ? 4 : (c <= 3 ? 2 : 1); }
__device__ __forceinline__ int jr_ebits(const int c) { return c == 2 ? 8 : (c == 4 ? 4 : 5); }
__device__ __forceinline__ int jr_mbits(const int c) { return c == 2 ? 7 : (c == 3 ? 10 : (c == 4 ? 3 : 2)); }

__device__ __forceinline__ bool jr_isnan(const int c, const jr_u32 b) {
  if (c == 1) return (b & 0x7fffffffu) > 0x7f800000u;
  if (c == 6) return false;
  if (c == 4) return (b & 0x7fu) == 0x7fu;  /* e4m3fn: no inf, one NaN per sign */
  const int e = jr_ebits(c), m = jr_mbits(c);
  const jr_u32 mag = b & ((1u << (e + m)) - 1u);
  return mag > (((1u << e) - 1u) << m);
}

/* The NaN a cast from `from` to the float `to` gives, as XLA does (views.casts): the sign and the top
   payload bits with the quiet bit set between float32, bfloat16 and float16, except that into bfloat16
   every NaN is canonical (signed), bfloat16 -> float32 keeps every bit, and into float8_e5m2 only a
   float32 NaN keeps its sign. */
__device__ __forceinline__ jr_u32 jr_nan(const int from, const int to, const jr_u32 b) {
  const jr_u32 s = (b >> (8 * jr_size(from) - 1)) & 1u;
  if (to == 1) {
    if (from == 2) return b << 16;
    if (from == 3) return (s << 31) | 0x7fc00000u | ((b & 0x3ffu) << 13);
    return (s << 31) | 0x7fc00000u;
  }
  if (to == 2) return (s << 15) | 0x7fc0u;
  if (to == 3) {
    if (from == 1) return (s << 15) | 0x7e00u | ((b & 0x7fffffu) >> 13);
    if (from == 2) return (s << 15) | 0x7e00u | ((b & 0x7fu) << 3);
    return (s << 15) | 0x7e00u;
  }
  if (to == 4) return (s << 7) | 0x7fu;
  return from == 1 ? ((s << 7) | 0x7eu) : 0x7fu;
}

/* The position of the highest set bit of m (m > 0). */
__device__ __forceinline__ int jr_top(jr_u32 m) {
  int k = 0;
  while (m >> (k + 1)) ++k;
  return k;
}

/* A bfloat16, float16 or float8 (not NaN) as float32 bits: exact, every value is a float32. */
__device__ __forceinline__ jr_u32 jr_widen(const int c, const jr_u32 b) {
  if (c == 2) return b << 16;
  const int e = jr_ebits(c), m = jr_mbits(c), bias = (1 << (e - 1)) - 1;
  const jr_u32 sign = ((b >> (e + m)) & 1u) << 31;
  const jr_u32 ef = (b >> m) & ((1u << e) - 1u), mf = b & ((1u << m) - 1u);
  if (c != 4 && ef == (1u << e) - 1u) return sign | 0x7f800000u;  /* inf */
  if (ef == 0) {
    if (mf == 0) return sign;
    const int k = jr_top(mf);  /* mf * 2^(1 - bias - m), its top bit 2^(k + 1 - bias - m) */
    return sign | ((jr_u32)(k + 1 - bias - m + 127) << 23) | ((mf << (23 - k)) & 0x7fffffu);
  }
  return sign | ((ef - bias + 127) << 23) | (mf << (23 - m));
}

/* float32 bits (not NaN) rounded to nearest even into bfloat16, float16 or float8: overflow to inf,
   and to NaN for float8_e4m3fn (which has no inf). */
__device__ __forceinline__ jr_u32 jr_narrow(const int c, const jr_u32 b) {
  const int e = jr_ebits(c), m = jr_mbits(c), bias = (1 << (e - 1)) - 1;
  const jr_u32 sign = (b >> 31) << (e + m);
  const jr_u32 a = b & 0x7fffffffu;
  const jr_u32 inf = ((1u << e) - 1u) << m;
  if (a >= 0x7f800000u) return sign | (c == 4 ? 0x7fu : inf);
  jr_u32 mant = a & 0x7fffffu;
  int ex = -126;  /* the value is mant * 2^(ex - 23) */
  if (a >> 23) {
    ex = (int)(a >> 23) - 127;
    mant |= 0x800000u;
  }
  const int emin = 1 - bias;
  int shift = 23 - m;
  jr_u32 base = 0;
  if (ex >= emin) base = (jr_u32)(ex + bias - 1) << m;  /* mant >> shift brings the implicit bit: + one exponent */
  else shift += emin - ex;  /* a subnormal of the target */
  if (shift > 25) shift = 25;  /* below half the smallest subnormal: rounds to 0 */
  const jr_u32 q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
  jr_u32 r = base + q;  /* a carry out of the mantissa steps the exponent, up to inf */
  if (rem > half || (rem == half && (q & 1u))) ++r;
  if (c == 4) return sign | (r > 0x7eu ? 0x7fu : r);
  return sign | (r > inf ? inf : r);
}

__device__ __forceinline__ jr_u32 jr_from_int8(const jr_u32 b) {
  const int v = (int)(signed char)(unsigned char)(b & 0xffu);
  if (v == 0) return 0;
  const jr_u32 sign = v < 0 ? 0x80000000u : 0u;
  const jr_u32 mag = (jr_u32)(v < 0 ? -v : v);
  const int k = jr_top(mag);
  return sign | ((jr_u32)(k + 127) << 23) | ((mag << (23 - k)) & 0x7fffffu);
}

/* float32 bits to int8: truncate toward zero, saturate (inf too), NaN to 0. */
__device__ __forceinline__ jr_u32 jr_to_int8(const jr_u32 b) {
  const jr_u32 a = b & 0x7fffffffu;
  const bool neg = (b >> 31) != 0;
  if (a > 0x7f800000u) return 0;
  const int ex = (int)(a >> 23) - 127;
  int v = 0;
  if (ex >= 7) v = neg ? -128 : 127;  /* |x| >= 128 */
  else if (ex >= 0) {
    v = (int)(((a & 0x7fffffu) | 0x800000u) >> (23 - ex));
    if (neg) v = -v;
  }
  return (jr_u32)v & 0xffu;
}

/* One cast of one element's bits, `from` to `to`. */
__device__ __forceinline__ jr_u32 jr_cast1(const int from, const int to, const jr_u32 b) {
  if (from == to) return b;
  jr_u32 f;
  if (from == 6) f = jr_from_int8(b);
  else {
    if (jr_isnan(from, b)) return to == 6 ? 0u : jr_nan(from, to, b);
    f = from == 1 ? b : jr_widen(from, b);
  }
  if (to == 1) return f;
  if (to == 6) return jr_to_int8(f);
  return jr_narrow(to, f);
}

/* Every cast of a chain (4-bit codes, the dtype read lowest), in turn. */
__device__ __forceinline__ jr_u32 jr_cast_chain(long long chain, jr_u32 b) {
  int from = (int)(chain & 15);
  for (chain >>= 4; chain; chain >>= 4) {
    const int to = (int)(chain & 15);
    b = jr_cast1(from, to, b);
    from = to;
  }
  return b;
}

__device__ __forceinline__ int jr_last(long long chain) {
  int c = 0;
  for (; chain; chain >>= 4) c = (int)(chain & 15);
  return c;
}

__device__ __forceinline__ jr_u32 jr_load(const long long at, const int size) {
  if ((at & (size - 1)) == 0) {
    if (size == 4) return *reinterpret_cast<const jr_u32*>(at);
    if (size == 2) return *reinterpret_cast<const unsigned short*>(at);
  }
  jr_u32 v = 0;
  for (int i = 0; i < size; ++i) v |= (jr_u32)(*reinterpret_cast<const unsigned char*>(at + i)) << (8 * i);
  return v;
}

__device__ __forceinline__ void jr_store(const long long at, const int size, const jr_u32 v) {
  if ((at & (size - 1)) == 0) {
    if (size == 4) { *reinterpret_cast<jr_u32*>(at) = v; return; }
    if (size == 2) { *reinterpret_cast<unsigned short*>(at) = (unsigned short)v; return; }
  }
  for (int i = 0; i < size; ++i) *reinterpret_cast<unsigned char*>(at + i) = (unsigned char)(v >> (8 * i));
}

__device__ __forceinline__ int jr_cast_row(const long long* __restrict__ table, const int nrows, const long long b) {
  int lo = 0, hi = nrows - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table[(long long)mid * JR_COLS + JR_TILE] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

extern "C" __global__ void __launch_bounds__(JR_THREADS)
jreshard_cast(const long long* __restrict__ table, const int nrows) {
  __shared__ int jr_row;
  const long long b = blockIdx.x;
  if (threadIdx.x == 0) jr_row = jr_cast_row(table, nrows, b);
  __syncthreads();
  const long long* row = table + (long long)jr_row * JR_COLS;
  const long long first = (b - row[JR_TILE]) * (long long)(JR_THREADS * JR_UNROLL);
  const long long units = row[JR_UNITS], chain = row[JR_CHAIN];
  const int nd = (int)row[JR_NDIM];
  const int from = jr_size((int)(chain & 15)), to = jr_size(jr_last(chain));
  for (int k = 0; k < JR_UNROLL; ++k) {
    const long long u = first + (long long)k * JR_THREADS + (long long)threadIdx.x;
    if (u >= units) break;
    long long r = u, s = row[JR_SRC], d = row[JR_DST];
    for (int dim = nd - 1; dim >= 0; --dim) {
      const long long n = row[JR_SHAPE + dim];
      const long long q = r / n;
      s += (r - q * n) * row[JR_SSTR + dim];
      d += (r - q * n) * row[JR_DSTR + dim];
      r = q;
    }
    jr_store(d, to, jr_cast_chain(chain, jr_load(s, from)));
  }
}
"""


def split(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(byte rows, cast rows)`` of a descriptor table, each in table order (``table`` itself when no row casts)."""
    cast = table[:, K.CAST] != 0
    if not cast.any():
        return table, table[:0]
    return table[~cast], table[cast]


def itemsizes(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the itemsize of the dtype read and of the dtype written (the chain's first and last codes).

    Raises:
      ValueError: a byte row (``CAST`` 0) among the rows.
    """
    if not np.all(table[:, K.CAST]):
        raise ValueError("casts: a byte row among the cast rows; split the table first (split)")
    first = np.array([ITEMSIZE[int(c) & 15] for c in table[:, K.CAST]], np.int64)
    last = np.array([ITEMSIZE[int(c) >> (4 * ((int(c).bit_length() - 1) // 4))] for c in table[:, K.CAST]], np.int64)
    return first, last


def _c_strides(table: np.ndarray, itemsize: np.ndarray) -> np.ndarray:
    """C byte strides over each row's element extents (staging), for items of ``itemsize``."""
    out = np.zeros((len(table), K.MAX_DIMS), np.int64)
    for i, row in enumerate(table):
        acc = int(itemsize[i])
        for d in range(int(row[K.NDIM]) - 1, -1, -1):
            out[i, d] = acc
            acc *= int(row[K.SHAPE0 + d])
    return out


def _build(src: np.ndarray, sstr: np.ndarray, dst: np.ndarray, dstr: np.ndarray, table: np.ndarray) -> np.ndarray:
    n = len(table)
    out = np.zeros((n, CK.LAUNCH_COLUMNS), np.int64)
    if n:
        shape = table[:, K.SHAPE0 : K.SHAPE0 + K.MAX_DIMS]
        units = np.prod(shape, axis=1)  # unused extents are 1
        tiles = -(-units // CK.TILE_UNITS)
        if int(tiles.sum()) > CK.MAX_BLOCKS:
            raise ValueError(
                f"casts: a launch of {n} cast rows needs {int(tiles.sum())} blocks, over CUDA's grid limit "
                f"of {CK.MAX_BLOCKS}: the fix is a smaller Options.chunk_bytes"
            )
        out[:, CK.SRC], out[:, CK.DST], out[:, CK.UNITS] = src, dst, units
        out[:, CHAIN], out[:, CK.NDIM] = table[:, K.CAST], table[:, K.NDIM]
        out[:, CK.TILE] = np.concatenate([[0], np.cumsum(tiles)[:-1]])
        out[:, CK.SHAPE0 : CK.SHAPE0 + K.MAX_DIMS] = shape
        out[:, CK.SSTRIDE0 : CK.SSTRIDE0 + K.MAX_DIMS] = sstr
        out[:, CK.DSTRIDE0 : CK.DSTRIDE0 + K.MAX_DIMS] = dstr
    out.setflags(write=False)
    return out


def pack_launch(table: np.ndarray, pointers: Sequence[int], staging: int) -> np.ndarray:
    """The cast launch table that packs ``table``'s cast rows from buffers at ``pointers`` into staging at
    ``staging`` (in the chain's last dtype, C order).

    Example (a (2, 3) float32 shard, its second column, cast to bfloat16):
      >>> (row,) = K.element_rows([(0, 4, (12, 4), 4)], (2, 1), ("float32", "bfloat16"))
      >>> lt = pack_launch(row, [4096], 8192)[0]
      >>> int(lt[CK.SRC]), int(lt[CK.DST]), int(lt[CK.UNITS]), K.chain_of(lt[CHAIN])
      (4100, 8192, 2, ('float32', 'bfloat16'))
    """
    _, last = itemsizes(table)
    return _build(
        CK.row_addresses(table, pointers),
        CK.row_strides(table),
        staging + table[:, K.STAGE],
        _c_strides(table, last),
        table,
    )


def unpack_launch(table: np.ndarray, staging: int, pointers: Sequence[int]) -> np.ndarray:
    """The cast launch table that unpacks staging at ``staging`` (the chain's first dtype, C order) into
    ``table``'s cast rows in buffers at ``pointers``."""
    first, _ = itemsizes(table)
    return _build(
        staging + table[:, K.STAGE],
        _c_strides(table, first),
        CK.row_addresses(table, pointers),
        CK.row_strides(table),
        table,
    )


def copy_launch(
    src_table: np.ndarray, src_pointers: Sequence[int], dst_table: np.ndarray, dst_pointers: Sequence[int]
) -> np.ndarray:
    """The cast launch table that casts row ``i`` of ``src_table`` into row ``i`` of ``dst_table`` (cast rows
    of ``kernels.element_rows`` copy pairs: equal extents, the chain in both)."""
    if len(src_table) != len(dst_table):
        raise ValueError(f"casts.copy_launch: {len(src_table)} source rows and {len(dst_table)} destination rows")
    itemsizes(src_table)
    return _build(
        CK.row_addresses(src_table, src_pointers),
        CK.row_strides(src_table),
        CK.row_addresses(dst_table, dst_pointers),
        CK.row_strides(dst_table),
        src_table,
    )


def grid_size(launch_table: np.ndarray) -> int:
    """CUDA blocks one cast launch needs: every tile of every row."""
    if len(launch_table) == 0:
        return 0
    last = launch_table[-1]
    return int(last[CK.TILE]) + math.ceil(int(last[CK.UNITS]) / CK.TILE_UNITS)


def element_addresses(launch_table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the cast kernel does, in numpy: ``(src_address, dst_address, row)`` of every element every
    (block, k, thread) casts, in launch order. For the CPU tests and the device-memory twin.

    Example:
      >>> (row,) = K.element_rows([(0, 0, (12, 4), 4)], (2, 3), ("float32", "float16"))
      >>> s, d, r = element_addresses(pack_launch(row, [1000], 5000))
      >>> s.tolist(), d.tolist()
      ([1000, 1004, 1008, 1012, 1016, 1020], [5000, 5002, 5004, 5006, 5008, 5010])
    """
    blocks = grid_size(launch_table)
    if blocks == 0:
        return (np.zeros(0, np.int64),) * 3
    b = np.arange(blocks, dtype=np.int64)
    rows = np.searchsorted(launch_table[:, CK.TILE], b, side="right") - 1
    rt = launch_table[rows]
    k = np.arange(CK.UNROLL, dtype=np.int64)[:, None] * CK.THREADS + np.arange(CK.THREADS, dtype=np.int64)[None, :]
    u = ((b - rt[:, CK.TILE]) * CK.TILE_UNITS)[:, None, None] + k[None]  # (block, k, thread)
    valid = (u < rt[:, CK.UNITS][:, None, None]).reshape(blocks, -1)
    bi, ui = np.nonzero(valid)
    r = u.reshape(blocks, -1)[bi, ui]
    row = rt[bi]
    s, d = row[:, CK.SRC].copy(), row[:, CK.DST].copy()
    for dim in range(K.MAX_DIMS - 1, -1, -1):  # innermost first; unused extents are 1 (index 0)
        n = row[:, CK.SHAPE0 + dim]
        idx = r % n
        s += idx * row[:, CK.SSTRIDE0 + dim]
        d += idx * row[:, CK.DSTRIDE0 + dim]
        r //= n
    return s, d, rows[bi]


def byte_rows(table: np.ndarray, itemsize: Sequence[int] | np.ndarray) -> np.ndarray:
    """Cast rows as the byte rows that move the same elements unchanged, items of ``itemsize[i]`` bytes
    for row ``i`` (the staging offsets kept): the destination half of a cast copy staged elsewhere."""
    rows = []
    for row, item in zip(table, itemsize, strict=True):
        nd = int(row[K.NDIM])
        (out,) = K.element_rows(
            [(int(row[K.BUF]), int(row[K.OFF]), tuple(int(v) for v in row[K.STRIDE0 : K.STRIDE0 + nd]), int(item))],
            tuple(int(v) for v in row[K.SHAPE0 : K.SHAPE0 + nd]),
            stage=int(row[K.STAGE]),
        )
        rows.append(out)
    if not rows:
        return np.zeros((0, K.COLUMNS), np.int64)
    out = np.concatenate(rows)
    out.setflags(write=False)
    return out


_KERNELS: dict[int, Any] = {}


def _kernel(cupy: CupyModule) -> CudaKernel:
    """The compiled cast kernel for the current device (compiled once per device). Not run on GPU."""
    dev = cupy.cuda.Device().id
    if dev not in _KERNELS:
        _KERNELS[dev] = cupy.RawKernel(CAST_SOURCE, "jreshard_cast", options=("--std=c++14",))
    return _KERNELS[dev]


def launch_uploaded(table: Any, rows: int, blocks: int, stream: CudaStream, cupy: CupyModule) -> None:
    """Run a cast launch table already on the device (``kernels.upload``) on ``stream``. Not run on GPU."""
    if rows:
        with stream:
            _kernel(cupy)((blocks,), (CK.THREADS,), (table, np.int32(rows)))


def launch(launch_table: np.ndarray, stream: CudaStream, cupy: CupyModule = None) -> None:
    """Run one cast launch table on ``stream`` (a CuPy stream of the current device), the table copied to
    the device on that stream first. Not run on GPU."""
    if len(launch_table) == 0:
        return
    if cupy is None:
        cupy = importlib.import_module("cupy")
    (table,) = CK.upload([launch_table], stream, cupy)
    dev, rows, _ = table
    launch_uploaded(dev, rows, grid_size(launch_table), stream, cupy)
