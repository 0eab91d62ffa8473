"""Views across processes: the pieces whose two ends live in different processes travel as messages.

Every process lowers the same views with the same layouts and topology, so every
process knows every piece, and runs those that touch its ranks. A piece's bytes
are carried by its source rank, or, when the lowering gave it a ``via`` rank (a
rank of the destination's domain that received those source elements over the
network), by that rank, in a second stage over the fast links:

- both ends in this process: a copy, as in one process;
- else one message per (stage, carrier rank, destination rank) over the
  :class:`~jreshard.nccl.comm.Communicator`: the pieces' bytes end to end (in
  lowering order, each padded to 16 bytes), each in its *wire* dtype (the
  sender's casts applied) and in the source's axis order; the receiver permutes
  and applies its own casts while unpacking. A ``via`` rank forwards the wire
  bytes it received in the first stage (or packs them from a source shard its
  process holds).

So the network carries each piece once in the wire dtype: the lowering's
network bytes, which equal the lower bound. A quantised leaf's pieces land in its
tile of whole blocks at the destination, quantised after, as in one process.
Pure numpy over the communicator: no jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.errors import TransferError
from jreshard.nccl.comm import Communicator, RecvOp, SendOp
from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.sharding.topology import Link
from jreshard.views.casts import cast_into
from jreshard.views.lowering import LeafLowering, Piece

__all__ = ["RemoteStats", "run_pieces"]

PAD = 16  # bytes: where each piece starts in a message


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteStats:
    """What this process sent: bytes per link kind (counted at the sender) and messages."""

    bytes_by_link: Mapping[Link, int]
    messages: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Job:
    """One piece this process takes part in: ``out(...)`` is the array it lands in (a destination
    shard, or a quantisation tile), ``carrier`` the rank whose process sends its bytes."""

    piece: Piece
    out: tuple[int, int, int]  # (leaf, rank, tile index or -1)
    carrier: int
    stage: int


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
    used = [a for a in p.axes if a >= 0]
    rest = [a for a in range(wire.ndim) if a not in used]
    v = wire.transpose(used + rest).reshape(p.dst_box.shape)
    cast_into(out[_at(p.dst_box)], v, p.receiver_casts)


def run_pieces(
    lowerings: Sequence[LeafLowering],
    comm: Communicator,
    process_of: Mapping[int, int],
    src: Mapping[tuple[int, int], np.ndarray],
    src_box: Mapping[tuple[int, int], Box],
    out: Callable[[int, int, int], np.ndarray],
    *,
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
        writes (``tile`` >= 0: the tile of that quantisation task of the leaf).
      timeout_s: the longest wait on a peer.

    Raises:
      TransferError: a piece's bytes are nowhere in this process although the lowering says so.
      TransferTimeoutError: a peer did not answer in time.
    """
    mine = set(comm.local_ranks)
    jobs: list[_Job] = []
    for t, low in enumerate(lowerings):
        for p in low.pieces:
            jobs.append(_job(p, (t, p.dst_rank, -1)))
        for k, task in enumerate(low.tasks):
            jobs += [_job(p, (t, task.dst_rank, k)) for p in task.pieces]
    jobs = [j for j in jobs if j.carrier in mine or j.piece.dst_rank in mine]
    sent = {Link.NETWORK: 0, Link.FAST: 0, Link.LOCAL: 0}
    messages = 0
    received: dict[tuple[int, tuple[str, ...]], list[tuple[Box, np.ndarray]]] = {}  # (leaf, casts) -> wire boxes
    for stage in (0, 1):
        here = [j for j in jobs if j.stage == stage]
        local = [j for j in here if process_of[j.carrier] == process_of[j.piece.dst_rank]]
        remote = [j for j in here if process_of[j.carrier] != process_of[j.piece.dst_rank]]
        for j in local:
            p = j.piece
            if p.dst_rank not in mine:
                continue
            if stage == 0:
                chain = p.sender_casts + p.receiver_casts
                cast_into(out(*j.out)[_at(p.dst_box)], _moved(p, src, src_box), chain)
            else:
                _unpack(p, _wire_bytes(p, received, src, src_box), out(*j.out))
        sends, recvs, unpacks = [], [], []
        for (carrier, dst), group in _by_pair(remote).items():
            size = sum(_pad(j.piece.wire_bytes) for j in group)
            buf = np.empty(size, np.uint8)
            if carrier in mine:
                pos = 0
                for j in group:
                    p = j.piece
                    w = buf[pos : pos + p.wire_bytes].view(_wire(p)).reshape(p.src_box.shape)
                    if stage == 0:
                        cast_into(w, _source_view(p, src, src_box), p.sender_casts)
                    else:
                        np.copyto(w, _wire_bytes(p, received, src, src_box))
                    pos += _pad(p.wire_bytes)
                    sent[p.link] += p.wire_bytes
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
                p = j.piece
                w = buf[pos : pos + p.wire_bytes].view(_wire(p)).reshape(p.src_box.shape)
                _unpack(p, w, out(*j.out))
                if stage == 0:
                    received.setdefault((p.leaf, p.sender_casts), []).append((p.src_box, w))
                pos += _pad(p.wire_bytes)
    for j in jobs:  # the copies inside this process (sent at the sender: the destination counts them)
        if process_of[j.carrier] == process_of[j.piece.dst_rank] and j.piece.dst_rank in mine:
            sent[j.piece.link] += j.piece.wire_bytes
    return RemoteStats(bytes_by_link=sent, messages=messages)


def _job(p: Piece, where: tuple[int, int, int]) -> _Job:
    if p.via is None:
        return _Job(p, where, p.src_rank, 0)
    return _Job(p, where, p.via, 1)


def _by_pair(jobs: list[_Job]) -> dict[tuple[int, int], list[_Job]]:
    out: dict[tuple[int, int], list[_Job]] = {}
    for j in jobs:  # lowering order within a pair: both ends agree
        out.setdefault((j.carrier, j.piece.dst_rank), []).append(j)
    return out


def _moved(p: Piece, src: Mapping, src_box: Mapping) -> np.ndarray:
    """The source elements of ``p`` permuted into its destination's axis order."""
    region = _source_view(p, src, src_box)
    used = [a for a in p.axes if a >= 0]
    rest = [a for a in range(region.ndim) if a not in used]
    return region.transpose(used + rest).reshape(p.dst_box.shape)


def _wire_bytes(p: Piece, received: Mapping, src: Mapping, src_box: Mapping) -> np.ndarray:
    """The wire bytes of ``p``'s source elements in this process: from what arrived in the first
    stage, else packed from a source shard held here."""
    for box, w in received.get((p.leaf, p.sender_casts), ()):
        if box.contains(p.src_box):
            return w[_at(p.src_box.relative_to(box))]
    for (leaf, rank), box in src_box.items():
        if leaf == p.leaf and box.contains(p.src_box):
            holder = dataclasses.replace(p, src_rank=rank)
            wire = np.empty(p.src_box.shape, _wire(p))
            cast_into(wire, _source_view(holder, src, src_box), p.sender_casts)
            return wire
    raise TransferError(
        f"views: the bytes of source leaf {p.leaf} box {p.src_box} that rank {p.via} forwards are not in this process"
    )
