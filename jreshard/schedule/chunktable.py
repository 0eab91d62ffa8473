"""Chunks and descriptor tables as numpy arrays: :func:`~jreshard.schedule.steps.chunk_pieces` and
:func:`~jreshard.schedule.kernels.build_table` for many messages at once, with no Python work per box.

**Chunk boxes.** The pieces of a message, laid end to end, are cut every ``size``
bytes. Where a cut falls inside a piece, :func:`chunk_pieces` splits the piece's box
along its outermost dimensions; the boxes it yields for the part ``[x, y)`` of a
piece (C order over the box, ``0 <= x < y <= V``) are fixed by ``x`` and ``y`` alone.
With ``ix``, ``iy`` the multi-indices of ``x`` and ``y`` in the box, ``j`` the last
dimension where ``ix`` is non-zero (0 when ``x = 0``), ``p`` the first where ``ix``
and ``iy`` differ and ``q = min(p, j)`` (``q = -1`` when ``y = V``), they are

- the rest of ``x``'s slabs, innermost first: for ``d = j, j - 1, ..., q + 1``, the
  box with the first ``d`` indices of ``ix``, ``[ix[d] + (d < j), n[d])`` along ``d``
  and every later dimension whole;
- then, outermost first, the slabs before ``y``: for ``d = q, ..., D - 1``, the box
  with the first ``d`` indices of ``iy``, ``[ix[q] + (q < j) if d == q else 0, iy[d])``
  along ``d`` and every later dimension whole;

empty boxes left out. So each part is at most ``2 D`` candidate boxes, computed
for all parts at once. Boxes of different ranks are padded on the left with
dimensions of extent 1, which change neither the C order nor the boxes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jreshard.schedule import kernels

__all__ = [
    "ChunkBoxes",
    "chunk_boxes",
    "contiguous",
    "descriptor_rows",
    "row_all",
    "row_dot",
    "row_prod",
    "segment_starts",
]


def segment_starts(counts: np.ndarray) -> np.ndarray:
    """Exclusive running sum of ``counts`` (where each segment starts)."""
    out = np.zeros(len(counts), np.int64)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=out[1:])
    return out


def row_prod(a: np.ndarray) -> np.ndarray:
    """Product of each row of an ``(n, D)`` int array (a loop over the few columns: faster than ``axis=1``)."""
    out = np.ones(a.shape[0], np.int64)
    for d in range(a.shape[1]):
        out *= a[:, d]
    return out


def row_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise dot product of two ``(n, D)`` int arrays."""
    out = np.zeros(a.shape[0], np.int64)
    for d in range(a.shape[1]):
        out += a[:, d] * b[:, d]
    return out


def row_all(a: np.ndarray) -> np.ndarray:
    """Whether every entry of each row of an ``(n, D)`` bool array is true."""
    out = np.ones(a.shape[0], bool)
    for d in range(a.shape[1]):
        out &= a[:, d]
    return out


def _c_strides(shape: np.ndarray) -> np.ndarray:
    """C-order strides of every row of an ``(n, D)`` array of extents."""
    st = np.ones_like(shape)
    for d in range(shape.shape[1] - 2, -1, -1):
        st[:, d] = st[:, d + 1] * shape[:, d + 1]
    return st


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ChunkBoxes:
    """The boxes of every chunk of some messages, in chunk order (each chunk's boxes in message order).

    Attributes:
      piece: per box, the piece (row of the input) it comes from.
      lo, hi: ``(n, D)`` byte bounds of each box (the piece's coordinates, left-padded).
      chunk: per box, the chunk it belongs to (a global chunk number, increasing).
      chunk_msg, chunk_index: per chunk, its message and its index within the message.
      chunk_bytes: per chunk, its bytes.
      chunk_start: per chunk, its first box (``chunk_start[-1]`` is the number of boxes).
    """

    piece: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    chunk: np.ndarray
    chunk_msg: np.ndarray
    chunk_index: np.ndarray
    chunk_bytes: np.ndarray
    chunk_start: np.ndarray


