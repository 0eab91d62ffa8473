"""Pack and unpack strided boxes: the descriptor table, and its numpy (CPU) kernels.

Every byte movement inside a rank is described by a *descriptor table*: a small
C-ordered ``int64`` numpy array with one row per piece and :data:`COLUMNS` columns.
A shard buffer is seen as bytes: a tensor shard of shape ``(n0, ..., nk)`` and
itemsize ``s`` is a uint8 array of shape ``(n0, ..., nk * s)`` (a rank-0 shard is
``(s,)``), so every piece is a box of bytes whose innermost extent has stride 1.

=========  ===================================================================
column     meaning
=========  ===================================================================
``BUF``    index of the shard buffer in the list passed to the kernel
``OFF``    byte offset of the piece's first byte in that buffer
``STAGE``  byte offset of the piece in the staging buffer (packed back to back, C order)
``NBYTES`` bytes in the piece (the product of the used extents)
``NDIM``   used dimensions, ``1 <= NDIM <= MAX_DIMS``
``SHAPE``  ``MAX_DIMS`` columns from ``SHAPE0``: the extents, outermost first; unused columns are 1
``STRIDE`` ``MAX_DIMS`` columns from ``STRIDE0``: the byte strides in the shard buffer; unused are 0
=========  ===================================================================

Dimensions of extent 1 are dropped and adjacent dimensions that are contiguous
with each other are merged, so the innermost used dimension always has stride 1
and a contiguous piece has ``NDIM == 1``. Byte ``i`` of a piece (``0 <= i < NBYTES``,
C order) lives at ``OFF + sum_d idx_d * STRIDE_d`` where ``idx`` is ``i`` unravelled
over the used extents, and at ``STAGE + i`` in staging. A GPU kernel consumes the
same table (one thread per byte or per vector of bytes), so the index math here is
pure numpy and shared by every backend.

Example:
  >>> import numpy as np
  >>> from jreshard.sharding.box import Box
  >>> shard = np.arange(24, dtype=np.uint8)            # a (4, 6) uint8 shard
  >>> t = build_table([(0, (4, 6), Box((1, 2), (3, 5)))])
  >>> staging = np.zeros(6, np.uint8)
  >>> pack_cpu(t, [shard], staging)
  >>> staging.tolist()
  [8, 9, 10, 14, 15, 16]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from jreshard.sharding.box import Box

__all__ = [
    "BUF",
    "COLUMNS",
    "MAX_DIMS",
    "NBYTES",
    "NDIM",
    "OFF",
    "SHAPE0",
    "STAGE",
    "STRIDE0",
    "build_copy_tables",
    "build_table",
    "byte_box",
    "byte_shape",
    "copy_cpu",
    "pack_cpu",
    "table_bytes",
    "unpack_cpu",
]

MAX_DIMS = 8
BUF, OFF, STAGE, NBYTES, NDIM = 0, 1, 2, 3, 4
SHAPE0 = 5
STRIDE0 = SHAPE0 + MAX_DIMS
COLUMNS = STRIDE0 + MAX_DIMS


def byte_box(box: Box, itemsize: int) -> Box:
    """``box`` (element indices) as a box of bytes: the last range times ``itemsize``.

    >>> byte_box(Box((1, 2), (3, 5)), 4)
    Box(lo=(1, 8), hi=(3, 20))
    """
    if box.ndim == 0:
        return Box((0,), (itemsize,))
    return Box((*box.lo[:-1], box.lo[-1] * itemsize), (*box.hi[:-1], box.hi[-1] * itemsize))


def byte_shape(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """A C-ordered shard's shape seen as bytes: the last extent times ``itemsize`` (rank 0: ``(itemsize,)``).

    >>> byte_shape((4, 6), 2), byte_shape((), 8)
    ((4, 12), (8,))
    """
    shape = tuple(int(n) for n in shape)
    return (*shape[:-1], shape[-1] * itemsize) if shape else (int(itemsize),)


def _c_strides(outer: Sequence[int]) -> list[int]:
    strides = [1] * len(outer)
    for d in range(len(outer) - 2, -1, -1):
        strides[d] = strides[d + 1] * outer[d + 1]
    return strides


def _merge(extents: Sequence[int], strides: Sequence[Sequence[int]]) -> list[tuple[int, tuple[int, ...]]]:
    """Drop extent-1 dimensions, then merge each dimension into the next where it is
    contiguous with it in every one of the buffers (``strides[k]`` per buffer)."""
    merged: list[list] = []
    for d in range(len(extents) - 1, -1, -1):
        n = extents[d]
        if n == 1:
            continue
        st = tuple(s[d] for s in strides)
        if merged and all(ms * merged[-1][0] == x for ms, x in zip(merged[-1][1], st, strict=True)):
            merged[-1][0] *= n
        else:
            merged.append([n, st])
    merged.reverse()
    if not merged or any(x != 1 for x in merged[-1][1]):
        merged.append([1, (1,) * len(strides)])
    if len(merged) > MAX_DIMS:
        raise ValueError(
            f"a box of extents {tuple(extents)} needs {len(merged)} strided dimensions; "
            f"the descriptor table holds at most {MAX_DIMS}"
        )
    return [(n, st) for n, st in merged]


def _fill(out: np.ndarray, buf: int, off: int, stage: int, dims: list, k: int) -> None:
    out[BUF], out[OFF], out[STAGE], out[NDIM] = buf, off, stage, len(dims)
    out[NBYTES] = math.prod(n for n, _ in dims)
    out[SHAPE0 : SHAPE0 + MAX_DIMS] = 1
    for d, (n, st) in enumerate(dims):
        out[SHAPE0 + d] = n
        out[STRIDE0 + d] = st[k]


def _offset(box: Box, strides: Sequence[int]) -> int:
    return sum(lo * st for lo, st in zip(box.lo, strides, strict=True))


def build_table(
    pieces: Sequence[tuple[int, Sequence[int], Box]], *, staging_offset: int = 0, align: int = 1
) -> np.ndarray:
    """The descriptor table of ``pieces``, laid out in staging from ``staging_offset``.

    Args:
      pieces: ``(buffer_index, buffer_byte_shape, box)`` with ``box`` in the
        buffer's local byte coordinates (see :func:`byte_box`); empty boxes are skipped.
      staging_offset: where the first piece goes in staging (used as given).
      align: every later piece starts at the next multiple of ``align`` bytes
        (1: back to back). 16 lets a GPU kernel move every staged piece in 16-byte
        units; a staged message whose pieces travel as one run needs 1.

    Returns:
      A read-only ``(len(pieces), COLUMNS)`` int64 array.

    Example:
      >>> t = build_table([(0, (8,), Box((0,), (3,))), (0, (8,), Box((3,), (8,)))], align=16)
      >>> t[:, STAGE].tolist(), table_bytes(t)
      ([0, 16], 8)
    """
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"build_table: align={align!r} must be a positive int")
    table = np.zeros((len(pieces), COLUMNS), dtype=np.int64)
    pos, i = staging_offset, 0
    for buf, outer, box in pieces:
        if box.volume == 0:
            continue
        strides = _c_strides(outer)
        _fill(table[i], buf, _offset(box, strides), pos, _merge(box.shape, [strides]), 0)
        pos += int(table[i, NBYTES])
        pos = -(-pos // align) * align
        i += 1
    table = table[:i]
    table.setflags(write=False)
    return table


def build_copy_tables(
    pairs: Sequence[tuple[int, Sequence[int], Box, int, Sequence[int], Box]],
) -> tuple[np.ndarray, np.ndarray]:
    """Two tables for direct copies, row ``i`` of the first into row ``i`` of the second.

    Args:
      pairs: ``(src_buffer, src_byte_shape, src_box, dst_buffer, dst_byte_shape, dst_box)``;
        the two boxes have equal extents (local byte coordinates of each buffer).

    Returns:
      ``(src_table, dst_table)`` with identical ``NDIM``/``SHAPE`` columns (dimensions
      are merged only where both sides are contiguous); ``STAGE`` is unused (0).
    """
    src = np.zeros((len(pairs), COLUMNS), dtype=np.int64)
    dst = np.zeros((len(pairs), COLUMNS), dtype=np.int64)
    i = 0
    for sb, so, sbox, db, do, dbox in pairs:
        if sbox.shape != dbox.shape:
            raise ValueError(f"build_copy_tables: source box {sbox} and destination box {dbox} differ in shape")
        if sbox.volume == 0:
            continue
        ss, ds = _c_strides(so), _c_strides(do)
        dims = _merge(sbox.shape, [ss, ds])
        _fill(src[i], sb, _offset(sbox, ss), 0, dims, 0)
        _fill(dst[i], db, _offset(dbox, ds), 0, dims, 1)
        i += 1
    src, dst = src[:i], dst[:i]
    src.setflags(write=False)
    dst.setflags(write=False)
    return src, dst


def table_bytes(table: np.ndarray) -> int:
    """Total bytes the table describes."""
    return int(table[:, NBYTES].sum())


def _view(row: np.ndarray, buf: np.ndarray, writeable: bool) -> np.ndarray:
    nd = int(row[NDIM])
    shape = tuple(int(v) for v in row[SHAPE0 : SHAPE0 + nd])
    strides = tuple(int(v) for v in row[STRIDE0 : STRIDE0 + nd])
    return as_strided(buf[int(row[OFF]) :], shape=shape, strides=strides, writeable=writeable)


def _stage_view(row: np.ndarray, staging: np.ndarray) -> np.ndarray:
    nd = int(row[NDIM])
    s = int(row[STAGE])
    return staging[s : s + int(row[NBYTES])].reshape(tuple(int(v) for v in row[SHAPE0 : SHAPE0 + nd]))


def pack_cpu(table: np.ndarray, buffers: Sequence[np.ndarray], staging: np.ndarray) -> None:
    """Copy every piece of ``table`` out of ``buffers`` (1-D uint8) into ``staging`` (1-D uint8)."""
    for row in table:
        np.copyto(_stage_view(row, staging), _view(row, buffers[int(row[BUF])], False))


def unpack_cpu(table: np.ndarray, staging: np.ndarray, buffers: Sequence[np.ndarray]) -> None:
    """Copy every piece of ``table`` out of ``staging`` into its place in ``buffers``."""
    for row in table:
        np.copyto(_view(row, buffers[int(row[BUF])], True), _stage_view(row, staging))


def copy_cpu(
    src_table: np.ndarray, src_buffers: Sequence[np.ndarray], dst_table: np.ndarray, dst_buffers: Sequence[np.ndarray]
) -> None:
    """Copy piece ``i`` of ``src_table`` straight into piece ``i`` of ``dst_table`` (no
    staging); the tables come from :func:`build_copy_tables`."""
    for s, d in zip(src_table, dst_table, strict=True):
        np.copyto(_view(d, dst_buffers[int(d[BUF])], True), _view(s, src_buffers[int(s[BUF])], False))
