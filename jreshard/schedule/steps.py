"""The schedule: which chunk of which message runs in which exchange round, for every rank of a plan.

Built once per plan and chunking options and cached; the engine
(:mod:`jreshard.engine.rounds`) interprets it. Every process computes the same
schedule from the plan alone, so the two ends of every chunk agree without talking.

**Chunks.** The pieces of a message, laid end to end in plan order, are cut
into chunks of exactly ``options.chunk_bytes`` bytes (the last one shorter). A
chunk is a list of boxes of bytes (``kernels.byte_box``): a piece that straddles a
chunk boundary is split into boxes along its outermost dimensions, so both ends
derive the same chunks from the message alone.

**Rounds.** One round is one :meth:`Communicator.exchange` group, and both ends of a
chunk post it in the same round, so every group's sends and receives match and no
process can wait on a later group. Chunk ``c`` of a message goes in the first round
that is

- after chunk ``c - 1`` of the same message,
- after every round in which its sender received bytes it forwards (for a stage
  ``s >= 1`` chunk: the sender's received chunks of stages ``< s`` whose boxes meet
  the chunk's boxes): causality, a sender only sends bytes it has,
- and where both ends still have staging room (``options.staging_bytes`` per rank).

So the fan-out of chunk ``k`` (stage 1) goes in the round after chunk ``k`` landed,
the same round as the network phase of chunk ``k + 1``.

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
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from jreshard.errors import TransferError
from jreshard.options import Options
from jreshard.schedule import kernels
from jreshard.sharding.box import Box, intersect
from jreshard.sharding.caches import cache
from jreshard.sharding.plan import Message, Plan
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
    "build_schedule",
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
      local: ``local[rank] = (src_keys, src_table, dst_table)``: copies from source
        shards ``src_keys[i] = (tensor, rank)`` into ``rank``'s destination shards.
      staging: ``staging[rank]``: the most staging bytes ``rank`` ever holds at once.
      ntensors: tensors in the plan.
      groups: how rounds are cut into exchange groups, ``{round: {(src, dst, tag): group}}``
        (rounds absent run as one group), when the schedule carries its own cut (a rank-local
        one, :mod:`jreshard.schedule.pairsched`); None: the engine cuts it with
        :func:`jreshard.schedule.groups.group_rounds`, which needs every rank's steps.
    """

    rounds: int
    steps: Mapping[int, Mapping[int, Step]]
    local: Mapping[int, tuple[tuple[tuple[int, int], ...], np.ndarray, np.ndarray]]
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

    def local(self, t: int, rank: int, side: int, bb: Box) -> tuple[tuple[int, ...], Box]:
        """(shard byte shape, box in its local byte coordinates) of byte box ``bb``."""
        outer = self.box(t, rank, side)
        if not outer.contains(bb):
            raise TransferError(f"the plan moves bytes {bb} of tensor {t} through rank {rank}, whose shard is {outer}")
        return outer.shape, bb.relative_to(outer)


def _chunks_of(m: Message, shapes: _Shapes, chunk_bytes: int) -> list[list[tuple[int, Box]]]:
    return chunk_pieces(((p.tensor, kernels.byte_box(p.box, shapes.items[p.tensor])) for p in m.pieces), chunk_bytes)


def _in_place(chunk: list[tuple[int, Box]], rank: int, side: int, shapes: _Shapes) -> tuple[int, int] | None:
    """``(buffer index, byte offset)`` when the chunk is one contiguous run of the shard."""
    if len(chunk) != 1:
        return None
    t, bb = chunk[0]
    outer, rel = shapes.local(t, rank, side, bb)
    if not rel.is_contiguous_in(outer):
        return None
    strides = [1] * len(outer)
    for d in range(len(outer) - 2, -1, -1):
        strides[d] = strides[d + 1] * outer[d + 1]
    return buffer_index(t, side), sum(a * s for a, s in zip(rel.lo, strides, strict=True))


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