def chunk_boxes(lo: np.ndarray, hi: np.ndarray, msg: np.ndarray, size: np.ndarray, nmsg: int) -> ChunkBoxes:
    """Cut messages of byte boxes into chunks, exactly as :func:`~jreshard.schedule.steps.chunk_pieces`.

    Args:
      lo, hi: ``(n, D)`` int64 byte bounds of the pieces, grouped by message, in message order.
      msg: per piece, its message (``0 <= msg < nmsg``, non-decreasing).
      size: per message, its chunk bytes.
      nmsg: the number of messages.
    """
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    npieces, width = lo.shape
    shape = hi - lo
    vol = row_prod(shape)
    keep = np.flatnonzero(vol > 0)
    msg_bytes = np.bincount(msg[keep], weights=vol[keep], minlength=nmsg).astype(np.int64)
    nchunks = -(-msg_bytes // size)
    first_chunk = segment_starts(nchunks)  # global number of each message's chunk 0
    # Each piece's place in its message (empty pieces take no room).
    run = np.cumsum(np.where(vol > 0, vol, 0)) - np.where(vol > 0, vol, 0)
    msg_base = np.zeros(nmsg, np.int64)
    if npieces:
        firsts = np.flatnonzero(np.r_[True, msg[1:] != msg[:-1]])
        msg_base[msg[firsts]] = run[firsts]
    pos = (run - msg_base[msg])[keep]
    k_vol, k_size, k_msg = vol[keep], size[msg[keep]], msg[keep]
    c0 = pos // k_size
    c1 = (pos + k_vol - 1) // k_size
    nseg = c1 - c0 + 1
    seg_piece = np.repeat(np.arange(len(keep)), nseg)
    seg_chunk = np.repeat(c0, nseg) + (np.arange(int(nseg.sum())) - np.repeat(segment_starts(nseg), nseg))
    sp, ssz = pos[seg_piece], k_size[seg_piece]
    x = np.maximum(sp, seg_chunk * ssz) - sp
    y = np.minimum(sp + k_vol[seg_piece], (seg_chunk + 1) * ssz) - sp
    n = shape[keep][seg_piece]
    cand_lo, cand_hi, ok = _parts(n, x, y, k_vol[seg_piece])
    slot = np.flatnonzero(ok.reshape(-1))
    seg_of = slot // (2 * width) if width else slot
    piece = keep[seg_piece[seg_of]]
    base = lo[piece]
    out_lo = cand_lo.reshape(-1, width)[slot] + base
    out_hi = cand_hi.reshape(-1, width)[slot] + base
    gchunk = first_chunk[k_msg[seg_piece[seg_of]]] + seg_chunk[seg_of]
    total = int(nchunks.sum())
    chunk_msg = np.repeat(np.arange(nmsg), nchunks)
    chunk_index = np.arange(total) - first_chunk[chunk_msg]
    chunk_bytes = np.minimum(size[chunk_msg], msg_bytes[chunk_msg] - chunk_index * size[chunk_msg])
    counts = np.bincount(gchunk, minlength=total)
    chunk_start = np.r_[segment_starts(counts), len(gchunk)].astype(np.int64)
    return ChunkBoxes(piece, out_lo, out_hi, gchunk, chunk_msg, chunk_index, chunk_bytes, chunk_start)


def _parts(n: np.ndarray, x: np.ndarray, y: np.ndarray, vol: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``2 D`` candidate boxes of each part ``[x, y)`` of a box of extents ``n`` (module docstring):
    ``(lo, hi)`` of shape ``(parts, 2 D, D)`` relative to the box, and which candidates are kept."""
    m, width = n.shape
    st = _c_strides(n)
    ix = (x[:, None] // st) % n
    whole = y == vol
    iy = (np.where(whole, 0, y)[:, None] // st) % n
    dims = np.arange(width)
    nz = ix != 0
    j = np.where(nz.any(1), width - 1 - np.argmax(nz[:, ::-1], axis=1), 0)
    diff = ix != iy
    p = np.where(diff.any(1), np.argmax(diff, axis=1), width)
    q = np.where(whole, -1, np.minimum(p, j))
    lo = np.zeros((m, 2 * width, width), np.int64)
    hi = np.zeros((m, 2 * width, width), np.int64)
    ok = np.zeros((m, 2 * width), bool)
    lo_s = ix + (dims[None, :] < j[:, None])  # where x's slab at d resumes
    for d in range(width):
        k = width - 1 - d  # the rest of x's slabs, innermost first
        lo[:, k, :d], hi[:, k, :d] = ix[:, :d], ix[:, :d] + 1
        lo[:, k, d], hi[:, k, d] = lo_s[:, d], n[:, d]
        hi[:, k, d + 1 :] = n[:, d + 1 :]
        ok[:, k] = (d <= j) & (d > q) & (lo_s[:, d] < n[:, d])
        k = width + d  # the slabs before y, outermost first
        start = np.where(d == q, lo_s[np.arange(m), np.maximum(q, 0)], 0)
        lo[:, k, :d], hi[:, k, :d] = iy[:, :d], iy[:, :d] + 1
        lo[:, k, d], hi[:, k, d] = start, iy[:, d]
        hi[:, k, d + 1 :] = n[:, d + 1 :]
        ok[:, k] = (q >= 0) & (d >= q) & (iy[:, d] > start)
    return lo, hi, ok


def contiguous(rel_lo: np.ndarray, shape: np.ndarray, outer: np.ndarray) -> np.ndarray:
    """Per row, whether the box ``rel_lo + [0, shape)`` is one run of a C-ordered buffer of ``outer``
    (as :meth:`~jreshard.sharding.box.Box.is_contiguous_in`)."""
    m, width = shape.shape
    if not width:
        return np.ones(m, bool)
    first = np.argmax(shape > 1, axis=1)  # the first dimension with extent > 1 (0 when none)
    full = (rel_lo == 0) & (shape == outer)
    later = np.arange(width)[None, :] > first[:, None]
    return (row_prod(shape) <= 1) | row_all(full | ~later)


def descriptor_rows(
    buf: np.ndarray, rel_lo: np.ndarray, shape: np.ndarray, outer: np.ndarray, stage: np.ndarray
) -> np.ndarray:
    """Descriptor table rows (:mod:`jreshard.schedule.kernels`) of byte boxes, as :func:`kernels.build_table`
    builds them one by one: ``rel_lo`` and ``shape`` in byte coordinates relative to buffers of
    extents ``outer``; ``stage`` each box's offset in staging. Boxes must not be empty."""
    m, width = shape.shape
    st = _c_strides(outer)
    cols = np.zeros((kernels.COLUMNS, m), np.int64)  # column by column (each one contiguous), transposed at the end
    cols[kernels.BUF] = buf
    cols[kernels.OFF] = row_dot(rel_lo, st)
    cols[kernels.STAGE] = stage
    cols[kernels.NBYTES] = row_prod(shape)
    # Merge as kernels._merge does: extents of 1 are dropped, and a dimension folds into the group of
    # dimensions inside it when they are contiguous: for one C-ordered buffer, when every dimension
    # from it (exclusive) to the next one kept (inclusive) spans its whole extent.
    full = shape == outer
    kept = shape != 1
    edge = np.zeros((width, m), bool)  # the innermost dimension of each merged group
    inner_full = np.zeros(m, bool)  # all full from d + 1 to the next kept dimension inside d
    has_inner = np.zeros(m, bool)
    for d in range(width - 1, -1, -1):
        edge[d] = kept[:, d] & ~(has_inner & inner_full)
        inner_full = np.where(kept[:, d], full[:, d], inner_full & full[:, d])
        has_inner |= kept[:, d]
    # Outermost group first: group c covers the dimensions after group c - 1's edge up to its own edge.
    ext = np.ones((width + 1, m), np.int64)
    strd = np.ones((width + 1, m), np.int64)
    col = np.zeros(m, np.int64)
    acc = np.ones(m, np.int64)
    last_stride = np.ones(m, np.int64)
    for d in range(width):
        acc *= shape[:, d]
        e = np.flatnonzero(edge[d])
        at = col[e] * m + e
        ext.reshape(-1)[at] = acc[e]
        strd.reshape(-1)[at] = st[e, d]
        last_stride[e] = st[e, d]
        acc[e] = 1
        col[e] += 1
    # After the groups, a last dimension (1, stride 1) when the innermost group's stride is not 1.
    inner = (col == 0) | (last_stride != 1)
    ndim = col + inner
    if m and int(ndim.max()) > kernels.MAX_DIMS:
        bad = int(np.argmax(ndim))
        raise ValueError(
            f"a box of extents {tuple(shape[bad].tolist())} needs {int(ndim[bad])} strided dimensions; "
            f"the descriptor table holds at most {kernels.MAX_DIMS}"
        )
    cols[kernels.NDIM] = ndim
    n = min(width + 1, kernels.MAX_DIMS)
    cols[kernels.SHAPE0 : kernels.SHAPE0 + kernels.MAX_DIMS] = 1
    cols[kernels.SHAPE0 : kernels.SHAPE0 + n] = ext[:n]
    used = np.arange(n)[:, None] < ndim[None, :]
    cols[kernels.STRIDE0 : kernels.STRIDE0 + n] = np.where(used, strd[:n], 0)
    return np.ascontiguousarray(cols.T)
