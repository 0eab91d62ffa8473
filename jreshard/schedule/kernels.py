"""Pack and unpack strided boxes: the descriptor table, and its CPU kernels (compiled byte rows, numpy).

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
``CAST``   0: the row moves bytes. Otherwise a cast row (a view's cast, :func:`chain_code`): the row
           moves elements, ``SHAPE`` counts elements, ``STRIDE`` stays in bytes, and the elements are
           cast on the way; ``NBYTES`` is what the row takes in staging (a copy row: in its own buffer)
=========  ===================================================================

A byte row's strides need not decrease: a view's transpose is a byte row whose
extents run in the destination's axis order over the source's strides (the last
extent is the item, stride 1), so staging always holds a piece in the order its
receiver writes it.

**Cast rows.** ``CAST`` packs a cast chain in 4-bit codes, lowest first: the dtype
the row reads, then each dtype it casts to (:data:`CAST_DTYPES`, code ``1 + index``).
A pack row reads elements of the first dtype from its buffer and stages the last;
an unpack row reads the first from staging and writes the last into its buffer; a
copy pair reads the first and writes the last. Casts have ``jnp.astype``'s bits
(:func:`jreshard.views.casts.cast_into`, the compiled float32 <-> bfloat16 kernels where built).

Dimensions of extent 1 are dropped and adjacent dimensions that are contiguous
with each other are merged, so the innermost used dimension always has stride 1
and a contiguous piece has ``NDIM == 1``. Byte ``i`` of a piece (``0 <= i < NBYTES``,
C order) lives at ``OFF + sum_d idx_d * STRIDE_d`` where ``idx`` is ``i`` unravelled
over the used extents, and at ``STAGE + i`` in staging. A GPU kernel consumes the
same table (one thread per byte or per vector of bytes), so the index math here is
pure numpy and shared by every backend. On CPU, :func:`pack_cpu` and :func:`unpack_cpu` move the
byte rows in ``_rows.c`` where it was built (:func:`compiled_rows`), which checks each row against
the sizes of the buffers it names before anything moves; the numpy kernels here are the reference
it is tested against, and run everything where it was not built.

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
import weakref
from collections.abc import Sequence
from types import ModuleType

import numpy as np
from numpy.lib.stride_tricks import as_strided

from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.views.casts import CAST_DTYPES, cast_into

__all__ = [
    "BUF",
    "CAST",
    "CAST_DTYPES",
    "COLUMNS",
    "MAX_DIMS",
    "NBYTES",
    "NDIM",
    "OFF",
    "PACK_CAST",
    "SHAPE0",
    "STAGE",
    "STRIDE0",
    "UNPACK_CAST",
    "build_copy_tables",
    "chain_code",
    "chain_of",
    "element_rows",
    "build_table",
    "byte_box",
    "byte_shape",
    "compiled_cast_codes",
    "compiled_rows",
    "copy_cpu",
    "pack_cpu",
    "table_bytes",
    "unpack_cpu",
]

MAX_DIMS = 8
BUF, OFF, STAGE, NBYTES, NDIM = 0, 1, 2, 3, 4
SHAPE0 = 5
STRIDE0 = SHAPE0 + MAX_DIMS
CAST = STRIDE0 + MAX_DIMS
COLUMNS = CAST + 1

_CHAIN_MAX = 15  # 4-bit codes in a 63-bit column


def chain_code(chain: Sequence[str]) -> int:
    """The ``CAST`` column of a cast chain: the dtype read, then each dtype cast to (at least two).

    >>> chain_code(("float32", "bfloat16")), chain_of(chain_code(("float32", "bfloat16")))
    (33, ('float32', 'bfloat16'))

    Raises:
      ValueError: a chain of fewer than two dtypes, of more than 15, or a dtype outside :data:`CAST_DTYPES`.
    """
    chain = tuple(chain)
    if not 2 <= len(chain) <= _CHAIN_MAX or any(d not in CAST_DTYPES for d in chain):
        raise ValueError(
            f"chain_code: chain={chain} must hold 2 to {_CHAIN_MAX} dtypes of {CAST_DTYPES} (the dtype read first)"
        )
    return sum((1 + CAST_DTYPES.index(d)) << (4 * k) for k, d in enumerate(chain))


def chain_of(code: int) -> tuple[str, ...]:
    """The cast chain a ``CAST`` column holds (:func:`chain_code`); ``()`` for a byte row."""
    out = []
    code = int(code)
    while code:
        out.append(CAST_DTYPES[(code & 15) - 1])
        code >>= 4
    return tuple(out)


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
      pieces: ``(buffer_index, buffer_byte_shape, box)`` with ``box`` in
        byte coordinates relative to the buffer (see :func:`byte_box`); empty boxes are skipped.
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
        the two boxes have equal extents (byte coordinates relative to each buffer).

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


def element_rows(
    ends: Sequence[tuple[int, int, Sequence[int], int]],
    extents: Sequence[int],
    chain: Sequence[str] = (),
    *,
    stage: int = 0,
    staged_itemsize: int | None = None,
) -> list[np.ndarray]:
    """Descriptor rows, one ``(1, COLUMNS)`` array per end, for an element box with any byte strides
    (a view's piece): one end for a pack or unpack row (staging is the other, in C order over
    ``extents``), two for a copy pair (axes are merged only where both ends are contiguous).

    Args:
      ends: per end ``(buffer index, byte offset of the first element, byte strides per axis, itemsize)``.
      extents: per axis, in the order staging holds the elements (a piece's destination order).
      chain: ``()`` (move bytes) or a cast chain (:func:`chain_code`), the dtype read first.
      stage: the rows' offset in staging.
      staged_itemsize: bytes of an element in staging (default: the first end's itemsize); a copy
        row's ``NBYTES`` counts its own end.

    Example (a transposed ``(2, 3)`` float32 shard read column by column):
      >>> (row,) = element_rows([(0, 0, (4, 12), 4)], (3, 2))
      >>> shard = np.arange(6, dtype=np.float32).view(np.uint8)
      >>> staging = np.zeros(24, np.uint8)
      >>> pack_cpu(row, [shard], staging)
      >>> staging.view(np.float32).tolist()
      [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]

    Raises:
      ValueError: a cast row whose strides are not whole items, or more than ``MAX_DIMS`` dimensions.
    """
    outs = [np.zeros((1, COLUMNS), np.int64) for _ in ends]
    if not chain:  # bytes: the item is the innermost extent
        item = ends[0][3]
        dims = _merge((*extents, item), [(*e[2], 1) for e in ends])
        for k, (out, (buf, off, _, _)) in enumerate(zip(outs, ends, strict=True)):
            _fill(out[0], buf, off, stage, dims, k)
    else:
        for _, off, strides, item in ends:
            if any(st % item for st in strides) or off % item:
                raise ValueError(f"element_rows: strides {tuple(strides)} are not whole items of {item} bytes")
        dims = _merge(extents, [tuple(st // e[3] for st in e[2]) for e in ends])
        staged = ends[0][3] if staged_itemsize is None else staged_itemsize
        for k, (out, (buf, off, _, item)) in enumerate(zip(outs, ends, strict=True)):
            _fill(
                out[0],
                buf,
                off,
                stage,
                [(n, tuple(x * e[3] for x, e in zip(st, ends, strict=True))) for n, st in dims],
                k,
            )
            out[0, NBYTES] *= staged if len(ends) == 1 else item
            out[0, CAST] = chain_code(chain)
    for out in outs:
        out.setflags(write=False)
    return outs


def table_bytes(table: np.ndarray) -> int:
    """Total bytes the table describes."""
    return int(table[:, NBYTES].sum())


def _view(row: np.ndarray, buf: np.ndarray, writeable: bool) -> np.ndarray:
    """The bytes of a byte row in its buffer (as the compiled kernel, refused when the row leaves the buffer)."""
    nd = int(row[NDIM])
    shape = tuple(int(v) for v in row[SHAPE0 : SHAPE0 + nd])
    strides = tuple(int(v) for v in row[STRIDE0 : STRIDE0 + nd])
    off = int(row[OFF])
    last = off + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    if off < 0 or min(strides, default=0) < 0 or (0 not in shape and last >= buf.nbytes):
        raise ValueError(f"a descriptor row leaves its buffer of {buf.nbytes} bytes: row {row.tolist()}")
    return as_strided(buf[off:], shape=shape, strides=strides, writeable=writeable)


def _stage_view(row: np.ndarray, staging: np.ndarray) -> np.ndarray:
    nd = int(row[NDIM])
    s = int(row[STAGE])
    return staging[s : s + int(row[NBYTES])].reshape(tuple(int(v) for v in row[SHAPE0 : SHAPE0 + nd]))


def _typed(row: np.ndarray, buf: np.ndarray, dtype: str) -> np.ndarray:
    """The elements of a cast row in its buffer, typed (numpy checks the box lies inside the buffer)."""
    nd = int(row[NDIM])
    try:
        return np.ndarray(
            tuple(int(v) for v in row[SHAPE0 : SHAPE0 + nd]),
            numpy_dtype(dtype),
            buffer=buf,
            offset=int(row[OFF]),
            strides=tuple(int(v) for v in row[STRIDE0 : STRIDE0 + nd]),
        )
    except TypeError as err:
        raise ValueError(f"a descriptor row leaves its buffer of {buf.nbytes} bytes: {err}") from None


def _typed_stage(row: np.ndarray, staging: np.ndarray, dtype: str) -> np.ndarray:
    nd, s = int(row[NDIM]), int(row[STAGE])
    region = staging[s : s + int(row[NBYTES])]
    return region.view(numpy_dtype(dtype)).reshape(tuple(int(v) for v in row[SHAPE0 : SHAPE0 + nd]))


def pack_cpu(table: np.ndarray, buffers: Sequence[np.ndarray], staging: np.ndarray) -> None:
    """Copy every piece of ``table`` out of ``buffers`` (1-D uint8) into ``staging`` (1-D uint8),
    casting the cast rows' elements on the way.

    The byte rows and the float32 -> bfloat16 cast rows run in the compiled kernel where it was built
    (:func:`compiled_rows`), the other cast rows, and every row where it was not built, in numpy. Every row is
    checked against the size of its buffer and of the staging before any byte moves.

    Raises:
      ValueError: a row leaves its buffer or staging, or names a missing buffer (nothing was written).
    """
    compiled, rest = _split(table, buffers, staging, unpack=False)
    jobs = _jobs(rest, buffers, staging, unpack=False)  # the numpy rows' views, checked before anything moves
    _run_compiled(compiled, staging, unpack=False)
    _run(jobs)


def unpack_cpu(table: np.ndarray, staging: np.ndarray, buffers: Sequence[np.ndarray]) -> None:
    """Copy every piece of ``table`` out of ``staging`` into its place in ``buffers``, casting the cast rows
    (the byte rows compiled, every row checked first, as :func:`pack_cpu`).

    Raises:
      ValueError: a row leaves its buffer or staging, names a missing buffer, or writes a read-only one
        (nothing was written).
    """
    compiled, rest = _split(table, buffers, staging, unpack=True)
    jobs = _jobs(rest, buffers, staging, unpack=True)
    _run_compiled(compiled, staging, unpack=True)
    _run(jobs)


def _pack_numpy(table: np.ndarray, buffers: Sequence[np.ndarray], staging: np.ndarray) -> None:
    """:func:`pack_cpu` in numpy alone (the reference the compiled kernel is tested against)."""
    _run(_jobs(table, buffers, staging, unpack=False))


def _unpack_numpy(table: np.ndarray, staging: np.ndarray, buffers: Sequence[np.ndarray]) -> None:
    """:func:`unpack_cpu` in numpy alone."""
    _run(_jobs(table, buffers, staging, unpack=True))


_Job = tuple[np.ndarray, np.ndarray, tuple[str, ...]]  # (written, read, the casts between): cast_into's arguments


def _jobs(table: np.ndarray, buffers: Sequence[np.ndarray], staging: np.ndarray, *, unpack: bool) -> list[_Job]:
    """Each row's typed views (each checked against its buffer and staging), in the direction of the copy."""
    jobs = []
    for row in table:
        buf = _buffer(row, buffers)
        chain = chain_of(row[CAST])
        if chain:  # a pack reads chain[0] from the buffer and stages chain[-1]; an unpack the other way round
            shard = _typed(row, buf, chain[-1] if unpack else chain[0])
            stage = _typed_stage(row, staging, chain[0] if unpack else chain[-1])
        else:
            shard, stage = _view(row, buf, unpack), _stage_view(row, staging)
        jobs.append((shard, stage, chain[1:]) if unpack else (stage, shard, chain[1:]))
    return jobs


def _buffer(row: np.ndarray, buffers: Sequence[np.ndarray]) -> np.ndarray:
    b = int(row[BUF])
    buf = buffers[b] if 0 <= b < len(buffers) else None
    if buf is None:
        raise ValueError(f"a descriptor row names a missing buffer {b} (of {len(buffers)}): row {row.tolist()}")
    return buf


def _run(jobs: list[_Job]) -> None:
    for out, x, chain in jobs:
        cast_into(out, x, chain)  # no chain: np.copyto


_rows_module: ModuleType | None
try:
    from jreshard.schedule import _rows as _rows_module
except ImportError:  # not built (no compiler, or a checkout run in place)
    _rows_module = None
_LAYOUT = ("COLUMNS", "MAX_DIMS", "BUF", "OFF", "STAGE", "NBYTES", "NDIM", "SHAPE0", "STRIDE0", "CAST")
_ROWS = (
    _rows_module
    if _rows_module is not None and all(getattr(_rows_module, n) == globals()[n] for n in _LAYOUT)
    else None
)
_NO_ROWS = np.zeros((0, COLUMNS), np.int64)
PACK_CAST, UNPACK_CAST = chain_code(("float32", "bfloat16")), chain_code(("bfloat16", "float32"))
"""The ``CAST`` codes of the cast rows the compiled kernels run (``_rows.h``): a pack's float32 -> bfloat16 and an
unpack's bfloat16 -> float32."""


def compiled_cast_codes(module: ModuleType | None) -> bool:
    """Whether a compiled module (``_rows``, ``_replay``) was built with this module's cast codes."""
    got = (getattr(module, "CAST_F32_BF16", None), getattr(module, "CAST_BF16_F32", None))
    return module is not None and got == (PACK_CAST, UNPACK_CAST)


_CAST_ROWS = compiled_cast_codes(_ROWS)


def compiled_rows() -> bool:
    """Whether the compiled byte rows (``jreshard/schedule/_rows.c``) were built, load, and read this
    module's columns."""
    return _ROWS is not None


def _flat(buf: np.ndarray | None) -> bool:
    return buf is not None and buf.ndim == 1 and buf.dtype == np.uint8 and buf.flags.c_contiguous


_Compiled = tuple[np.ndarray, np.ndarray, np.ndarray, int]  # (rows, addresses, sizes, buffers) for copy_rows


def _split(
    table: np.ndarray, buffers: Sequence[np.ndarray], staging: np.ndarray, *, unpack: bool
) -> tuple[_Compiled | None, np.ndarray]:
    """The rows of ``table`` the compiled kernel takes (byte rows, and a pack's float32 -> bfloat16 or an unpack's
    bfloat16 -> float32 cast rows), with the addresses and sizes of their buffers, and the rows left for numpy
    (other casts, rows of a buffer that is not flat uint8, every row where it was not built). Nothing moves.

    Raises:
      ValueError: a read-only buffer a row would write into.
    """
    if _ROWS is None or not len(table) or not _flat(staging) or (not unpack and not staging.flags.writeable):
        return None, table
    t, take, named, kept, rest, casts = _byte_rows(table)
    resplit = False  # a buffer that is not flat, or a cast of the other direction: its rows go to numpy
    other = PACK_CAST if unpack else UNPACK_CAST  # a pack's cast in an unpack, or the reverse
    if other in casts:
        take, resplit = take & (t[:, CAST] != other), True
    addresses = np.zeros(len(buffers), np.int64)
    sizes = np.zeros(len(buffers), np.int64)
    for b in named:
        buf = buffers[b] if 0 <= b < len(buffers) else None
        if buf is None:
            continue  # the kernel refuses the row: a missing buffer
        if not _flat(buf):
            take, resplit = take & (t[:, BUF] != b), True
            continue
        if unpack and not buf.flags.writeable:
            raise ValueError(f"unpack_cpu: buffer {b} is read-only; a descriptor row would write into it")
        addresses[b], sizes[b] = buf.ctypes.data, buf.nbytes
    if resplit:
        kept, rest = _take(t, take)
    return (None if kept is None else (kept, addresses, sizes, len(buffers))), rest


_ROW_CACHE: dict[int, tuple[weakref.ref, tuple]] = {}
"""``id(table) -> (a weak reference to it, its analysis)`` for tables that cannot change (the schedule's, which
every round of every refit runs again): an entry lives as long as its table, so a schedule's tables stay analysed
while the schedule lives, however many there are, and go with it."""
_SELF = object()  # stands for the table itself in a cached analysis (which must not keep its table alive)


def _frozen(a: object) -> bool:
    """Whether no one can write ``a``'s elements: it and every array it views are read-only."""
    while isinstance(a, np.ndarray):
        if a.flags.writeable:
            return False
        a = a.base
    return a is None or isinstance(a, bytes)  # memory nothing else can write


def _take(t: np.ndarray, take: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
    """The rows ``take`` picks out of ``t`` for the kernel (None: none) and the rest."""
    if not take.any():
        return None, t
    if take.all():
        return t, _NO_ROWS
    return np.ascontiguousarray(t[take]), t[~take]


def _byte_rows(
    table: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray | None, np.ndarray, frozenset[int]]:
    """``table`` as C-ordered int64, which of its rows the kernel can take (byte rows with a unit innermost
    stride, and the float32 <-> bfloat16 cast rows), the buffers they name, those rows and the rest
    (:func:`_take`), and the cast codes among them. Cached for tables that cannot change (the schedule's, which
    every round of every refit runs again)."""
    hit = _ROW_CACHE.get(id(table))
    if hit is not None and hit[0]() is table:
        return tuple(table if x is _SELF else x for x in hit[1])  # type: ignore[return-value]
    t = np.ascontiguousarray(table, np.int64)
    nd = np.clip(t[:, NDIM], 1, MAX_DIMS)
    take = (t[:, CAST] == 0) & (t[np.arange(len(t)), STRIDE0 + nd - 1] == 1)
    casts: frozenset[int] = frozenset()
    if _CAST_ROWS:  # (each direction's own: _split drops the other's)
        cast = (t[:, CAST] == PACK_CAST) | (t[:, CAST] == UNPACK_CAST)
        take |= cast
        casts = frozenset(np.unique(t[cast, CAST]).tolist())
    take.setflags(write=False)
    got = (t, take, np.unique(t[take, BUF]).tolist(), *_take(t, take), casts)
    if _frozen(table):
        key = id(table)
        gone = lambda _, key=key: _ROW_CACHE.pop(key, None)  # noqa: E731 - the table died: so does its entry
        _ROW_CACHE[key] = (weakref.ref(table, gone), tuple(_SELF if x is table else x for x in got))
    return got


def _run_compiled(job: _Compiled | None, staging: np.ndarray, *, unpack: bool) -> None:
    """Run :func:`_split`'s rows in the kernel, which checks them all before it moves a byte.

    Raises:
      ValueError: a row the kernel refused (nothing was written).
    """
    if job is None:
        return
    assert _ROWS is not None
    rows, addresses, sizes, n = job
    bad = _ROWS.copy_rows(
        rows.ctypes.data,
        len(rows),
        addresses.ctypes.data,
        sizes.ctypes.data,
        n,
        staging.ctypes.data,
        staging.nbytes,
        unpack,
    )
    if bad >= 0:
        row = rows[bad]
        b = int(row[BUF])
        have = int(sizes[b]) if 0 <= b < n else None
        raise ValueError(
            f"a descriptor row leaves its buffer or staging, or names a missing buffer: row {row.tolist()} "
            f"(buffer {b} of {have} bytes, staging of {staging.nbytes} bytes); nothing was written"
        )


def copy_cpu(
    src_table: np.ndarray, src_buffers: Sequence[np.ndarray], dst_table: np.ndarray, dst_buffers: Sequence[np.ndarray]
) -> None:
    """Copy piece ``i`` of ``src_table`` straight into piece ``i`` of ``dst_table`` (no
    staging); the tables come from :func:`build_copy_tables`."""
    for s, d in zip(src_table, dst_table, strict=True):
        if s[CAST]:
            chain = chain_of(s[CAST])
            out = _typed(d, dst_buffers[int(d[BUF])], chain[-1])
            cast_into(out, _typed(s, src_buffers[int(s[BUF])], chain[0]), chain[1:])
            continue
        np.copyto(_view(d, dst_buffers[int(d[BUF])], True), _view(s, src_buffers[int(s[BUF])], False))
