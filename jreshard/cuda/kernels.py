"""GPU pack, unpack and copy: one CuPy ``RawKernel`` launch per descriptor table.

The engine describes a chunk's pieces with the descriptor table of
:mod:`jreshard.schedule.kernels` (one ``int64`` row per piece: buffer, byte offset,
staging offset, extents and byte strides, innermost stride 1). Here each table
becomes a *launch table*, a second small ``int64`` array with absolute addresses,
and one kernel launch moves every piece of it, strided to strided. The index math
of the launch table and of the kernel lives in numpy too (:func:`unit_addresses`),
so the CPU tests check it against ``kernels.pack_cpu``/``unpack_cpu``; the CUDA
source is also compiled as plain C++ on CPU by the tests where a compiler exists.

Launch table columns (``LAUNCH_COLUMNS`` per row):

==========  =================================================================
``SRC``     address of the piece's first source byte
``DST``     address of the piece's first destination byte
``UNITS``   units in the piece: ``NBYTES / WIDTH``
``WIDTH``   bytes per unit, 16, 8, 4, 2 or 1: the largest that divides both
            addresses, the innermost extent and every outer stride
``NDIM``    used dimensions (as in the descriptor table)
``TILE``    first tile of this row; tiles are numbered across rows
``LUNITS``  units per innermost run: ``SHAPE[NDIM-1] / WIDTH``
``SHAPE``   8 columns from ``SHAPE0``: the extents in bytes
``SSTRIDE`` 8 columns: the source byte strides (staging: C strides of SHAPE)
``DSTRIDE`` 8 columns: the destination byte strides
==========  =================================================================

A tile is ``THREADS * UNROLL`` consecutive units of one row, and one CUDA block
copies one tile: thread ``t`` copies units ``first + k * THREADS + t`` for
``k < UNROLL`` (consecutive threads touch consecutive units, so loads coalesce).
Unit ``u`` of a row is run ``r = u // LUNITS`` at position ``p = u % LUNITS``;
``r`` unravels over the outer extents, and the unit's address on each side is the
base plus ``p * WIDTH`` plus the outer indices times that side's strides.

How the kernel does it: thread 0 finds the block's row (a binary search over
``TILE``) once per block and shares it; each thread divides only to place its
first unit, then steps ``THREADS`` units at a time by adding the mixed-radix
digits of the step with carries (no division per unit); it computes all its
``UNROLL`` addresses, issues all ``UNROLL`` loads, then all stores, so several
16-byte loads are in flight per thread. Counters are 64-bit, so a piece may hold
any number of units; a launch is bounded by CUDA's grid (``MAX_BLOCKS`` tiles).

Everything that calls CUDA here is not run on GPU yet.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jreshard.schedule import kernels as K
from jreshard.types import CudaKernel, CudaStream, CupyModule

__all__ = [
    "CUDA_SOURCE",
    "LAUNCH_COLUMNS",
    "THREADS",
    "UNROLL",
    "copy_launch",
    "launch",
    "launch_uploaded",
    "pack_launch",
    "unit_addresses",
    "unpack_launch",
    "upload",
]

THREADS, UNROLL = 256, 4
MIN_BLOCKS = 4  # __launch_bounds__(THREADS, MIN_BLOCKS): the kernel is held to 64 registers a thread
TILE_UNITS = THREADS * UNROLL
MAX_BLOCKS = (1 << 31) - 1  # gridDim.x
SRC, DST, UNITS, WIDTH, NDIM, TILE, LUNITS = range(7)
SHAPE0, SSTRIDE0, DSTRIDE0 = 8, 8 + K.MAX_DIMS, 8 + 2 * K.MAX_DIMS
LAUNCH_COLUMNS = 8 + 3 * K.MAX_DIMS
_WIDTHS = (16, 8, 4, 2, 1)

CUDA_SOURCE = r"""
#define JR_COLS 32
#define JR_SRC 0
#define JR_DST 1
#define JR_UNITS 2
#define JR_WIDTH 3
#define JR_NDIM 4
#define JR_TILE 5
#define JR_LUNITS 6
#define JR_SHAPE 8
#define JR_SSTR 16
#define JR_DSTR 24
#define JR_MAXD 8
#define JR_THREADS 256
#define JR_UNROLL 4
#define JR_MIN_BLOCKS 4

