"""The in-process copy executor of views: the copies that carry out a lowering in one process, worked
out once per lowering (:func:`compile_tasks`, cached by the caller) and run on the copy threads
(:func:`execute_pieces`).

A lowering (:mod:`jreshard.views.lowering`) says which source box fills which
destination box; this module turns it into numpy work with every index computed
ahead, so a warm refit spends its time in copies and casts, not in Python:

- a **block** casts a band of whole rows of one source shard once into the wire dtype
  (the sender's casts, to a narrower dtype), small enough to stay in a core's
  cache, and then copies each piece's part of the band into its destination. A
  source element that several destination shards need (data-parallel replicas,
  repeated key/value heads) is cast once, and numpy casts a contiguous band several
  times faster than a strided piece;
- a **shard job** runs the other pieces of one destination shard: strided copies
  from the source shards, cast on the way (receiver-side casts widen, so casting
  in the copy costs nothing extra).

Tasks write disjoint boxes (every destination element comes from one piece), so
they run on a thread pool (numpy releases the GIL in copies and casts). A block-FP8
leaf's pieces fill a tile of whole blocks per destination shard, quantised after
(:mod:`jreshard.views.quant`). Pure numpy: no jax. Message passing (several processes,
GPUs) runs views through the round loop instead (:mod:`jreshard.engine.viewrun`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import jreshard.views.native as native
from jreshard.engine import strided
from jreshard.sharding.box import Box, intersect
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.views.algebra import View
from jreshard.views.casts import cast_into
from jreshard.views.lowering import LeafLowering, QuantTask, ViewPiece
from jreshard.views.quant import QuantView

__all__ = [
    "BLOCK_BYTES",
    "Block",
    "Copy",
    "CopyTasks",
    "Scatter",
    "ShardJob",
    "compile_tasks",
    "execute_pieces",
    "run_copy",
    "run_task",
    "task_elements",
]

BLOCK_BYTES = 4 << 20  # wire bytes cast at once into a band that stays in the shared cache while its pieces copy out


@dataclasses.dataclass(frozen=True, slots=True)
class Copy:
    """``out[dst] = cast(source[src].transpose(perm).reshape(shape))`` into destination shard ``(leaf, rank)``.

    ``perm`` is ``None`` when the source axes already run in destination order;
    ``source`` is a source shard, or a block's cast band.
    """

    leaf: int
    rank: int
    dst: tuple[slice, ...]
    src: tuple[slice, ...]
    perm: tuple[int, ...] | None
    shape: tuple[int, ...]
    casts: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Scatter:
    """A block's copies as runs of one band row each, for the compiled cast-and-scatter kernel.

    Row ``i`` of ``table`` is ``(band row, first column, columns, destination slot)``,
    sorted by band row; the run goes to byte ``offsets[i]`` of destination shard
    ``dests[slot]`` (a ``(leaf, rank)``), whose shape is ``shapes[slot]``. The band is
    seen as rows of ``row_elems`` elements (its last axis).
    """

    table: np.ndarray
    offsets: np.ndarray
    dests: tuple[tuple[int, int], ...]
    shapes: tuple[tuple[int, ...], ...]
    row_elems: int


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """Cast ``rows`` of source shard ``key`` into ``dtype`` with ``casts``; then run ``copies`` from the band.

    ``scatter`` is set when the compiled kernel of :mod:`jreshard.views.native` can run
    the block in one pass (float32 to bfloat16, every copy a run of band rows).
    """

    key: tuple[int, int]
    rows: tuple[slice, ...]
    shape: tuple[int, ...]
    dtype: str
    casts: tuple[str, ...]
    copies: tuple[tuple[tuple[int, int], Copy], ...]  # (source shard key, copy) with the band as the source
    scatter: Scatter | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ShardJob:
    """The copies of one destination shard read straight from source shards."""

    copies: tuple[tuple[tuple[int, int], Copy], ...]  # (source shard key, copy)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Scatters:
    """Every block of a :class:`CopyTasks` that the compiled float32 -> bfloat16 kernel runs, as one table.

    A call reads each source shard's and each destination shard's address and size once, fills the table's
    destination columns for every block in two vectorised steps and calls the kernel once per block with plain
    integers: a tree of many small leaves pays a few microseconds a block instead of building each block's table.

    Attributes:
      tasks: the blocks' positions in :attr:`CopyTasks.tasks`.
      src_keys, src_shapes: the source shards ``(leaf, rank)`` the blocks read, each once, and their shapes.
      dst_keys, dst_shapes: the destination shards ``(leaf, rank)`` they write, each once, and their shapes.
      task_src: per block, its source shard (an index into ``src_keys``).
      band: per block ``(byte offset in its source shard, bytes, row stride in bytes, rows, row elements,
        first table row, table rows)``; the band is a C-contiguous run of its shard's bytes.
      table: ``(entries, 5)`` int64, the kernel's rows with columns 0-2 filled (band row, first column, columns).
      slot: per table row, its destination shard (an index into ``dst_keys``).
      offsets: per table row, its byte offset in that shard.
    """

    tasks: tuple[int, ...]
    src_keys: tuple[tuple[int, int], ...]
    src_shapes: tuple[tuple[int, ...], ...]
    dst_keys: tuple[tuple[int, int], ...]
    dst_shapes: tuple[tuple[int, ...], ...]
    task_src: np.ndarray
    band: np.ndarray
    table: np.ndarray
    slot: np.ndarray
    offsets: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class CopyTasks:
    """Every task of a lowering; ``wire_bytes``: the bytes its pieces carry; ``scatters``: its blocks that the
    compiled kernel runs, as one table (``None``: none, or the kernel was not built)."""

    tasks: tuple[Block | ShardJob, ...]
    wire_bytes: int
    scatters: Scatters | None = None


def compile_tasks(
    lowerings: Sequence[LeafLowering],
    src_boxes: Mapping[tuple[int, int], Box],
    block_bytes: int | None = None,
    dst_shapes: Mapping[tuple[int, int], tuple[int, ...]] | None = None,
) -> CopyTasks:
    """The tasks that run the pieces of ``lowerings`` (quantisation tasks are not included).

    ``src_boxes[(leaf, rank)]`` is the box of the source shard a piece reads;
    ``dst_shapes[(t, rank)]``, when given, the shape of destination shard ``rank`` of
    leaf ``t``, so blocks the compiled kernel can run get their :class:`Scatter`.

    Pieces with sender casts that read one source shard become blocks when their
    source boxes fill at least their hull once (else each piece is cast on its own).

    Example:
      >>> from jreshard.sharding.topology import Link
      >>> box = Box((0, 0), (4, 8))
      >>> p = ViewPiece(0, 0, box, 1, box, (0, 1), "float32", ("bfloat16",), (), Link.SAME_DEVICE)
      >>> low = LeafLowering((p,), (), 0, 0, 64)
      >>> work = compile_tasks([low], {(0, 0): Box((0, 0), (4, 8))}, block_bytes=32)
      >>> [type(t).__name__ for t in work.tasks], work.wire_bytes
      (['Block', 'Block'], 64)
    """
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    jobs: dict[tuple[int, int], list[tuple[tuple[int, int], Copy]]] = {}
    narrowed: dict[tuple[int, int, tuple[str, ...]], list[tuple[int, ViewPiece]]] = {}
    wire = 0
    for t, low in enumerate(lowerings):
        for p in low.pieces:
            wire += p.wire_bytes
            if p.sender_casts and p.src_box.ndim > 0:
                narrowed.setdefault((p.leaf, p.src_rank, p.sender_casts), []).append((t, p))
            else:
                jobs.setdefault((t, p.dst_rank), []).append(_direct(t, p, src_boxes))
    tasks: list[Block | ShardJob] = [ShardJob(tuple(c)) for c in jobs.values()]
    for group in narrowed.values():
        hull = _hull([p.src_box for _, p in group])
        if hull.volume > sum(p.src_box.volume for _, p in group):  # the pieces cover little of it
            tasks += [ShardJob((_direct(t, p, src_boxes),)) for t, p in group]
            continue
        bands = _bands(hull, group[0][1].wire_dtype, block_bytes)
        tasks += [_block(group, rows, src_boxes, dst_shapes) for rows in bands]
    tasks.sort(key=task_elements, reverse=True)  # the largest first
    return CopyTasks(tuple(tasks), wire, _scatters(tasks, src_boxes))


def _scatters(tasks: Sequence[Block | ShardJob], src_boxes: Mapping[tuple[int, int], Box]) -> Scatters | None:
    """The blocks of ``tasks`` that the compiled kernel runs, as one :class:`Scatters` (``None``: none).

    A block qualifies when it has a :class:`Scatter` for the float32 -> bfloat16 kernel and its band is one
    C-contiguous run of its source shard (whole rows: how :func:`_bands` cuts them)."""
    picked: list[int] = []
    bands: list[tuple[int, ...]] = []
    src_at: dict[tuple[int, int], int] = {}
    dst_at: dict[tuple[int, int], int] = {}
    shapes: dict[tuple[int, int], tuple[int, ...]] = {}
    tables, slots, offsets, task_src = [], [], [], []
    first = 0
    for i, task in enumerate(tasks):
        # (a block has a Scatter only where its source dtype and casts have a kernel: float32 to bfloat16 alone)
        if (
            not isinstance(task, Block)
            or task.scatter is None
            or native.SCATTER_RAW.get(("float32", task.casts)) is None
        ):
            continue
        shape = src_boxes[task.key].shape
        span = _contiguous_span(shape, task.rows, 4)
        sc = task.scatter
        if span is None or span[1] != 4 * math.prod(task.shape):
            continue
        picked.append(i)
        task_src.append(src_at.setdefault(task.key, len(src_at)))
        here = np.array([dst_at.setdefault(d, len(dst_at)) for d in sc.dests], np.int64)
        shapes.update(zip(sc.dests, sc.shapes, strict=True))
        n = len(sc.table)
        stride = 4 * task.shape[-1]
        bands.append((span[0], span[1], stride, math.prod(task.shape) // sc.row_elems, sc.row_elems, first, n))
        tables.append(sc.table[:, :3])
        slots.append(here[sc.table[:, 3]])
        offsets.append(sc.offsets)
        first += n
    if not picked:
        return None
    table = np.zeros((first, 5), np.int64)
    table[:, :3] = np.concatenate(tables)
    return Scatters(
        tasks=tuple(picked),
        src_keys=tuple(src_at),
        src_shapes=tuple(src_boxes[k].shape for k in src_at),
        dst_keys=tuple(dst_at),
        dst_shapes=tuple(shapes[k] for k in dst_at),
        task_src=np.array(task_src, np.int64),
        band=np.array(bands, np.int64).reshape(-1, 7),
        table=table,
        slot=np.concatenate(slots),
        offsets=np.concatenate(offsets).astype(np.int64),
    )


def _contiguous_span(shape: tuple[int, ...], index: tuple[slice, ...], itemsize: int) -> tuple[int, int] | None:
    """``(byte offset, bytes)`` of ``a[index]`` in a C-contiguous ``a`` of ``shape`` where that is one contiguous
    run of ``a``: every axis before the first of several indices takes one, every axis after it is whole (``None``
    otherwise, or where it is empty).

    >>> _contiguous_span((6, 4), (slice(2, 5), slice(0, 4)), 4), _contiguous_span((6, 4), (slice(2, 5), slice(0, 2)), 4)
    ((32, 48), None)
    >>> _contiguous_span((6, 4, 2), (slice(3, 4), slice(1, 3)), 4)
    (104, 16)
    """
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape) or not all(isinstance(sl, slice) for sl in index):
        return None
    offset, size, several = 0, itemsize, False
    for d, sl in enumerate(index):
        start, stop, step = sl.indices(shape[d])
        n = len(range(start, stop, step))
        if n == 0 or (n > 1 and step != 1) or (several and n != shape[d]):
            return None
        several = several or n > 1
        offset += start * itemsize * math.prod(shape[d + 1 :])
        size *= n
    return offset, size


def task_elements(task: Block | ShardJob) -> int:
    """Elements the task writes (its copies' sizes): its weight when tasks are spread over threads."""
    return sum(math.prod(c.shape) for _, c in task.copies)


def _direct(t: int, p: ViewPiece, src_boxes: Mapping[tuple[int, int], Box]) -> tuple[tuple[int, int], Copy]:
    key = (p.leaf, p.src_rank)
    return key, _copy(t, p, p.src_box.relative_to(src_boxes[key]), p.sender_casts + p.receiver_casts)


def _copy(t: int, p: ViewPiece, rel: Box, casts: tuple[str, ...]) -> Copy:
    order = p.source_order
    moved = [a for a in order if rel.shape[a] != 1]  # axes of extent 1 may go anywhere: the order is the same
    perm = None if moved == sorted(moved) else order
    return Copy(t, p.dst_rank, (*p.dst_box.slices(), ...), (*rel.slices(), ...), perm, p.dst_box.shape, casts)  # type: ignore[arg-type]


def _hull(boxes: Sequence[Box]) -> Box:
    lo = tuple(min(b.lo[d] for b in boxes) for d in range(boxes[0].ndim))
    hi = tuple(max(b.hi[d] for b in boxes) for d in range(boxes[0].ndim))
    return Box(lo, hi)


def _bands(hull: Box, dtype: str, block_bytes: int) -> list[Box]:
    """``hull`` cut into bands of about ``block_bytes`` (in ``dtype``), each a run of whole rows.

    The cut runs along the outermost axis ``d`` whose inner rows (the axes after it)
    fit ``block_bytes``; every axis before ``d`` is cut to extent 1.

    >>> [(b.lo, b.hi) for b in _bands(Box((0, 0, 0), (2, 4, 8)), "float32", 64)]
    [((0, 0, 0), (1, 2, 8)), ((0, 2, 0), (1, 4, 8)), ((1, 0, 0), (2, 2, 8)), ((1, 2, 0), (2, 4, 8))]
    """
    if hull.volume == 0:
        return []
    item, shape = numpy_dtype(dtype).itemsize, hull.shape
    d = 0
    while d < hull.ndim - 1 and math.prod(shape[d + 1 :]) * item > block_bytes:
        d += 1
    step = max(1, block_bytes // (math.prod(shape[d + 1 :]) * item))
    out = []
    for outer in itertools.product(*(range(lo, hi) for lo, hi in zip(hull.lo[:d], hull.hi[:d], strict=True))):
        for a in range(hull.lo[d], hull.hi[d], step):
            lo = (*outer, a, *hull.lo[d + 1 :])
            hi = (*(i + 1 for i in outer), min(a + step, hull.hi[d]), *hull.hi[d + 1 :])
            out.append(Box(lo, hi))
    return out


def _block(
    group: list[tuple[int, ViewPiece]],
    rows: Box,
    src_boxes: Mapping[tuple[int, int], Box],
    dst_shapes: Mapping[tuple[int, int], tuple[int, ...]] | None,
) -> Block:
    first = group[0][1]
    key = (first.leaf, first.src_rank)
    copies = []
    for t, p in group:
        part = _restrict(p, rows)
        if part is not None:
            copies.append((key, _copy(t, part, part.src_box.relative_to(rows), p.receiver_casts)))
    band = rows.relative_to(src_boxes[key])
    scatter = None
    if dst_shapes is not None and native.SCATTER.get((first.src_dtype, first.sender_casts)) is not None:
        scatter = _scatter([c for _, c in copies], rows.shape, dst_shapes)
    return Block(key, band.slices(), rows.shape, first.wire_dtype, first.sender_casts, tuple(copies), scatter)


def _scatter(
    copies: Sequence[Copy], band: tuple[int, ...], dst_shapes: Mapping[tuple[int, int], tuple[int, ...]]
) -> Scatter | None:
    """The copies as runs of band rows (see :class:`Scatter`); ``None`` when one is not such a run.

    A copy qualifies when it keeps the axis order, adds no cast, and its last axis is
    the band's last axis on both ends (same extent): then each index of its other
    axes is one run of contiguous elements in the band and in the destination.

    >>> c = Copy(0, 5, (slice(2, 4), slice(0, 3), ...), (slice(1, 3), slice(4, 7), ...), None, (2, 3), ())
    >>> sc = _scatter([c], (4, 8), {(0, 5): (6, 3)})
    >>> sc.table.tolist(), sc.offsets.tolist(), sc.dests, sc.row_elems
    ([[1, 4, 3, 0], [2, 4, 3, 0]], [12, 18], ((0, 5),), 8)
    """
    if not band or not copies:
        return None
    slots: dict[tuple[int, int], int] = {}
    tables, offsets = [], []
    for c in copies:
        dshape = dst_shapes[(c.leaf, c.rank)]
        src, dst = c.src[:-1], c.dst[:-1]  # the trailing Ellipsis off
        if c.perm is not None or c.casts or not dshape or len(src) != len(band) or len(dst) != len(dshape):
            return None
        run = src[-1].stop - src[-1].start
        if dst[-1].stop - dst[-1].start != run or math.prod(c.shape) == 0:
            return None
        src_starts = _run_starts(src, band)
        dst_starts = _run_starts(dst, dshape)
        slot = slots.setdefault((c.leaf, c.rank), len(slots))
        rows = np.empty((len(src_starts), 4), np.int64)
        rows[:, 0], rows[:, 1] = np.divmod(src_starts, band[-1])
        rows[:, 2], rows[:, 3] = run, slot
        tables.append(rows)
        offsets.append(dst_starts * 2)  # bfloat16 bytes
    table, offs = np.concatenate(tables), np.concatenate(offsets)
    order = np.lexsort((table[:, 1], table[:, 0]))
    dests = tuple(slots)
    sizes = np.array([2 * math.prod(dst_shapes[d]) for d in dests], np.int64)
    if np.any(offs + 2 * table[:, 2] > sizes[table[:, 3]]) or np.any(table[:, 1] + table[:, 2] > band[-1]):
        raise AssertionError("a scatter run leaves its band or its destination shard")  # the kernel trusts the table
    return Scatter(table[order], offs[order], dests, tuple(dst_shapes[d] for d in dests), band[-1])


def _run_starts(index: tuple[slice, ...], shape: tuple[int, ...]) -> np.ndarray:
    """Flat offsets (C order, elements) of the first element of each run along the last axis of ``a[index]``."""
    strides = np.cumprod((1, *shape[:0:-1]))[::-1]
    starts = np.zeros((), np.int64) + index[-1].start
    for sl, stride in zip(index[:-1], strides[:-1], strict=True):
        starts = np.add.outer(starts, np.arange(sl.start, sl.stop, dtype=np.int64) * stride)
    return starts.ravel()


def _restrict(p: ViewPiece, band: Box) -> ViewPiece | None:
    """The part of piece ``p`` whose source elements lie in ``band``."""
    src = intersect(p.src_box, band)
    if src is None or src.volume == 0:
        return None
    if src == p.src_box:
        return p
    dlo, dhi = list(p.dst_box.lo), list(p.dst_box.hi)
    for a, (lo, hi) in enumerate(zip(src.lo, src.hi, strict=True)):
        if (lo, hi) != (p.src_box.lo[a], p.src_box.hi[a]):
            j = p.axes.index(a)  # the piece spans more than one index of axis a, so a destination axis runs along it
            dlo[j], dhi[j] = dlo[j] + lo - p.src_box.lo[a], dlo[j] + hi - p.src_box.lo[a]
    return dataclasses.replace(p, src_box=src, dst_box=Box(tuple(dlo), tuple(dhi)))


def run_copy(c: Copy, source: np.ndarray, out: np.ndarray) -> None:
    """Run one :class:`Copy` from ``source`` into the destination shard ``out``."""
    v = source[c.src]
    if c.perm is not None:
        v = v.transpose(c.perm)
    if v.shape != c.shape:
        v = v.reshape(c.shape)  # only axes of extent 1 come or go: a view
    cast_into(out[c.dst], v, c.casts)


def run_task(
    task: Block | ShardJob, src: Mapping[tuple[int, int], np.ndarray], dst: Sequence[Mapping[int, np.ndarray]]
) -> None:
    """Run one task: ``src[(leaf, rank)]`` are the typed source shards, ``dst[t][rank]`` the destination shards."""
    if isinstance(task, ShardJob):
        for key, c in task.copies:
            run_copy(c, src[key], dst[c.leaf][c.rank])
        return
    if task.scatter is not None and _run_scatter(task.scatter, src[task.key][task.rows], dst, task.casts):
        return
    band = np.empty(task.shape, numpy_dtype(task.dtype))
    cast_into(band, src[task.key][task.rows], task.casts)
    for _, c in task.copies:
        run_copy(c, band, dst[c.leaf][c.rank])


def _run_scatter(
    sc: Scatter, band: np.ndarray, dst: Sequence[Mapping[int, np.ndarray]], casts: tuple[str, ...]
) -> bool:
    """Run a block with the compiled kernel; ``False`` (nothing written) unless every array is as compiled."""
    kernel = native.SCATTER.get((band.dtype.name, casts))
    outs = [dst[t][r] for t, r in sc.dests]
    if kernel is None or not band.flags.c_contiguous or not band.flags.aligned:
        return False
    for out, shape in zip(outs, sc.shapes, strict=True):
        if out.shape != shape or out.dtype.name != "bfloat16" or not (out.flags.c_contiguous and out.flags.writeable):
            return False
    bases = np.array([out.ctypes.data for out in outs], np.int64)
    ends = bases + np.array([out.nbytes for out in outs], np.int64)  # sizes from the buffers themselves
    table = np.empty((len(sc.table), 5), np.int64)
    table[:, :3] = sc.table[:, :3]
    table[:, 3] = bases[sc.table[:, 3]] + sc.offsets
    table[:, 4] = ends[sc.table[:, 3]]
    kernel(band.ctypes.data, band.shape[-1] * band.itemsize, band.size // sc.row_elems, sc.row_elems, table)
    return True


def execute_pieces(
    lowerings: Sequence[LeafLowering],
    copy_tasks: CopyTasks,
    views: Sequence[View],
    src: Mapping[tuple[int, int], np.ndarray],
    src_box: Mapping[tuple[int, int], Box],
    dst: Sequence[Mapping[int, np.ndarray]],
    threads: int | None = None,
) -> None:
    """Run ``copy_tasks`` (the lowerings' pieces) and the quantisation tasks: ``src[(leaf, rank)]`` is a
    typed read-only source shard holding ``src_box[(leaf, rank)]``; ``dst[t][rank]`` the typed
    destination shard of leaf ``t``; on ``threads`` threads (``Options.copy_threads``; ``None``: every core).

    A quantised leaf's pieces fill a tile of whole blocks per destination shard, quantised after.
    """

    def quantised(t: int, task: QuantTask) -> None:
        quant = views[t]
        assert isinstance(quant, QuantView)
        tile = np.empty(task.hull.shape, numpy_dtype(quant.x.dtype))
        for p in task.pieces:
            _copy_piece(p, src, src_box, tile)
        dst[t][task.dst_rank][...] = quant.compute(tile, task.hull, task.box)

    kernel_calls, _table = _kernel_calls(copy_tasks.scatters, src, dst)  # (the calls read _table: kept until they ran)
    skip = () if kernel_calls is None else set(copy_tasks.scatters.tasks)  # type: ignore[union-attr]
    calls: list[tuple[int, Any, tuple]] = [
        (task_elements(t), run_task, (t, src, dst)) for i, t in enumerate(copy_tasks.tasks) if i not in skip
    ]
    calls += kernel_calls or []
    calls += [(k.hull.volume, quantised, (t, k)) for t, low in enumerate(lowerings) for k in low.tasks]
    lanes = 1 if copy_tasks.wire_bytes < _THREADED_BYTES else min(len(calls), strided.threads_for(threads))
    if lanes <= 1:
        for _, fn, args in calls:
            fn(*args)
        return
    # numpy and the compiled casts release the GIL; the tasks write disjoint boxes. Largest first, each
    # thread taking the next task as it finishes, so the threads finish together.
    calls.sort(key=lambda c: -c[0])
    strided.run_shared([functools.partial(fn, *args) for _, fn, args in calls], lanes)


_THREADED_BYTES = 4 << 20


def _kernel_calls(
    sc: Scatters | None, src: Mapping[tuple[int, int], np.ndarray], dst: Sequence[Mapping[int, np.ndarray]]
) -> tuple[list[tuple[int, Any, tuple]] | None, np.ndarray | None]:
    """The compiled kernel's call for every block of ``sc`` over this call's shards, as ``(weight, kernel,
    integer arguments)``, and the table they read (the caller keeps it alive until they ran); ``(None, None)``
    where there is none, or where a shard is not as compiled (its shape, dtype, layout, or a read-only
    destination): then the blocks run one by one (:func:`run_task`), which checks each again.

    Every address and size is read from the shards themselves; the kernel checks every table row against its
    band and its destination's end, and each band is checked here to lie within its source shard."""
    kernel = native.SCATTER_RAW.get(("float32", ("bfloat16",)))
    if sc is None or kernel is None:
        return None, None
    f32, bf16 = np.dtype(np.float32), numpy_dtype("bfloat16")
    srcs = [src[k] for k in sc.src_keys]
    dsts = [dst[t][r] for t, r in sc.dst_keys]
    for a, shape in zip(srcs, sc.src_shapes, strict=True):
        if a.shape != shape or a.dtype != f32 or not (a.flags.c_contiguous and a.flags.aligned):
            return None, None
    for a, shape in zip(dsts, sc.dst_shapes, strict=True):
        if a.shape != shape or a.dtype != bf16 or not (a.flags.c_contiguous and a.flags.writeable):
            return None, None
    src_addr = np.array([a.ctypes.data for a in srcs], np.int64)
    src_size = np.array([a.nbytes for a in srcs], np.int64)
    dst_addr = np.array([a.ctypes.data for a in dsts], np.int64)
    dst_end = dst_addr + np.array([a.nbytes for a in dsts], np.int64)  # sizes from the buffers themselves
    band = sc.band
    if np.any(band[:, 0] + band[:, 1] > src_size[sc.task_src]):  # pragma: no cover - shapes were checked
        return None, None
    table = sc.table.copy()
    table[:, 3] = dst_addr[sc.slot] + sc.offsets
    table[:, 4] = dst_end[sc.slot]
    at = (src_addr[sc.task_src] + band[:, 0]).tolist()
    rows = (table.ctypes.data + 40 * band[:, 5]).tolist()
    return [
        (nbytes // 4, kernel, (a, stride, n, elems, t, entries))
        for a, t, (_, nbytes, stride, n, elems, _, entries) in zip(at, rows, band.tolist(), strict=True)
    ], table


def _copy_piece(p: ViewPiece, src: Mapping, src_box: Mapping, out: np.ndarray) -> None:
    """Copy piece ``p`` into ``out`` with its casts."""
    s = src[(p.leaf, p.src_rank)]
    o = src_box[(p.leaf, p.src_rank)].lo
    region = s[(*(slice(a - b, c - b) for a, c, b in zip(p.src_box.lo, p.src_box.hi, o, strict=True)), ...)]
    v = region.transpose(p.source_order).reshape(p.dst_box.shape)
    where: Any = (*p.dst_box.slices(), ...)  # "...": 0-d views stay arrays
    cast_into(out[where], v, p.sender_casts + p.receiver_casts)
