"""One rank's plan: its same-device copies, and the messages it sends and receives, stage by stage.

A :class:`RankPlan` holds the rows that involve one rank as columns of numpy
arrays (a :class:`RankTable`), sorted so that every message is a contiguous run
of rows. The per-piece Python values (:class:`Message`, :class:`Piece`,
:class:`~jreshard.sharding.rows.Move`) are built from the columns the first time
``sends``, ``recvs`` or ``copies`` is read: a rank plan of tens of thousands of pieces
is built with a few numpy calls, and a consumer that reads the columns never pays
for the objects.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from jreshard.sharding.box import Box
from jreshard.sharding.rows import Move, Phase, TensorTemplate
from jreshard.sharding.topology import Link

__all__ = [
    "COPY",
    "RECV",
    "SEND",
    "Message",
    "Piece",
    "RankTable",
    "RankPlan",
    "build_rank_plan",
    "stamped_rank_plan",
]

COPY, SEND, RECV = 0, 1, 2  # RankTable.kind: a same-device landing, a piece sent, a piece received


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """One part of a message: a box of a tensor, in global coordinates."""

    tensor: int
    box: Box
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """All pieces ``src`` sends ``dst`` at ``stage``, in a fixed order."""

    stage: int
    src: int
    dst: int
    link: Link
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class RankTable:
    """One rank's rows as columns (read-only numpy arrays), in the rank plan's order.

    Rows are sorted by ``kind`` (:data:`COPY`, :data:`SEND`, :data:`RECV`); the copy
    rows by ``(tensor, emission order)``, the sent and received ones by ``(stage,
    peer, tensor, emission order)``, so each message is one run of rows. A row that
    a rank sends to itself appears twice, once as sent and once as received.

    Attributes:
      kind: int8, what the row is to this rank.
      stage, peer, link, phase, tensor, nbytes: the row's stage, the other end (the
        receiver of a sent row, the sender of a received or copied one), its link and
        phase, its tensor and its bytes.
      lo, hi: ``(n, D)`` box bounds, ``D`` the most dimensions of any tensor; a row of
        tensor ``t`` uses the first ``ndim[i]`` columns (the rest are zero).
      ndim: int8, the dimensions of each row's tensor.
      cuts: ``(messages + 1,)`` row offsets: sent and received message ``i`` is rows
        ``cuts[i]:cuts[i + 1]``; ``cuts[0]`` is the number of copy rows.
    """

    kind: np.ndarray
    stage: np.ndarray
    peer: np.ndarray
    link: np.ndarray
    phase: np.ndarray
    tensor: np.ndarray
    nbytes: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    ndim: np.ndarray
    cuts: np.ndarray

    def __len__(self) -> int:
        return int(self.kind.shape[0])

    def boxes(self, start: int, stop: int) -> list[Box]:
        """The boxes of rows ``start:stop`` as :class:`Box` values (equal boxes are one object)."""
        if stop <= start:
            return []
        width = self.lo.shape[1]
        key = np.concatenate(
            [self.ndim[start:stop, None].astype(np.int64), self.lo[start:stop], self.hi[start:stop]], 1
        )
        # Many rows share a box (the same template rows stamped for many tensors): build each distinct one once.
        perm = np.lexsort(key.T[::-1])
        ordered = key[perm]
        first = np.ones(len(key), dtype=bool)
        first[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
        inverse = np.empty(len(key), dtype=np.int64)
        inverse[perm] = np.cumsum(first) - 1
        uniq = ordered[first]
        trusted = Box.trusted
        made = [
            trusted(tuple(row[1 : 1 + row[0]]), tuple(row[1 + width : 1 + width + row[0]])) for row in uniq.tolist()
        ]
        return list(map(made.__getitem__, inverse.tolist()))


class RankPlan:
    """What one rank does: same-device copies into its destination shards, then, stage
    by stage, the messages it sends and receives.

    ``copies`` are landings from a source shard on the rank's device (the sender's
    buffer is in this process). A fan-out between two destination ranks that share
    a device is labelled ``Link.SAME_DEVICE`` but travels as a message, at its stage.
    ``sends`` and ``recvs`` are sorted by ``(stage, peer)``; the pieces of a message
    are in (tensor, emission) order.

    The rank plan is held as columns (``table``, a :class:`RankTable`); ``copies``,
    ``sends`` and ``recvs`` are built from them when first read. Two rank plans are
    equal when their ranks, copies, sends and receives are.
    """

    __slots__ = ("__dict__", "rank", "table")

    def __init__(self, rank: int, table: RankTable):
        self.rank = rank
        self.table = table

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankPlan):
            return NotImplemented
        return (self.rank, self.copies, self.sends, self.recvs) == (other.rank, other.copies, other.sends, other.recvs)

    def __hash__(self) -> int:
        return hash((self.rank, self.copies, self.sends, self.recvs))

    def __repr__(self) -> str:
        nsend = int(np.sum(self.table.kind == SEND))
        return (
            f"RankPlan(rank={self.rank}, {int(self.table.cuts[0])} copies, "
            f"{len(self.table.cuts) - 1} messages, {nsend} pieces sent, "
            f"{len(self.table) - int(self.table.cuts[0]) - nsend} received)"
        )

    @functools.cached_property
    def copies(self) -> tuple[Move, ...]:
        t = self.table
        n = int(t.cuts[0])
        boxes = t.boxes(0, n)
        cols = (t.tensor[:n].tolist(), t.peer[:n].tolist(), t.stage[:n].tolist(), t.nbytes[:n].tolist())
        return tuple(
            Move(ten, src, self.rank, box, Link.SAME_DEVICE, Phase.LAND, stage, nb)
            for ten, src, box, stage, nb in zip(cols[0], cols[1], boxes, cols[2], cols[3], strict=True)
        )

    @functools.cached_property
    def _messages(self) -> tuple[tuple[Message, ...], tuple[Message, ...]]:
        t = self.table
        cuts = t.cuts.tolist()
        if len(cuts) < 2:
            return (), ()
        start = cuts[0]
        boxes = t.boxes(start, len(t))
        pieces = list(map(Piece, t.tensor[start:].tolist(), boxes, t.nbytes[start:].tolist()))
        firsts = np.asarray(cuts[:-1], dtype=np.int64)
        heads = zip(
            t.kind[firsts].tolist(),
            t.stage[firsts].tolist(),
            t.peer[firsts].tolist(),
            t.link[firsts].tolist(),
            strict=True,
        )
        sends: list[Message] = []
        recvs: list[Message] = []
        me = self.rank
        for (kind, stage, peer, link), a, b in zip(heads, cuts[:-1], cuts[1:], strict=True):
            got = tuple(pieces[a - start : b - start])
            if kind == SEND:
                sends.append(Message(stage, me, peer, _LINKS[link], got))
            else:
                recvs.append(Message(stage, peer, me, _LINKS[link], got))
        return tuple(sends), tuple(recvs)

    @property
    def sends(self) -> tuple[Message, ...]:
        return self._messages[0]

    @property
    def recvs(self) -> tuple[Message, ...]:
        return self._messages[1]

    @property
    def stages(self) -> tuple[int, ...]:
        t = self.table
        return tuple(np.unique(t.stage[int(t.cuts[0]) :]).tolist())


_LINKS = tuple(Link)


def _sort_order(*keys: np.ndarray) -> np.ndarray:
    """The permutation that sorts rows by ``keys`` (most significant first; non-negative ints, each
    row's keys distinct from every other row's): one argsort of a mixed-radix code when it fits in
    63 bits, a lexsort otherwise."""
    if not len(keys[0]):
        return np.zeros(0, np.int64)
    radix = [int(k.max()) + 1 for k in keys]
    if math.prod(radix) >= 1 << 62:
        return np.lexsort(keys[::-1])
    code = keys[0].astype(np.int64)
    for k, r in zip(keys[1:], radix[1:], strict=True):
        code = code * r + k
    return np.argsort(code, kind="stable")  # rows arrive nearly sorted: the stable sort is the faster here


def build_rank_plan(
    rank: int,
    keys: dict[str, np.ndarray],
    fetch: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
) -> RankPlan:
    """The rank plan of ``rank`` from rows that may involve it, in any order.

    ``keys`` holds the rows' ``src``, ``dst``, ``link``, ``phase``, ``stage``, ``tensor`` and
    ``order`` (the row's position among its tensor's rows in emission order, or any number
    that sorts like it); ``fetch(idx)`` returns the ``nbytes``, ``lo``, ``hi`` (``(n, D)``,
    zero-padded) and ``ndim`` of the rows at ``idx``, so that only the rows kept are gathered.
    Rows that neither send from nor arrive at ``rank`` are dropped, and so are same-device
    landings into another rank.
    """
    src, dst = keys["src"], keys["dst"]
    landing = (keys["link"] == Link.SAME_DEVICE) & (keys["phase"] == Phase.LAND)
    to_me = dst == rank
    parts = (
        np.flatnonzero(landing & to_me),
        np.flatnonzero(~landing & (src == rank)),
        np.flatnonzero(~landing & to_me),
    )
    sel = np.concatenate(parts)
    ncopies = len(parts[0])
    kind = np.repeat(np.array([COPY, SEND, RECV], np.int8), [len(p) for p in parts])
    peer = np.concatenate([src[parts[0]], dst[parts[1]], src[parts[2]]]).astype(np.int64)
    stage = keys["stage"][sel].astype(np.int64)
    # Copy rows keep (tensor, emission) order: their stage and peer do not sort them.
    stage[:ncopies] = 0
    peer_key = peer.copy()
    peer_key[:ncopies] = 0
    perm = _sort_order(kind, stage, peer_key, keys["tensor"][sel], keys["order"][sel])
    sel, kind, peer = sel[perm], kind[perm], peer[perm]
    stage = keys["stage"][sel].astype(np.int64)
    new = np.flatnonzero(
        (kind[ncopies + 1 :] != kind[ncopies:-1])
        | (stage[ncopies + 1 :] != stage[ncopies:-1])
        | (peer[ncopies + 1 :] != peer[ncopies:-1])
    )
    n = len(sel)
    cuts = np.concatenate([[ncopies], new + ncopies + 1, [n]]) if n > ncopies else np.array([ncopies], np.int64)
    nbytes, lo, hi, ndim = fetch(sel)
    table = RankTable(  # views where fetch gave int64 columns of one gathered block: no further copies
        kind=_frozen(kind),
        stage=_frozen(stage),
        peer=_frozen(peer),
        link=_frozen(keys["link"][sel].astype(np.int8)),
        phase=_frozen(keys["phase"][sel].astype(np.int8)),
        tensor=_frozen(keys["tensor"][sel].astype(np.int64, copy=False)),
        nbytes=_frozen(nbytes.astype(np.int64, copy=False)),
        lo=_frozen(lo.astype(np.int64, copy=False)),
        hi=_frozen(hi.astype(np.int64, copy=False)),
        ndim=_frozen(ndim.astype(np.int8)),
        cuts=_frozen(cuts.astype(np.int64, copy=False)),
    )
    return RankPlan(rank, table)


def columns_rank_plan(
    rank: int, cols: dict[str, np.ndarray], lo: np.ndarray, hi: np.ndarray, ndim: np.ndarray
) -> RankPlan:
    """:func:`build_rank_plan` from whole columns: ``cols`` has the keys and ``nbytes``."""
    return build_rank_plan(rank, cols, lambda sel: (cols["nbytes"][sel], lo[sel], hi[sel], ndim[sel]))


def padded(parts: Sequence[np.ndarray], width: int) -> np.ndarray:
    """``(n_i, d_i)`` arrays stacked into one ``(Σ n_i, width)`` array, zero-padded on the right."""
    total = sum(len(p) for p in parts)
    out = np.zeros((total, width), dtype=np.int64)
    at = 0
    for p in parts:
        out[at : at + len(p), : p.shape[1]] = p
        at += len(p)
    return out


def stamped_rank_plan(
    rank: int, blocks: Sequence[tuple[TensorTemplate, Sequence[int], np.ndarray]], width: int
) -> RankPlan:
    """The rank plan of ``rank`` from templates stamped for many tensors at once.

    ``blocks`` are ``(template, tensors, rotations)``: the template's rows, stamped with
    ``rotations[i]``, are the rows of tensor ``tensors[i]`` that may involve ``rank``;
    ``width`` is the most dimensions of any tensor. The templates' rows are stacked into
    one table and every tensor's rows gathered from it in one indexing call.
    """
    used = [(tm, np.asarray(ts, dtype=np.int64), r) for tm, ts, r in blocks if len(tm.plan) and len(ts)]
    nrows = np.array([len(tm.plan) for tm, _, _ in used], dtype=np.int64)
    ntens = np.array([len(ts) for _, ts, _ in used], dtype=np.int64)
    off = np.cumsum(nrows) - nrows
    table = np.zeros((int(nrows.sum()), 6 + 2 * width), dtype=np.int64)  # the matrix of rows.py, padded
    for (tm, _, _), o, n in zip(used, off.tolist(), nrows.tolist(), strict=True):
        m, d = tm.matrix, tm.plan.lo.shape[1]
        table[o : o + n, : 6 + d] = m[:, : 6 + d]
        table[o : o + n, 6 + width : 6 + width + d] = m[:, 6 + d :]
    # Entry e of block b is row (e % n_b) of the template, for tensor tensors_b[e // n_b].
    sizes = nrows * ntens
    blk = np.repeat(np.arange(len(used), dtype=np.int64), sizes)
    pos = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    n_of = nrows[blk]
    order = pos % n_of
    tensors = np.concatenate([ts for _, ts, _ in used]) if used else np.zeros(0, np.int64)
    tensor = tensors[np.repeat(np.cumsum(ntens) - ntens, sizes) + pos // n_of]
    rows = off[blk] + order
    src = [tm.stamp_many(np.asarray(r, dtype=np.int64)).reshape(-1) for tm, _, r in used]
    keys = {
        "src": np.concatenate(src) if src else np.zeros(0, np.int64),
        "dst": table[rows, 0],
        "link": table[rows, 1],
        "phase": table[rows, 2],
        "stage": table[rows, 3],
        "tensor": tensor,
        "order": order,
    }

    def fetch(sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        g = table[rows[sel]]
        return g[:, 4], g[:, 6 : 6 + width], g[:, 6 + width :], g[:, 5]

    return build_rank_plan(rank, keys, fetch)