/* The row whose first tile is the last one <= b: a binary search, once per block. */
__device__ __forceinline__ int jr_find_row(const long long* __restrict__ table, const int nrows, const long long b) {
  int lo = 0, hi = nrows - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table[(long long)mid * JR_COLS + JR_TILE] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

/* One thread's JR_UNROLL units of one tile, T-wide: every address first, then every load
   (JR_UNROLL loads in flight), then every store. Counters are 64-bit. A thread divides
   once to place its first unit; later units advance by JR_THREADS units with carries
   through the outer extents, without dividing. */
template <typename T>
__device__ __forceinline__ void jr_tile(const long long* __restrict__ row, const long long first) {
  const long long units = row[JR_UNITS];
  const int nd = (int)row[JR_NDIM];
  const long long u0 = first + (long long)threadIdx.x;
  long long s[JR_UNROLL], d[JR_UNROLL];
  bool ok[JR_UNROLL];
  if (nd == 1) {
#pragma unroll
    for (int k = 0; k < JR_UNROLL; ++k) {
      const long long u = u0 + (long long)k * JR_THREADS;
      ok[k] = u < units;
      s[k] = row[JR_SRC] + u * (long long)sizeof(T);
      d[k] = row[JR_DST] + u * (long long)sizeof(T);
    }
  } else {
    const long long lu = row[JR_LUNITS];
    long long r = u0 / lu;
    long long p = u0 - r * lu;
    const long long dr = JR_THREADS / lu;
    const long long dp = JR_THREADS - dr * lu;
    long long idx[JR_MAXD], step[JR_MAXD];
    long long t = dr;
#pragma unroll
    for (int dim = JR_MAXD - 2; dim >= 1; --dim) {
      idx[dim] = 0;
      step[dim] = 0;
      if (dim <= nd - 2) {
        const long long n = row[JR_SHAPE + dim];
        const long long q = r / n, qt = t / n;
        idx[dim] = r - q * n;
        step[dim] = t - qt * n;
        r = q;
        t = qt;
      }
    }
    idx[0] = r;
    step[0] = t;
#pragma unroll
    for (int k = 0; k < JR_UNROLL; ++k) {
      ok[k] = u0 + (long long)k * JR_THREADS < units;
      long long a = row[JR_SRC] + p * (long long)sizeof(T), b = row[JR_DST] + p * (long long)sizeof(T);
#pragma unroll
      for (int dim = 0; dim < JR_MAXD - 1; ++dim) {
        if (dim <= nd - 2) {
          a += idx[dim] * row[JR_SSTR + dim];
          b += idx[dim] * row[JR_DSTR + dim];
        }
      }
      s[k] = a;
      d[k] = b;
      p += dp;  /* the next unit of this thread: JR_THREADS units on */
      long long carry = p >= lu;
      if (carry) p -= lu;
#pragma unroll
      for (int dim = JR_MAXD - 2; dim >= 1; --dim) {
        if (dim <= nd - 2) {
          idx[dim] += step[dim] + carry;
          carry = idx[dim] >= row[JR_SHAPE + dim];
          if (carry) idx[dim] -= row[JR_SHAPE + dim];
        }
      }
      idx[0] += step[0] + carry;
    }
  }
  T v[JR_UNROLL];
#pragma unroll
  for (int k = 0; k < JR_UNROLL; ++k)
    if (ok[k]) v[k] = *reinterpret_cast<const T*>(s[k]);
#pragma unroll
  for (int k = 0; k < JR_UNROLL; ++k)
    if (ok[k]) *reinterpret_cast<T*>(d[k]) = v[k];
}

/* At most 64 registers a thread, so 4 blocks of 256 threads share a multiprocessor (50% occupancy). */
extern "C" __global__ void __launch_bounds__(JR_THREADS, JR_MIN_BLOCKS)
jreshard_copy(const long long* __restrict__ table, const int nrows) {
  __shared__ int jr_row;
  const long long b = blockIdx.x;
  if (threadIdx.x == 0) jr_row = jr_find_row(table, nrows, b);
  __syncthreads();
  const long long* row = table + (long long)jr_row * JR_COLS;
  const long long first = (b - row[JR_TILE]) * (long long)(JR_THREADS * JR_UNROLL);
  switch ((int)row[JR_WIDTH]) {
    case 16: jr_tile<uint4>(row, first); break;
    case 8: jr_tile<uint2>(row, first); break;
    case 4: jr_tile<unsigned int>(row, first); break;
    case 2: jr_tile<unsigned short>(row, first); break;
    default: jr_tile<unsigned char>(row, first);
  }
}
"""


def _c_strides(shape: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """C strides of each row's used extents (unused columns 0): the staging side."""
    out = np.zeros_like(shape)
    for i in range(len(shape)):
        nd = int(ndim[i])
        acc = 1
        for d in range(nd - 1, -1, -1):
            out[i, d] = acc
            acc *= int(shape[i, d])
    return out


def _build(src: np.ndarray, sstr: np.ndarray, dst: np.ndarray, dstr: np.ndarray, table: np.ndarray) -> np.ndarray:
    n = len(table)
    out = np.zeros((n, LAUNCH_COLUMNS), dtype=np.int64)
    if n == 0:
        out.setflags(write=False)
        return out
    ndim = table[:, K.NDIM]
    shape = table[:, K.SHAPE0 : K.SHAPE0 + K.MAX_DIMS]
    inner = shape[np.arange(n), ndim - 1]
    width = np.ones(n, dtype=np.int64)
    outer = np.arange(K.MAX_DIMS)[None, :] < (ndim - 1)[:, None]  # strides that must be multiples of WIDTH
    for w in reversed(_WIDTHS[:-1]):  # 2, 4, 8, 16: keep the largest that divides everything
        ok = (src % w == 0) & (dst % w == 0) & (inner % w == 0)
        ok &= np.all(~outer | ((sstr % w == 0) & (dstr % w == 0)), axis=1)
        width[ok] = w
    units = table[:, K.NBYTES] // width
    tiles = -(-units // TILE_UNITS)
    if int(tiles.sum()) > MAX_BLOCKS:
        raise ValueError(
            f"kernels: a launch of {len(table)} pieces ({int(table[:, K.NBYTES].sum())} bytes) needs "
            f"{int(tiles.sum())} blocks, over CUDA's grid limit of {MAX_BLOCKS}: the fix is a smaller "
            "Options.chunk_bytes"
        )
    out[:, SRC], out[:, DST], out[:, UNITS], out[:, WIDTH], out[:, NDIM] = src, dst, units, width, ndim
    out[:, TILE] = np.concatenate([[0], np.cumsum(tiles)[:-1]])
    out[:, LUNITS] = inner // width
    out[:, SHAPE0 : SHAPE0 + K.MAX_DIMS] = shape
    out[:, SSTRIDE0 : SSTRIDE0 + K.MAX_DIMS] = sstr
    out[:, DSTRIDE0 : DSTRIDE0 + K.MAX_DIMS] = dstr
    out.setflags(write=False)
    return out


def row_addresses(table: np.ndarray, pointers: Sequence[int]) -> np.ndarray:
    """Each descriptor row's first byte: its buffer's pointer plus its offset."""
    ptrs = np.asarray([int(p) for p in pointers], dtype=np.int64)
    return ptrs[table[:, K.BUF]] + table[:, K.OFF] if len(table) else np.zeros(0, np.int64)


def row_strides(table: np.ndarray) -> np.ndarray:
    """Each descriptor row's byte strides (``MAX_DIMS`` columns)."""
    return np.ascontiguousarray(table[:, K.STRIDE0 : K.STRIDE0 + K.MAX_DIMS])


def pack_launch(table: np.ndarray, pointers: Sequence[int], staging: int) -> np.ndarray:
    """The launch table that packs ``table``'s pieces from buffers at ``pointers`` into staging at ``staging``.

    Example:
      >>> from jreshard.sharding.box import Box
      >>> t = K.build_table([(0, (4, 64), Box((1, 16), (3, 48)))])
      >>> row = pack_launch(t, [4096], 8192)[0]
      >>> int(row[SRC]), int(row[DST]), int(row[WIDTH]), int(row[UNITS]), int(row[LUNITS])
      (4176, 8192, 16, 4, 2)
    """
    shape = table[:, K.SHAPE0 : K.SHAPE0 + K.MAX_DIMS]
    return _build(
        row_addresses(table, pointers),
        row_strides(table),
        staging + table[:, K.STAGE],
        _c_strides(shape, table[:, K.NDIM]),
        table,
    )


def unpack_launch(table: np.ndarray, staging: int, pointers: Sequence[int]) -> np.ndarray:
    """The launch table that unpacks staging at ``staging`` into ``table``'s pieces in buffers at ``pointers``."""
    shape = table[:, K.SHAPE0 : K.SHAPE0 + K.MAX_DIMS]
    return _build(
        staging + table[:, K.STAGE],
        _c_strides(shape, table[:, K.NDIM]),
        row_addresses(table, pointers),
        row_strides(table),
        table,
    )


def copy_launch(
    src_table: np.ndarray, src_pointers: Sequence[int], dst_table: np.ndarray, dst_pointers: Sequence[int]
) -> np.ndarray:
    """The launch table that copies piece ``i`` of ``src_table`` into piece ``i`` of ``dst_table``
    (tables from ``kernels.build_copy_tables``: equal extents, no staging)."""
    if len(src_table) != len(dst_table):
        raise ValueError(f"copy_launch: {len(src_table)} source rows and {len(dst_table)} destination rows")
    return _build(
        row_addresses(src_table, src_pointers),
        row_strides(src_table),
        row_addresses(dst_table, dst_pointers),
        row_strides(dst_table),
        src_table,
    )


def grid_size(launch_table: np.ndarray) -> int:
    """CUDA blocks one launch needs: every tile of every row."""
    if len(launch_table) == 0:
        return 0
    last = launch_table[-1]
    return int(last[TILE]) + math.ceil(int(last[UNITS]) / TILE_UNITS)


def unit_addresses(launch_table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the kernel does, in numpy: ``(src_address, dst_address, width)`` of every
    unit every (block, thread, k) copies, in launch order. For tests on CPU."""
    blocks = grid_size(launch_table)
    if blocks == 0:
        return (np.zeros(0, np.int64),) * 3
    b = np.arange(blocks, dtype=np.int64)
    rows = np.searchsorted(launch_table[:, TILE], b, side="right") - 1
    rt = launch_table[rows]
    k = np.arange(UNROLL, dtype=np.int64)[:, None] * THREADS + np.arange(THREADS, dtype=np.int64)[None, :]
    u = ((b - rt[:, TILE]) * TILE_UNITS)[:, None, None] + k[None]  # (block, k, thread)
    valid = u < rt[:, UNITS][:, None, None]
    u = u.reshape(blocks, -1)
    valid = valid.reshape(blocks, -1)
    bi, ui = np.nonzero(valid)
    u = u[bi, ui]
    row = rt[bi]
    w = row[:, WIDTH]
    nd = row[:, NDIM]
    lu = row[:, LUNITS]
    r = np.where(nd == 1, 0, u // np.maximum(lu, 1))
    p = np.where(nd == 1, u, u - r * lu) * w
    s = row[:, SRC] + p
    d = row[:, DST] + p
    for dim in range(K.MAX_DIMS - 2, 0, -1):  # dims nd-2 .. 1 of each row
        active = dim <= nd - 2
        n = np.where(active, row[:, SHAPE0 + dim], 1)
        idx = np.where(active, r % n, 0)
        s += idx * row[:, SSTRIDE0 + dim]
        d += idx * row[:, DSTRIDE0 + dim]
        r = np.where(active, r // n, r)
    s += np.where(nd > 1, r * row[:, SSTRIDE0], 0)
    d += np.where(nd > 1, r * row[:, DSTRIDE0], 0)
    return s, d, w


_KERNELS: dict[int, Any] = {}


def _kernel(cupy: CupyModule) -> CudaKernel:
    """The compiled kernel for the current device (compiled once per device). Not run on GPU."""
    dev = cupy.cuda.Device().id
    if dev not in _KERNELS:
        _KERNELS[dev] = cupy.RawKernel(CUDA_SOURCE, "jreshard_copy", options=("--std=c++14",))
    return _KERNELS[dev]


def upload(launch_tables: Sequence[np.ndarray], stream: CudaStream, cupy: CupyModule) -> list[tuple[Any, int, int]]:
    """Every launch table in one host-to-device copy on ``stream``: ``(device rows, rows, blocks)``
    per table, for :func:`launch_uploaded`. Not run on GPU."""
    tables = [np.ascontiguousarray(t, dtype=np.int64).reshape(-1, LAUNCH_COLUMNS) for t in launch_tables]
    if not tables:
        return []
    with stream:
        dev = cupy.asarray(np.concatenate(tables))
    out, pos = [], 0
    for t in tables:
        out.append((dev[pos : pos + len(t)], len(t), grid_size(t)))
        pos += len(t)
    return out


def launch_uploaded(table: Any, rows: int, blocks: int, stream: CudaStream, cupy: CupyModule) -> None:
    """Run a launch table already on the device (from :func:`upload`) on ``stream``. Not run on GPU."""
    if rows:
        with stream:
            _kernel(cupy)((blocks,), (THREADS,), (table, np.int32(rows)))


def launch(launch_table: np.ndarray, stream: CudaStream, cupy: CupyModule = None) -> None:
    """Run one launch table on ``stream`` (a CuPy stream of the current device). Not run on GPU.

    The table is copied to the device on the same stream, so it is ordered with
    the launch; every address in it must be readable (source) and writable
    (destination) from the current device: same device, or peer access enabled.
    """
    if len(launch_table) == 0:
        return
    if cupy is None:
        cupy = importlib.import_module("cupy")
    ((table, rows, blocks),) = upload([launch_table], stream, cupy)
    launch_uploaded(table, rows, blocks, stream, cupy)