@cache(max_size=32)
def _schedule_cached(key: tuple, plan: Plan, chunk_bytes: int, staging_bytes: int) -> Schedule:
    shapes = _Shapes(plan.tensors)
    ranks = sorted({r for t in plan.tensors for r in (*t.src.ranks, *t.dst.ranks)})
    progs = plan.programs(ranks)
    msgs = sorted((m for p in progs.values() for m in p.sends), key=lambda m: (m.stage, m.src, m.dst))
    align = STAGE_ALIGN if staging_bytes % STAGE_ALIGN == 0 else 1  # then a padded chunk still fits

    def padded(n: int) -> int:
        return -(-n // align) * align

    use: dict[int, list[int]] = {}
    got: dict[tuple[int, int], list[tuple[Box, int, int]]] = {}  # (rank, tensor) -> (byte box, stage, round)
    ops: dict[int, dict[int, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    nrounds = 0
    for m in msgs:
        side = SRC if m.stage == 0 else DST
        prev = -1
        for c, chunk in enumerate(_chunks_of(m, shapes, chunk_bytes)):
            n = sum(b.volume for _, b in chunk)
            lb = prev + 1
            if m.stage > 0:
                for t, bb in chunk:
                    for gb, gs, gr in got.get((m.src, t), ()):
                        if gs < m.stage and gr >= lb - 1 and intersect(gb, bb) is not None:
                            lb = gr + 1
            send_ip = _in_place(chunk, m.src, side, shapes)
            recv_ip = _in_place(chunk, m.dst, DST, shapes)
            na, nb = (0 if send_ip else padded(n)), (0 if recv_ip else padded(n))
            rnd = first_fit(use, m.src, na, m.dst, nb, lb, staging_bytes)
            prev, nrounds = rnd, max(nrounds, rnd + 1)
            for t, bb in chunk:
                got.setdefault((m.dst, t), []).append((bb, m.stage, rnd))
            tag = tag_of(m.stage, c)
            ops[m.src][rnd].append(("send", m.dst, tag, m.link, n, chunk, side, send_ip))
            ops[m.dst][rnd].append(("recv", m.src, tag, m.link, n, chunk, DST, recv_ip))
    steps, staging = _steps(ops, shapes, padded)
    local = {r: _local_tables(p, shapes) for r, p in progs.items() if p.local}
    return Schedule(rounds=nrounds, steps=steps, local=local, staging=staging, ntensors=len(plan.tensors))


Op = tuple  # ("send" | "recv", peer, tag, link, nbytes, chunk, side, in_place)


def _steps(
    ops: Mapping[int, Mapping[int, list[Op]]], shapes: _Shapes, padded: Callable[[int], int]
) -> tuple[dict[int, dict[int, Step]], dict[int, int]]:
    """Each rank's :class:`Step` per round from its operations, and the most staging it holds."""
    steps: dict[int, dict[int, Step]] = {}
    staging: dict[int, int] = {}
    for r, by_round in ops.items():
        steps[r], peak = {}, 0
        for rnd, lst in sorted(by_round.items()):
            pos = 0
            rows: dict[str, list[tuple[int, tuple[int, ...], Box, int]]] = {"send": [], "recv": []}
            wires: dict[str, list[Wire]] = {"send": [], "recv": []}
            for kind, peer, tag, link, n, chunk, side, ip in lst:
                if ip is not None:
                    wires[kind].append(Wire(peer, tag, link, n, ip[0], ip[1]))
                    continue
                wires[kind].append(Wire(peer, tag, link, n, STAGING, pos))
                for t, bb in chunk:
                    outer, rel = shapes.local(t, r, side, bb)
                    rows[kind].append((buffer_index(t, side), outer, rel, pos))
                    pos += bb.volume
                peak = max(peak, pos)
                pos = padded(pos)
            steps[r][rnd] = Step(_table(rows["send"]), _table(rows["recv"]), tuple(wires["send"]), tuple(wires["recv"]))
        staging[r] = peak
    return steps, staging


def _table(rows: list[tuple[int, tuple[int, ...], Box, int]]) -> np.ndarray:
    parts = [kernels.build_table([(b, o, box)], staging_offset=pos) for b, o, box, pos in rows]
    if not parts:
        return np.zeros((0, kernels.COLUMNS), np.int64)
    out = np.concatenate(parts)
    out.setflags(write=False)
    return out


def _local_tables(prog, shapes: _Shapes) -> tuple:
    keys: list[tuple[int, int]] = []
    pairs = []
    for tr in prog.local:
        bb = kernels.byte_box(tr.box, shapes.items[tr.tensor])
        so, sbox = shapes.local(tr.tensor, tr.src, SRC, bb)
        do, dbox = shapes.local(tr.tensor, tr.dst, DST, bb)
        keys.append((tr.tensor, tr.src))
        pairs.append((len(keys) - 1, so, sbox, buffer_index(tr.tensor, DST), do, dbox))
    src, dst = kernels.build_copy_tables(pairs)
    return tuple(keys), src, dst


def build_schedule(plan: Plan, options: Options | None = None) -> Schedule:
    """The rounds of every rank of ``plan`` (cached by the plan's inputs and the chunking options).

    Raises:
      ValueError: ``options.chunk_bytes`` is smaller than the widest item of the plan.
    """
    options = options or plan.options
    widest = max((t.src.itemsize for t in plan.tensors), default=1)
    if options.chunk_bytes < widest:
        raise ValueError(f"Options: chunk_bytes={options.chunk_bytes} is smaller than an item of {widest} bytes")
    key = (plan.kind, plan.tensors, plan.topology, plan.options.plan_key())
    return _schedule_cached(key, plan, options.chunk_bytes, options.staging_bytes)
