"""Views on the engine's rounds: the pieces of a views lowering as a :class:`~jreshard.schedule.steps.Schedule`.

A lowering (:mod:`jreshard.views.lowering`) says which source box fills which box of
which destination shard, with the casts on each side of the wire and the axis
order. This module turns it into the rounds every transport runs
(:func:`jreshard.engine.rounds.execute`), so views get chunking, the staging bound,
``max_group_ops``, the report and every transport from the one round loop:

- **Messages.** A piece travels from its source rank at stage 0, or, when the
  lowering gave it a ``via`` rank (a rank of its domain that received those source
  elements over the network), from that rank at stage 1 over the fast links. A piece
  whose elements already reached its own rank (an element used twice) is a stage-1
  message the rank sends itself. All pieces one rank sends another at stage 0 are one
  message, in lowering order, cut into chunks of at most ``chunk_bytes`` (a chunk ends
  early rather than split an element, so no element is cast in halves); at stage 1, one
  message per rank the forwarded bytes came from, so a carrier forwards what two senders
  brought it as two messages side by side, as fast as they land.
- **Rows.** A piece is carried in its wire dtype (the sender's casts applied) and in its
  destination's axis order: the pack row reads the source shard with the source's strides
  in the destination's axis order (a transpose is strides) and casts into staging; the
  unpack row writes the destination with its own casts (:mod:`jreshard.schedule.kernels`,
  the ``CAST`` column). A piece read and written on one device is a same-device copy, cast and
  permuted the same way.
- **Forwarded bytes.** A stage-1 piece reads what its carrier received: the carrier's
  destination shard where that landing wrote the wire bytes unchanged, or else a *relay*
  region the landing also unpacks into (raw wire bytes). Each of its chunks goes in a round
  after the landed chunks it reads, so the fan-out of one chunk runs beside the network
  phase of the next (a chunk of an encoded landing waits for all of it). A forward the
  lowering planned that no single landing holds comes from its source rank at stage 0
  (kept as a safety net; the tests count bytes, so it does not hide).
- **Block FP8.** A quantised leaf whose blocks each lie in one source piece is quantised
  by the carrier before the rounds (an *encode* job into the carrier's auxiliary source
  buffer, sent as bytes); otherwise its pieces land in a tile of whole blocks of ``x``
  (in the receiver's auxiliary buffer) and the receiver quantises after the rounds (a
  *tile* job). The driver runs those two jobs (:mod:`jreshard.engine.viewrun`).

Buffers follow the engine's list per rank, ``[src(0), dst(0), src(1), dst(1), ...]``:
source leaf ``i`` is ``src(i)``, destination leaf ``t`` is ``dst(t)``, and the auxiliary
buffers (encoded bytes, relays and tiles) are ``src(aux)`` and ``dst(aux)``. Every process
builds the same schedule from the same lowering, with no communication. numpy only.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.options import Options
from jreshard.schedule import kernels
from jreshard.schedule.steps import (
    DST,
    SRC,
    STAGE_ALIGN,
    STAGING,
    Schedule,
    Step,
    Wire,
    buffer_index,
    first_fit,
    tag_of,
)
from jreshard.sharding.box import Box, intersect
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Link, Topology
from jreshard.views.lowering import LeafLowering, ViewPiece

__all__ = [
    "PIPELINE_CHUNKS",
    "PIPELINE_MIN_CHUNK",
    "Encode",
    "Tile",
    "ViewSchedule",
    "chunk_elements",
    "pipeline_chunk",
    "view_schedule",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Encode:
    """Before the rounds, rank ``rank`` quantises destination leaf ``leaf`` over ``box`` from ``piece``
    (the values of ``x`` over ``hull``) into its auxiliary source buffer at byte ``offset``."""

    rank: int
    leaf: int
    piece: ViewPiece
    hull: Box
    box: Box
    offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class Tile:
    """After the rounds, rank ``rank`` quantises the tile at byte ``offset`` of its auxiliary destination
    buffer (the values of ``x`` over ``hull``, in ``dtype``) into its shard of leaf ``leaf`` over ``box``."""

    rank: int
    leaf: int
    hull: Box
    box: Box
    dtype: str
    offset: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ViewSchedule:
    """The rounds of a views lowering and the jobs around them.

    Attributes:
      schedule: the rounds (:class:`~jreshard.schedule.steps.Schedule`), run by the one round loop.
      aux: the tensor index of the auxiliary buffers.
      aux_src, aux_dst: per rank, the bytes of its auxiliary source / destination buffer (absent: none).
      encode, tiles: per rank, the quantisation jobs before and after the rounds.
      bytes_by_link: the bytes every rank together moves, by link (counted at the sender; same-device
        copies in the bytes they write).
    """

    schedule: Schedule
    aux: int
    aux_src: Mapping[int, int]
    aux_dst: Mapping[int, int]
    encode: Mapping[int, tuple[Encode, ...]]
    tiles: Mapping[int, tuple[Tile, ...]]
    bytes_by_link: Mapping[Link, int]


@dataclasses.dataclass(slots=True)
class _End:
    """Where a job's elements are read or written: buffer ``buf`` of rank ``rank``, from byte ``offset``,
    ``strides`` (bytes) per destination axis of the piece, items of ``itemsize``, through ``chain``."""

    rank: int
    buf: int
    offset: int
    strides: tuple[int, ...]
    itemsize: int
    chain: tuple[str, ...]


@dataclasses.dataclass(slots=True)
class _Job:
    piece: ViewPiece
    extents: tuple[int, ...]
    wire_item: int
    stage: int
    carrier: int
    dst: int
    link: Link
    read: _End
    writes: list[_End]
    landed: tuple[int, ...] = ()  # the jobs whose arrival this one forwards
    form: tuple | None = None  # an encoded job's payload: (leaf, source box, hull, box, part)
    last_round: int = -1
    chunks: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = dataclasses.field(default_factory=list)  # round, box
    chunk_boxes: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # the chunks as arrays, once placed


def _c_strides(shape: Sequence[int], item: int) -> tuple[int, ...]:
    out, acc = [], item
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _dot(a: Sequence[int], b: Sequence[int]) -> int:
    return sum(x * y for x, y in zip(a, b, strict=True))


class _Builder:
    def __init__(
        self,
        lowerings: Sequence[LeafLowering],
        layouts: Sequence[Layout],
        dsts: Sequence[Layout],
        topology: Topology,
        views_parts: Sequence[tuple[str, tuple[int, int], str] | None],
    ):
        self.lowerings, self.layouts, self.dsts, self.topo = lowerings, layouts, dsts, topology
        self.parts = views_parts  # per destination leaf: None, or (part, block, x dtype) of a quantised leaf
        self.aux = max(len(layouts), len(dsts))
        self.aux_src: dict[int, int] = collections.defaultdict(int)
        self.aux_dst: dict[int, int] = collections.defaultdict(int)
        self.encode: dict[int, list[Encode]] = collections.defaultdict(list)
        self.tiles: dict[int, list[Tile]] = collections.defaultdict(list)

    def _take(self, table: dict[int, int], rank: int, nbytes: int) -> int:
        at = -(-table[rank] // 64) * 64  # every region 64-byte aligned, so typed views of it are
        table[rank] = at + nbytes
        return at

    def source_end(self, p: ViewPiece) -> _End:
        lay = self.layouts[p.leaf]
        shard = lay.box_of(p.src_rank)
        item = numpy_dtype(p.src_dtype).itemsize
        st = _c_strides(shard.shape, item)
        off = _dot([a - o for a, o in zip(p.src_box.lo, shard.lo, strict=True)], st)
        chain = (p.src_dtype, *p.sender_casts) if p.sender_casts else ()
        return _End(
            p.src_rank, buffer_index(p.leaf, SRC), off, tuple(st[a] if a >= 0 else 0 for a in p.axes), item, chain
        )

    def dest_end(self, p: ViewPiece, t: int) -> _End:
        shape = self.dsts[t].box_of(p.dst_rank).shape
        item = numpy_dtype(p.dst_dtype).itemsize
        st = _c_strides(shape, item)
        chain = (p.wire_dtype, *p.receiver_casts) if p.receiver_casts else ()
        return _End(p.dst_rank, buffer_index(t, DST), _dot(p.dst_box.lo, st), st, item, chain)

    def jobs(self) -> list[_Job]:
        jobs: list[_Job] = []
        for t, low in enumerate(self.lowerings):
            for p in low.pieces:
                jobs.append(self._plain(p, self.source_end(p), [self.dest_end(p, t)]))
            part = self.parts[t]
            if low.tasks and part is None:
                raise ValueError(f"view_schedule: destination leaf {t} has quantisation tasks; give its quantised=")
            for task in low.tasks:
                assert part is not None
                if task.at_sender:
                    jobs += self._encoded(t, task, part)
                    continue
                item = numpy_dtype(part[2]).itemsize
                tile_at = self._take(self.aux_dst, task.dst_rank, task.hull.volume * item)
                self.tiles[task.dst_rank].append(Tile(task.dst_rank, t, task.hull, task.box, part[2], tile_at))
                st = _c_strides(task.hull.shape, item)
                for p in task.pieces:
                    chain = (p.wire_dtype, *p.receiver_casts) if p.receiver_casts else ()
                    w = _End(p.dst_rank, buffer_index(self.aux, DST), tile_at + _dot(p.dst_box.lo, st), st, item, chain)
                    jobs.append(self._plain(p, self.source_end(p), [w]))
        return jobs

    def _plain(self, p: ViewPiece, read: _End, writes: list[_End]) -> _Job:
        return _Job(
            p, p.dst_box.shape, numpy_dtype(p.wire_dtype).itemsize, 0, p.src_rank, p.dst_rank, p.link, read, writes
        )

    def _encoded(self, t: int, task: Any, part: tuple[str, tuple[int, int], str]) -> list[_Job]:
        name, block, _ = part
        out = []
        shape = self.dsts[t].box_of(task.dst_rank).shape
        item = numpy_dtype(self.dsts[t].dtype).itemsize
        dst_st = _c_strides(shape, item)
        for p in task.pieces:
            hull = _global(p.dst_box, task.hull)
            box = intersect(hull, task.box) if name == "weights" else _block_box(hull, block)
            if box is None or box.volume == 0:
                continue  # a piece of a block this shard needs only to complete: nothing to send
            at = self._take(self.aux_src, p.src_rank, box.volume * item)
            self.encode[p.src_rank].append(Encode(p.src_rank, t, p, hull, box, at))
            read = _End(p.src_rank, buffer_index(self.aux, SRC), at, _c_strides(box.shape, item), item, ())
            rel = box.relative_to(task.box)
            write = _End(p.dst_rank, buffer_index(t, DST), _dot(rel.lo, dst_st), dst_st, item, ())
            j = _Job(p, box.shape, item, 0, p.src_rank, p.dst_rank, p.link, read, [write])
            j.form = (p.leaf, p.src_box, hull, box, name)
            out.append(j)
        return out

    def forwards(self, jobs: list[_Job]) -> None:
        """Give each forwarded piece its carrier and what it reads (module docstring)."""
        landings: dict[tuple, list[int]] = collections.defaultdict(list)
        encoded: dict[tuple, int] = {}
        for k, j in enumerate(jobs):
            p = j.piece
            if p.via is not None or j.link is not Link.NETWORK:
                continue
            if j.form is not None:
                encoded[(j.dst, *j.form)] = k
            else:
                landings[(j.dst, p.leaf, p.sender_casts)].append(k)
        for j in jobs:
            p = j.piece
            forward = p.via is not None or (
                p.link is Link.SAME_DEVICE
                and p.src_rank != p.dst_rank
                and self.topo.link(p.src_rank, p.dst_rank) is not Link.SAME_DEVICE
            )
            if not forward:
                continue
            at = p.via if p.via is not None else p.dst_rank
            if j.form is not None:
                got = encoded.get((at, *j.form))
                if got is not None:
                    src = jobs[got].writes[0]
                    j.read = _End(at, src.buf, src.offset, src.strides, src.itemsize, ())
                    j.stage, j.carrier, j.landed = 1, at, (got,)
                    continue
            else:
                hit = next(
                    (
                        k
                        for k in landings.get((at, p.leaf, p.sender_casts), ())
                        if jobs[k].piece.src_box.contains(p.src_box)
                    ),
                    None,
                )
                if hit is not None:
                    j.read = self._holder(jobs[hit], p, at)
                    j.stage, j.carrier, j.landed = 1, at, (hit,)
                    continue
            j.link = self.topo.link(p.src_rank, p.dst_rank)  # not forwardable: from the source rank

    def _holder(self, land: _Job, p: ViewPiece, at: int) -> _End:
        """Where ``at`` holds the wire bytes of ``p``'s source elements, which landing ``land`` brought."""
        lp, w = land.piece, land.writes[0]
        if w.chain:  # the landing casts them on arrival: keep its wire bytes in a relay region too
            relay = next((x for x in land.writes[1:]), None)
            if relay is None:
                st = _c_strides(land.extents, land.wire_item)
                at_off = self._take(self.aux_dst, at, math.prod(land.extents) * land.wire_item)
                relay = _End(at, buffer_index(self.aux, DST), at_off, st, land.wire_item, ())
                land.writes.append(relay)
            w = relay
        pos = {a: d for d, a in enumerate(lp.axes) if a >= 0}
        off = w.offset + sum((p.src_box.lo[a] - lp.src_box.lo[a]) * w.strides[d] for a, d in pos.items())
        strides = tuple(w.strides[pos[a]] if a >= 0 and a in pos else 0 for a in p.axes)
        return _End(at, w.buf, off, strides, w.itemsize, ())


