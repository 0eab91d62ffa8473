"""The schedule: which chunk of which message runs in which exchange round, for the ranks a process drives.

This module holds the schedule's vocabulary, which its two builders share and the engine
(:mod:`jreshard.engine.rounds`) interprets: :class:`Schedule` (per rank and round, a :class:`Step` of
sends and receives, each a :class:`Wire`, and the descriptor tables that pack and unpack them), the
chunking of a message, tags, and the first-fit staging rule. The builders are
:func:`jreshard.schedule.pairsched.pair_schedule` (arrays: pair by pair, each process its own ranks,
agreed with its peers in a few small messages) and :func:`jreshard.schedule.viewsched.view_schedule`
(views, with their casts and quantised blocks).

**Chunks.** The pieces of a message, laid end to end in plan order, are cut
into chunks of exactly ``options.chunk_bytes`` bytes (the last one shorter). A
chunk is a list of boxes of bytes (``kernels.byte_box``): a piece that straddles a
chunk boundary is split into boxes along its outermost dimensions, so both ends
derive the same chunks from the message alone.

**Rounds.** One round is one :meth:`Communicator.exchange` group, and both ends of a
chunk post it in the same round, so every group's sends and receives match and no
process can wait on a later group.

**Staging layout.** A chunk that is one contiguous run of its shard is sent or
received in place; the others are packed into, or unpacked from, the rank's
staging arena, one descriptor table per round. Each staged chunk starts at a
multiple of :data:`STAGE_ALIGN` bytes of the arena (when ``staging_bytes`` is a
multiple of it, which keeps every padded chunk within the bound), so GPU kernels
move 16-byte units; the pieces inside a chunk are back to back, because the chunk
is one message on the wire.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from jreshard.errors import TransferError
from jreshard.schedule import kernels
from jreshard.sharding.box import Box
from jreshard.sharding.rankplan import RankPlan
from jreshard.sharding.rows import TensorSpec
from jreshard.sharding.topology import Link

__all__ = [
    "DST",
    "SRC",
    "STAGE_ALIGN",
    "STAGING",
    "TAG_CHUNK_BITS",
    "Schedule",
    "Step",
    "Wire",
    "buffer_index",
    "chunk_pieces",
    "first_fit",
    "tag_of",
]

SRC, DST = 0, 1  # buffer sides; a rank's buffer list is [src(t0), dst(t0), src(t1), dst(t1), ...]
STAGING = -1  # Wire.buf of a chunk that lives in the staging arena
STAGE_ALIGN = 16  # bytes: where each staged chunk starts in the arena
TAG_CHUNK_BITS = 16


def buffer_index(tensor: int, side: int) -> int:
    """Where the ``side`` (SRC or DST) shard of ``tensor`` sits in a rank's buffer list."""
    return 2 * tensor + side


def tag_of(stage: int, chunk: int) -> int:
    """A message chunk's tag: unique among one group's messages between one ordered pair."""
    return (stage << TAG_CHUNK_BITS) | (chunk & ((1 << TAG_CHUNK_BITS) - 1))


