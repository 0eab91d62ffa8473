"""Views across processes: the pieces whose two ends live in different processes travel as messages.

Every process lowers the same views with the same layouts and topology, so every
process knows every piece, and runs those that touch its ranks. A piece's bytes
are carried by its source rank, or, when the lowering gave it a ``via`` rank (a
rank of the destination's domain that received those source elements over the
network), by that rank, in a second stage over the fast links:

- both ends in this process: a copy, as in one process;
- else one message per (stage, carrier rank, destination rank) over the
  :class:`~jreshard.engine.comm.Communicator`: the pieces' bytes end to end (in
  lowering order, each padded to 16 bytes), each in its *wire* dtype (the
  sender's casts applied) and in the source's axis order; the receiver permutes
  and applies its own casts while unpacking. A ``via`` rank forwards the wire
  bytes it received in the first stage; a piece whose source elements already
  reached its own rank (an element used twice) is copied from there.

So the network carries each piece once in the wire dtype: the lowering's
network bytes, which equal the lower bound. A block-FP8 output whose blocks each
lie in one piece is quantised by the carrier (float8 weights or float32 scales on
the wire); otherwise a quantised leaf's pieces land in its tile of whole blocks
at the destination, quantised after, as in one process. A piece the lowering
meant to forward that cannot be (not planned; kept as a safety net) comes from
its source rank and is counted on the link it takes. Pure numpy over the
communicator: no jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.engine.comm import Communicator, RecvOp, SendOp
from jreshard.errors import TransferError
from jreshard.sharding.box import Box, intersect
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.sharding.topology import Link
from jreshard.views.casts import cast_into
from jreshard.views.lowering import LeafLowering, Piece
from jreshard.views.quant import _Quant

__all__ = ["RemoteStats", "run_pieces"]

PAD = 16  # bytes: where each piece starts in a message


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteStats:
    """What this process sent: bytes per link kind (counted at the sender) and messages."""

    bytes_by_link: Mapping[Link, int]
    messages: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Encoded:
    """A piece of a block-FP8 output whose blocks lie in one source piece: the carrier quantises
    ``hull`` (the piece's blocks of ``x``) and sends the output over ``box`` (the destination leaf's
    coordinates), 1 byte a weight or 4 a scale."""

    quant: _Quant
    hull: Box
    box: Box
    shard: Box  # the destination shard's box, where ``box`` lands

    @property
    def nbytes(self) -> int:
        return self.box.volume * numpy_dtype(self.quant.dtype).itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class _Job:
    """One piece this process takes part in: it lands in destination leaf ``leaf``'s shard on
    ``piece.dst_rank`` (``tile`` >= 0: that quantisation task's tile), carried by rank ``carrier`` in
    ``stage``; ``encoded``: quantised at the carrier."""

    piece: Piece
    leaf: int
    tile: int
    carrier: int
    stage: int
    encoded: _Encoded | None = None
    link: Link = Link.LOCAL  # how the bytes travel (the piece's link, unless it could not be forwarded)

    @property
    def nbytes(self) -> int:
        return self.encoded.nbytes if self.encoded is not None else self.piece.wire_bytes


def _pad(n: int) -> int:
    return -(-n // PAD) * PAD


def _wire(p: Piece) -> np.dtype:
    return numpy_dtype(p.wire_dtype)


def _source_view(p: Piece, src: Mapping[tuple[int, int], np.ndarray], src_box: Mapping[tuple[int, int], Box]):
    key = (p.leaf, p.src_rank)
    if key not in src:
        raise TransferError(f"views: rank {p.src_rank}'s shard of source leaf {p.leaf} is not in this process")
    where: Any = (*p.src_box.relative_to(src_box[key]).slices(), ...)  # "...": 0-d views stay arrays
    return src[key][where]


def _at(box: Box) -> Any:
    """Index ``box`` out of an array (``...`` keeps a 0-d result an array)."""
    return (*box.slices(), ...)


def _unpack(p: Piece, wire: np.ndarray, out: np.ndarray) -> None:
    """Write the wire bytes of ``p`` (source axis order, wire dtype) into ``out`` with the receiver's casts."""
    v = wire.transpose(p.source_order).reshape(p.dst_box.shape)
    cast_into(out[_at(p.dst_box)], v, p.receiver_casts)


def run_pieces(
    lowerings: Sequence[LeafLowering],
    comm: Communicator,
    process_of: Mapping[int, int],
    src: Mapping[tuple[int, int], np.ndarray],
    src_box: Mapping[tuple[int, int], Box],
    out: Callable[[int, int, int], np.ndarray],
    *,
    quants: Mapping[int, _Quant] | None = None,
    timeout_s: float,
) -> RemoteStats:
    """Run every piece that touches this process's ranks (``comm.local_ranks``).

    Args:
      lowerings: the lowering of every destination leaf (the same on every process).
      comm: the transport between ranks.
      process_of: the process of every rank (pieces between ranks of one process are copies).
      src: ``{(leaf, rank): typed source shard}`` of this process's source ranks.
      src_box: the box each of them holds.
      out: ``out(leaf, rank, tile)`` is the array destination rank ``rank`` of leaf ``leaf``
        writes (``tile`` >= 0: the tile of that quantisation task of the leaf; quantised by
        the caller after this returns).
      quants: the block-FP8 output of each quantised destination leaf: a task whose blocks each
        lie in one source piece is quantised by the carriers, its tile left untouched.
      timeout_s: the longest wait on a peer.

    Raises:
      TransferError: a piece's bytes are nowhere in this process although the lowering says so.
      TransferTimeoutError: a peer did not answer in time.
    """
    mine = set(comm.local_ranks)
    jobs = [j for j in _jobs(lowerings, quants or {}, process_of) if j.carrier in mine or j.piece.dst_rank in mine]
    sent = {Link.NETWORK: 0, Link.FAST: 0, Link.LOCAL: 0}
    messages = 0
    received: dict[tuple, list[tuple[Box, np.ndarray]]] = {}  # what arrived in stage 0, for forwarding
    for stage in (0, 1):
        here = [j for j in jobs if j.stage == stage]
        for j in here:  # both ends in this process: a copy
            if j.piece.dst_rank in mine and process_of[j.carrier] == process_of[j.piece.dst_rank]:
                _consume(j, _produce(j, src, src_box, received), out, received)
                sent[j.link] += j.nbytes  # counted once, at the destination
        sends, recvs, unpacks = [], [], []
        remote = [j for j in here if process_of[j.carrier] != process_of[j.piece.dst_rank]]
        for (carrier, dst), group in _by_pair(remote).items():
            buf = np.empty(sum(_pad(j.nbytes) for j in group), np.uint8)
            if carrier in mine:
                pos = 0
                for j in group:
                    data = _produce(j, src, src_box, received)
                    buf[pos : pos + j.nbytes] = data.reshape(-1).view(np.uint8)
                    pos += _pad(j.nbytes)
                    sent[j.link] += j.nbytes
                sends.append(SendOp(carrier, dst, stage, buf))
                messages += 1
            if dst in mine:
                recvs.append(RecvOp(carrier, dst, stage, buf))
                unpacks.append((group, buf))
        if sends or recvs:
            comm.exchange(sends, recvs, timeout_s=timeout_s)
        for group, buf in unpacks:
            pos = 0
            for j in group:
                shape, dtype = _payload(j)
                _consume(j, buf[pos : pos + j.nbytes].view(dtype).reshape(shape), out, received)
                pos += _pad(j.nbytes)
    return RemoteStats(bytes_by_link=sent, messages=messages)


def _jobs(lowerings: Sequence[LeafLowering], quants: Mapping[int, _Quant], process_of: Mapping[int, int]) -> list[_Job]:
    """Every piece as a job, in lowering order (every process lists the same jobs).

    A ``via`` piece is forwarded in stage 1 by its via rank, and a piece whose bytes already
    reached its own rank (a source element used twice: a local piece read from another rank) is
    copied there in stage 1, when that rank receives a stage-0 piece that holds its bytes in the
    same form; otherwise it comes from its source rank in stage 0, over the network when that
    rank is in another process, and is counted so.
    """
    jobs: list[_Job] = []
    for t, low in enumerate(lowerings):
        jobs += [_Job(p, t, -1, p.src_rank, 0, None, p.link) for p in low.pieces]
        for k, task in enumerate(low.tasks):
            quant = quants.get(t)
            for p in task.pieces:
                enc = None
                if task.at_sender and quant is not None:
                    hull = _global(p.dst_box, task.hull)
                    box = intersect(hull, task.box) if quant.part == "weights" else _block_box(hull, quant.block)
                    if box is None or box.volume == 0:
                        continue  # a piece of a block this shard needs only to complete: nothing to send
                    enc = _Encoded(quant, hull, box, task.box)
                jobs.append(_Job(p, t, -1 if enc else k, p.src_rank, 0, enc, p.link))
    first = {_form(j) for j in jobs if j.piece.via is None and j.encoded is not None}
    plain: dict[tuple, list[Box]] = {}  # (rank, leaf, sender casts) -> source boxes it receives plain in stage 0
    for j in jobs:
        if j.piece.via is None and j.encoded is None:
            plain.setdefault((j.piece.dst_rank, j.piece.leaf, j.piece.sender_casts), []).append(j.piece.src_box)
    out = []
    for j in jobs:
        p = j.piece
        at = p.via if p.via is not None else p.dst_rank if p.src_rank != p.dst_rank and p.link is Link.LOCAL else None
        if at is not None:
            if j.encoded is not None:
                ok = _form(j, at) in first
            else:
                ok = any(b.contains(p.src_box) for b in plain.get((at, p.leaf, p.sender_casts), ()))
            if ok:
                j = dataclasses.replace(j, carrier=at, stage=1)
            elif process_of[p.src_rank] != process_of[p.dst_rank]:
                j = dataclasses.replace(j, link=Link.NETWORK)
        out.append(j)
    return out


def _form(j: _Job, at: int | None = None) -> tuple:
    """What an encoded job's payload is, received at rank ``at`` (default its destination)."""
    p, e = j.piece, j.encoded
    assert e is not None
    return (p.dst_rank if at is None else at, p.leaf, p.src_box, e.hull, e.box, e.quant.part)


def _payload(j: _Job) -> tuple[tuple[int, ...], np.dtype]:
    if j.encoded is not None:
        return j.encoded.box.shape, numpy_dtype(j.encoded.quant.dtype)
    return j.piece.src_box.shape, _wire(j.piece)


def _produce(j: _Job, src: Mapping, src_box: Mapping, received: Mapping) -> np.ndarray:
    """The bytes the carrier sends for ``j``: wire bytes in source order, or the quantised output."""
    p, e = j.piece, j.encoded
    if e is None:
        if j.stage == 0:
            wire = np.empty(p.src_box.shape, _wire(p))
            cast_into(wire, _source_view(p, src, src_box), p.sender_casts)
            return wire
        return _wire_bytes(p, j.carrier, received)
    if j.stage == 1:
        return received[_form(j, j.carrier)][0][1]
    tile = np.empty(p.dst_box.shape, numpy_dtype(e.quant.x.dtype))
    cast_into(tile, _moved(p, src, src_box), p.sender_casts + p.receiver_casts)
    return e.quant.compute(tile, e.hull, e.box)


def _consume(j: _Job, data: np.ndarray, out: Callable, received: dict) -> None:
    p, e = j.piece, j.encoded
    if e is not None:
        out(j.leaf, p.dst_rank, -1)[_at(e.box.relative_to(e.shard))] = data
        if j.stage == 0:
            received[_form(j)] = [(e.box, data)]
        return
    _unpack(p, data, out(j.leaf, p.dst_rank, j.tile))
    if j.stage == 0:
        received.setdefault((p.dst_rank, p.leaf, p.sender_casts), []).append((p.src_box, data))


def _global(local: Box, outer: Box) -> Box:
    return Box(
        tuple(a + o for a, o in zip(local.lo, outer.lo, strict=True)),
        tuple(b + o for b, o in zip(local.hi, outer.lo, strict=True)),
    )


def _block_box(hull: Box, block: tuple[int, int]) -> Box:
    """The scales (one per block) of the blocks ``hull`` covers."""
    lo = (*hull.lo[:-2], hull.lo[-2] // block[0], hull.lo[-1] // block[1])
    hi = (*hull.hi[:-2], -(-hull.hi[-2] // block[0]), -(-hull.hi[-1] // block[1]))
    return Box(lo, hi)


def _by_pair(jobs: list[_Job]) -> dict[tuple[int, int], list[_Job]]:
    out: dict[tuple[int, int], list[_Job]] = {}
    for j in jobs:  # lowering order within a pair: both ends agree
        out.setdefault((j.carrier, j.piece.dst_rank), []).append(j)
    return out


def _moved(p: Piece, src: Mapping, src_box: Mapping) -> np.ndarray:
    """The source elements of ``p`` permuted into its destination's axis order."""
    region = _source_view(p, src, src_box)
    return region.transpose(p.source_order).reshape(p.dst_box.shape)


def _wire_bytes(p: Piece, rank: int, received: Mapping) -> np.ndarray:
    """The wire bytes of ``p``'s source elements that ``rank`` received in stage 0."""
    for box, w in received.get((rank, p.leaf, p.sender_casts), ()):
        if box.contains(p.src_box):
            return w[_at(p.src_box.relative_to(box))]
    raise TransferError(
        f"views: the bytes of source leaf {p.leaf} box {p.src_box} that rank {rank} forwards did not arrive"
    )