PIPELINE_CHUNKS = 4  # a message whose sender casts, over a transport that posts ahead, is cut into this many
PIPELINE_MIN_CHUNK = 1 << 20  # chunks at least, where they stay this many bytes or more


def pipeline_chunk(message_bytes: int, chunk_bytes: int) -> int:
    """The chunk size of a message of ``message_bytes`` whose sender casts, over a transport that moves a
    posted round while the sender packs the next: ``chunk_bytes``, or less so that the message has
    :data:`PIPELINE_CHUNKS` chunks to overlap, but not below :data:`PIPELINE_MIN_CHUNK` (nor above
    ``chunk_bytes``). A message of one chunk cannot overlap its pack with the wire.

    >>> [pipeline_chunk(mib << 20, 8 << 20) >> 20 for mib in (2, 8, 64)]
    [1, 2, 8]
    """
    return min(chunk_bytes, max(PIPELINE_MIN_CHUNK, -(-message_bytes // PIPELINE_CHUNKS)))


def _casts_at_sender(jobs: list[_Job], j: _Job) -> bool:
    """Whether ``j``'s bytes were cast by the rank that packed them first: ``j``'s sender, or for a forward
    the sender of the landing it forwards (whose chunks the forward follows)."""
    return bool(j.read.chain) or any(jobs[k].read.chain for k in j.landed)


def _landed_by(fwd: _Job, land: _Job, lo: Sequence[int], hi: Sequence[int]) -> int:
    """The last round in which a chunk of ``land`` brought elements that the chunk ``[lo, hi)`` of the forward
    ``fwd`` reads (its elements relative to ``fwd``'s extents): the chunk goes in a round after it, so the
    fan-out of one chunk runs beside the network phase of the next. An encoded landing, or a piece whose
    axes do not map one to one, waits for the whole landing."""
    p, lp = fwd.piece, land.piece
    if fwd.form is not None or not land.chunks or not _maps(p) or not _maps(lp):
        return land.last_round
    src_lo, src_hi = list(p.src_box.lo), list(p.src_box.hi)
    for d, a in enumerate(p.axes):
        if a >= 0:
            src_lo[a], src_hi[a] = p.src_box.lo[a] + lo[d], p.src_box.lo[a] + hi[d]
    want = [
        (src_lo[a] - lp.src_box.lo[a], src_hi[a] - lp.src_box.lo[a]) if a >= 0 else (0, n)
        for a, n in zip(lp.axes, land.extents, strict=True)
    ]
    if land.chunk_boxes is None:  # every stage-0 chunk is placed before any forward asks
        k = len(land.chunks)
        land.chunk_boxes = (
            np.array([c[0] for c in land.chunks], np.int64),
            np.array([c[1] for c in land.chunks], np.int64).reshape(k, -1),
            np.array([c[2] for c in land.chunks], np.int64).reshape(k, -1),
        )
    rnds, los, his = land.chunk_boxes
    w = np.array(want, np.int64).reshape(-1, 2)
    meets = np.all((los < w[:, 1]) & (his > w[:, 0]), axis=1)
    return int(rnds[meets].max()) if meets.any() else land.last_round  # nothing met: wait for it all


def _maps(p: ViewPiece) -> bool:
    """Whether each destination axis of ``p`` runs along its own source axis with the same extent (or is new)."""
    used = [a for a in p.axes if a >= 0]
    return len(used) == len(set(used)) and all(
        (n == 1) if a < 0 else n == p.src_box.shape[a] for a, n in zip(p.axes, p.dst_box.shape, strict=True)
    )


def _global(rel: Box, outer: Box) -> Box:
    return Box(
        tuple(a + o for a, o in zip(rel.lo, outer.lo, strict=True)),
        tuple(b + o for b, o in zip(rel.hi, outer.lo, strict=True)),
    )


def _block_box(hull: Box, block: tuple[int, int]) -> Box:
    """The scales (one per block) of the blocks ``hull`` covers."""
    lo = (*hull.lo[:-2], hull.lo[-2] // block[0], hull.lo[-1] // block[1])
    hi = (*hull.hi[:-2], -(-hull.hi[-2] // block[0]), -(-hull.hi[-1] // block[1]))
    return Box(lo, hi)


def chunk_elements(
    items: Sequence[tuple[tuple[int, ...], int]], chunk_bytes: int
) -> list[list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
    """Cut element boxes of ``(extents, itemsize)``, laid end to end, into chunks of at most ``chunk_bytes``,
    splitting boxes along their outermost axes; a chunk ends early rather than split an element.

    Returns per chunk ``(item, lo, hi)`` boxes relative to their item.

    >>> for c in chunk_elements([((3, 2), 4), ((1,), 2)], 12):
    ...     print(c)
    [(0, (0, 0), (1, 2)), (0, (1, 0), (2, 1))]
    [(0, (1, 1), (2, 2)), (0, (2, 0), (3, 2))]
    [(1, (0,), (1,))]

    Raises:
      ValueError: ``chunk_bytes`` below an itemsize.
    """
    out: list[list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = []
    cur: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    space = chunk_bytes
    smallest = min((it for _, it in items), default=chunk_bytes)  # a chunk with less space left than this is full
    work = collections.deque((i, (0,) * len(ext), tuple(ext)) for i, (ext, _) in enumerate(items))
    while work:
        i, lo, hi = work.popleft()
        item = items[i][1]
        if item > chunk_bytes:
            raise ValueError(f"chunk_elements: chunk_bytes={chunk_bytes} is smaller than an item of {item} bytes")
        shape = [b - a for a, b in zip(lo, hi, strict=True)]
        n = math.prod(shape)
        if n == 0:
            continue
        if n * item <= space:
            cur.append((i, lo, hi))
            space -= n * item
        else:
            d = next(e for e, x in enumerate(shape) if x > 1)
            row = n // shape[d] * item
            k = space // row
            if k >= 1:
                cut = lo[d] + k
                cur.append((i, lo, (*hi[:d], cut, *hi[d + 1 :])))
                space -= k * row
                work.appendleft((i, (*lo[:d], cut, *lo[d + 1 :]), hi))
            elif row == item:  # not one more element fits: the chunk ends here
                out.append(cur)
                cur, space = [], chunk_bytes
                work.appendleft((i, lo, hi))
                continue
            else:  # one row is more than the space left: take it apart
                cut = lo[d] + 1
                work.appendleft((i, (*lo[:d], cut, *lo[d + 1 :]), hi))
                work.appendleft((i, lo, (*hi[:d], cut, *hi[d + 1 :])))
        if space < smallest:
            out.append(cur)
            cur, space = [], chunk_bytes
    if cur:
        out.append(cur)
    return out


def _rows(end: _End, extents: Sequence[int], lo: Sequence[int], stage: int, staged_item: int) -> np.ndarray:
    off = end.offset + _dot(lo, end.strides)
    (row,) = kernels.element_rows(
        [(end.buf, off, end.strides, end.itemsize)], extents, end.chain, stage=stage, staged_itemsize=staged_item
    )
    return row


def _table(rows: list[np.ndarray]) -> np.ndarray:
    if not rows:
        return np.zeros((0, kernels.COLUMNS), np.int64)
    out = np.concatenate(rows)
    out.setflags(write=False)
    return out


def view_schedule(
    lowerings: Sequence[LeafLowering],
    layouts: Sequence[Layout],
    dsts: Sequence[Layout],
    topology: Topology,
    options: Options,
    quantised: Sequence[tuple[str, tuple[int, int], str] | None] | None = None,
    *,
    pipelined: bool = False,
) -> ViewSchedule:
    """The rounds of every rank of a views lowering (module docstring).

    Args:
      lowerings: :func:`jreshard.views.lowering.lower_tree`'s output, one per destination leaf.
      layouts: the source leaves' layouts; dsts: the destination leaves' layouts.
      topology: the topology the lowering was made for.
      options: ``chunk_bytes`` and ``staging_bytes``.
      quantised: per destination leaf, ``None`` or ``(part, block, x dtype)`` of a block-FP8 output.
      pipelined: the transport moves a posted round while its sender packs the next, on a core of its own
        (:attr:`~jreshard.engine.comm.Communicator.pipelines_packs`): a message whose sender casts, and the
        forwards of what it brought, are cut into at least :data:`PIPELINE_CHUNKS` chunks where they stay
        :data:`PIPELINE_MIN_CHUNK` bytes or more, so the casts overlap the wire and the fan-out follows
        chunk by chunk. Both ends of a message must pass the same.

    Raises:
      ValueError: ``options.chunk_bytes`` below an item on the wire.
    """
    parts = list(quantised) if quantised is not None else [None] * len(dsts)
    b = _Builder(lowerings, layouts, dsts, topology, parts)
    jobs = b.jobs()
    b.forwards(jobs)
    align = STAGE_ALIGN if options.staging_bytes % STAGE_ALIGN == 0 else 1

    def padded(n: int) -> int:
        return -(-n // align) * align

    copy_pairs: dict[int, list[tuple[_Job, _End]]] = collections.defaultdict(list)
    messages: dict[tuple[int, int, int, int], list[int]] = collections.defaultdict(list)
    sent = dict.fromkeys(Link, 0)
    for k, j in enumerate(jobs):
        if j.stage == 0 and self_copy(j):
            copy_pairs[j.dst].append((j, j.writes[0]))
            sent[Link.SAME_DEVICE] += math.prod(j.extents) * j.writes[0].itemsize
        else:
            origin = jobs[j.landed[0]].carrier if j.landed else j.carrier
            messages[(j.stage, j.carrier, j.dst, origin)].append(k)
    use: dict[int, list[int]] = {}
    ops: dict[int, dict[int, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    nrounds = 0
    tags: dict[tuple[int, int, int], int] = collections.defaultdict(int)  # chunks so far between a pair
    for (stage, src, dst, _), ks in sorted(messages.items()):
        prev = -1
        link = jobs[ks[0]].link
        for j in (jobs[k] for k in ks):
            link = j.link if j.link is Link.NETWORK else link
        items = [(jobs[k].extents, jobs[k].wire_item) for k in ks]
        chunk_bytes = options.chunk_bytes
        if pipelined and any(_casts_at_sender(jobs, jobs[k]) for k in ks):
            chunk_bytes = pipeline_chunk(sum(math.prod(e) * i for e, i in items), chunk_bytes)
        chunks = chunk_elements(items, chunk_bytes)
        for c, chunk in enumerate(chunks):
            n = sum(math.prod(h - lo for lo, h in zip(a, z, strict=True)) * jobs[ks[i]].wire_item for i, a, z in chunk)
            lb = prev + 1
            for i, lo, hi in chunk:
                for k in jobs[ks[i]].landed:
                    lb = max(lb, _landed_by(jobs[ks[i]], jobs[k], lo, hi) + 1)
            send_ip = _in_place(jobs, ks, chunk, "read")
            recv_ip = _in_place(jobs, ks, chunk, "write")
            na, nb = (0 if send_ip else padded(n)), (0 if recv_ip else padded(n))
            rnd = first_fit(use, src, na, dst, nb, lb, options.staging_bytes)
            prev, nrounds = rnd, max(nrounds, rnd + 1)
            for i, lo, hi in chunk:
                jobs[ks[i]].last_round = max(jobs[ks[i]].last_round, rnd)
                jobs[ks[i]].chunks.append((rnd, lo, hi))
            tag = tag_of(stage, tags[(stage, src, dst)] + c)
            parts_ = [(jobs[ks[i]], a, z) for i, a, z in chunk]
            ops[src][rnd].append(("send", dst, tag, link, n, parts_, send_ip))
            ops[dst][rnd].append(("recv", src, tag, link, n, parts_, recv_ip))
            sent[link] += n
        tags[(stage, src, dst)] += len(chunks)
    steps: dict[int, dict[int, Step]] = {}
    staging: dict[int, int] = {}
    for r, by_round in ops.items():
        steps[r], peak = {}, 0
        for rnd, lst in sorted(by_round.items()):
            pos = 0
            rows: dict[str, list[np.ndarray]] = {"send": [], "recv": []}
            wires: dict[str, list[Wire]] = {"send": [], "recv": []}
            for kind, peer, tag, link, n, chunk, ip in lst:
                if ip is not None:
                    wires[kind].append(Wire(peer, tag, link, n, ip[0], ip[1]))
                    continue
                wires[kind].append(Wire(peer, tag, link, n, STAGING, pos))
                for j, lo, hi in chunk:
                    ext = tuple(h - a for a, h in zip(lo, hi, strict=True))
                    if kind == "send":
                        rows[kind].append(_rows(j.read, ext, lo, pos, j.wire_item))
                    else:
                        rows[kind] += [_rows(w, ext, lo, pos, j.wire_item) for w in j.writes]
                    pos += math.prod(ext) * j.wire_item
                peak = max(peak, pos)
                pos = padded(pos)
            steps[r][rnd] = Step(_table(rows["send"]), _table(rows["recv"]), tuple(wires["send"]), tuple(wires["recv"]))
        staging[r] = peak
    copies = {}
    for r, pairs in copy_pairs.items():
        keys: list[tuple[int, int]] = []
        srows, drows = [], []
        for j, w in pairs:
            key = (j.read.buf // 2, j.read.rank)
            if key not in keys:
                keys.append(key)
            chain = (*j.read.chain, *w.chain[1:]) if j.read.chain else w.chain
            s, d = kernels.element_rows(
                [
                    (keys.index(key), j.read.offset, j.read.strides, j.read.itemsize),
                    (w.buf, w.offset, w.strides, w.itemsize),
                ],
                j.extents,
                chain,
            )
            srows.append(s)
            drows.append(d)
        copies[r] = (tuple(keys), _table(srows), _table(drows))
    sched = Schedule(rounds=nrounds, steps=steps, copies=copies, staging=staging, ntensors=b.aux + 1)
    return ViewSchedule(
        schedule=sched,
        aux=b.aux,
        aux_src=dict(b.aux_src),
        aux_dst=dict(b.aux_dst),
        encode={r: tuple(v) for r, v in b.encode.items()},
        tiles={r: tuple(v) for r, v in b.tiles.items()},
        bytes_by_link=sent,
    )


def self_copy(j: _Job) -> bool:
    """Whether a stage-0 job is a copy on one device (its source shard is on the destination's device)."""
    return j.carrier == j.dst or j.link is Link.SAME_DEVICE


def _in_place(jobs: list[_Job], ks: list[int], chunk: list, side: str) -> tuple[int, int] | None:
    """``(buffer, offset)`` when the chunk is one run of bytes of one buffer on this side, moved unchanged."""
    if len(chunk) != 1:
        return None
    i, lo, hi = chunk[0]
    j = jobs[ks[i]]
    ends = [j.read] if side == "read" else j.writes
    if len(ends) != 1 or ends[0].chain:
        return None
    ext = tuple(h - a for a, h in zip(lo, hi, strict=True))
    row = _rows(ends[0], ext, lo, 0, j.wire_item)
    if int(row[0, kernels.NDIM]) != 1:
        return None
    return int(row[0, kernels.BUF]), int(row[0, kernels.OFF])