@dataclasses.dataclass(frozen=True, slots=True)
class Wire:
    """One chunk on the wire: ``nbytes`` at ``offset`` of buffer ``buf`` (``STAGING``: the arena)."""

    peer: int
    tag: int
    link: Link
    nbytes: int
    buf: int
    offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """What one rank does in one round: pack, exchange, unpack."""

    pack: np.ndarray  # descriptor table; STAGE = offset in the rank's staging arena
    unpack: np.ndarray
    sends: tuple[Wire, ...]
    recvs: tuple[Wire, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class Schedule:
    """Every rank's rounds (see the module docstring), built once per plan and chunking.

    Attributes:
      rounds: number of exchange rounds.
      steps: ``steps[rank][round]`` for the rounds in which ``rank`` takes part.
      copies: ``copies[rank] = (src_keys, src_table, dst_table)``: same-device copies from source
        shards ``src_keys[i] = (tensor, rank)`` into ``rank``'s destination shards.
      staging: ``staging[rank]``: the most staging bytes ``rank`` ever holds at once.
      ntensors: tensors in the plan.
      groups: how rounds are cut into exchange groups, ``{round: {(src, dst, tag): group}}``
        (rounds absent run as one group), when the schedule carries its own cut (a per-process
        one, :mod:`jreshard.schedule.pairsched`); None: the engine cuts it with
        :func:`jreshard.schedule.groups.group_rounds`, which needs every rank's steps.
    """

    rounds: int
    steps: Mapping[int, Mapping[int, Step]]
    copies: Mapping[int, tuple[tuple[tuple[int, int], ...], np.ndarray, np.ndarray]]
    staging: Mapping[int, int]
    ntensors: int
    groups: Mapping[int, Mapping[tuple[int, int, int], int]] | None = None


def chunk_pieces(pieces: Iterable[tuple[int, Box]], chunk_bytes: int) -> list[list[tuple[int, Box]]]:
    """Cut ``(tensor, byte_box)`` pieces, laid end to end, into chunks of exactly ``chunk_bytes``
    (the last one shorter), splitting boxes along their outermost dimensions.

    >>> for chunk in chunk_pieces([(0, Box((0, 0), (3, 4)))], 5):
    ...     print([(b.lo, b.hi) for _, b in chunk])
    [((0, 0), (1, 4)), ((1, 0), (2, 1))]
    [((1, 1), (2, 4)), ((2, 0), (3, 2))]
    [((2, 2), (3, 4))]
    """
    out: list[list[tuple[int, Box]]] = []
    cur: list[tuple[int, Box]] = []
    space = chunk_bytes
    work = collections.deque(pieces)
    while work:
        t, b = work.popleft()
        n = b.volume
        if n == 0:
            continue
        if n <= space:
            cur.append((t, b))
            space -= n
        else:
            d = next(e for e, x in enumerate(b.shape) if x > 1)
            row = n // b.shape[d]
            k = space // row
            if k >= 1:
                head, rest = b.split(d, b.lo[d] + k)
                cur.append((t, head))
                space -= k * row
                work.appendleft((t, rest))
            else:  # one row is more than the space left: take it apart
                first, rest = b.split(d, b.lo[d] + 1)
                work.appendleft((t, rest))
                work.appendleft((t, first))
        if space == 0:
            out.append(cur)
            cur, space = [], chunk_bytes
    if cur:
        out.append(cur)
    return out


class _Shapes:
    """Byte shapes and byte boxes of every (tensor, rank, side) shard of a plan's tensors."""

    def __init__(self, tensors: Sequence[TensorSpec]):
        self.items = [t.src.itemsize for t in tensors]
        self.src = [t.src._index() for t in tensors]
        self.dst = [t.dst._index() for t in tensors]

    def box(self, t: int, rank: int, side: int) -> Box:
        idx = self.src[t] if side == SRC else self.dst[t]
        if rank not in idx:
            which = "source" if side == SRC else "destination"
            raise TransferError(f"rank {rank} holds no {which} shard of tensor {t}")
        return kernels.byte_box(idx[rank], self.items[t])

    def relative(self, t: int, rank: int, side: int, bb: Box) -> tuple[tuple[int, ...], Box]:
        """(shard byte shape, byte box relative to the shard) of byte box ``bb``."""
        outer = self.box(t, rank, side)
        if not outer.contains(bb):
            raise TransferError(f"the plan moves bytes {bb} of tensor {t} through rank {rank}, whose shard is {outer}")
        return outer.shape, bb.relative_to(outer)


def first_fit(use: dict[int, list[int]], a: int, na: int, b: int, nb: int, lb: int, cap: int) -> int:
    """The first round from ``lb`` where rank ``a`` has ``na`` and rank ``b`` has ``nb`` staging bytes left
    of ``cap`` (``use[rank][round]``: what each already holds); it takes them there."""
    ua, ub = use.setdefault(a, []), use.setdefault(b, [])
    r = lb
    while True:
        for u in (ua, ub):
            if len(u) <= r:
                u.extend([0] * (r + 1 - len(u)))
        if ua[r] + na <= cap and ub[r] + nb <= cap:
            ua[r] += na
            ub[r] += nb
            return r
        r += 1


def _copy_tables(rank_plan: RankPlan, shapes: _Shapes) -> tuple:
    keys: list[tuple[int, int]] = []
    pairs = []
    for tr in rank_plan.copies:
        bb = kernels.byte_box(tr.box, shapes.items[tr.tensor])
        so, sbox = shapes.relative(tr.tensor, tr.src, SRC, bb)
        do, dbox = shapes.relative(tr.tensor, tr.dst, DST, bb)
        keys.append((tr.tensor, tr.src))
        pairs.append((len(keys) - 1, so, sbox, buffer_index(tr.tensor, DST), do, dbox))
    src, dst = kernels.build_copy_tables(pairs)
    return tuple(keys), src, dst
