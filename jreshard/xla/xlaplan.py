"""A plan as the static description of one XLA computation: what every device packs, sends and unpacks.

Built once per (layout pairs, topology, options) from the :class:`~jreshard.sharding.plan.Plan`
(numpy and Python only; nothing here runs on a device). The devices taking part (the union of
every source and destination rank, in rank order) form a 1-D mesh; device ``i`` of it is the
``i``-th rank. Stage by stage, as in the plan (the network landings and the fast-link landings
of stage 0, then the relays and fan-outs that forward what arrived):

- **copies**: the landings from a source shard on the same device (and any message from a rank
  to itself) are copies inside the computation, box to box;
- **permutations**: the other messages of the stage, cut by :func:`~jreshard.xla.perms.permutations`
  into ``ppermute``s; a message's bytes are its pieces' bytes end to end, in plan order, each
  piece in C order of its box (stage 0 reads source shards, later stages the destination shards
  written so far, as the engine's schedule does);
- **unpack**: each received piece, reassembled from its segments (a long message spans several
  permutations), is written into its box of the destination shard.

Byte counts (:class:`XlaStats`) come from the same segments the computation sends, so the
computation's network bytes are the plan's, by construction and by test.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

from jreshard.errors import LayoutError, TransferError
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.plan import Message, Plan
from jreshard.sharding.rows import Phase
from jreshard.sharding.topology import Link
from jreshard.xla.perms import Permutation, permutations

__all__ = [
    "BoxCopy",
    "Pack",
    "XlaStats",
    "Received",
    "Stage",
    "XlaPlan",
    "message_sizes",
    "stage_permutations",
    "xla_plan",
]

SRC, DST = 0, 1  # which shard a piece is read from: the source shard, or the destination shard written so far


@dataclasses.dataclass(frozen=True, slots=True)
class Pack:
    """Bytes ``[start, stop)`` of the lanes of box ``lo..hi`` (shard coordinates) of ``tensor``'s ``side`` shard."""

    tensor: int
    side: int
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, slots=True)
class Received:
    """One piece received: its box ``lo..hi`` of the destination shard of ``tensor``, and its bytes as
    ``(permutation, offset in its buffer, bytes)`` segments, in order."""

    tensor: int
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    segments: tuple[tuple[int, int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class BoxCopy:
    """Box ``src_lo..src_hi`` of the ``side`` shard of ``tensor`` into its destination shard at ``dst_lo``."""

    tensor: int
    side: int
    src_lo: tuple[int, ...]
    src_hi: tuple[int, ...]
    dst_lo: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Stage:
    """One stage of the plan, for every device (index into the mesh).

    Attributes:
      perms: the stage's permutations; ``pairs[k]`` are permutation ``k``'s (sender, receiver) mesh indices.
      pairs: per permutation, its ``(sender, receiver)`` pairs.
      pack: ``pack[i][k]``: what device ``i`` packs into its send buffer of permutation ``k`` (empty: not a sender).
      received: ``received[i]``: the pieces device ``i`` unpacks after the permutations.
      copies: ``copies[i]``: the copies inside device ``i`` at this stage.
    """

    perms: tuple[Permutation, ...]
    pairs: tuple[tuple[tuple[int, int], ...], ...]
    pack: tuple[tuple[tuple[Pack, ...], ...], ...]
    received: tuple[tuple[Received, ...], ...]
    copies: tuple[tuple[BoxCopy, ...], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class XlaStats:
    """What the computation moves (see ``docs/xla.md``).

    Attributes:
      network_bytes, fast_bytes: payload bytes the permutations carry over each link kind (the plan's).
      same_device_bytes: bytes copied inside a device.
      padding_bytes: bytes the permutations send beyond their payload.
      permutations: ``ppermute`` calls in the computation.
      messages: the plan's messages the permutations carry.
    """

    network_bytes: int
    fast_bytes: int
    same_device_bytes: int
    padding_bytes: int
    permutations: int
    messages: int

    @property
    def wire_bytes(self) -> int:
        """Bytes the collectives move, padding included."""
        return self.network_bytes + self.fast_bytes + self.padding_bytes


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class XlaPlan:
    """The static computation (module docstring).

    Attributes:
      ranks: the mesh, in order: device ``i`` is rank ``ranks[i]`` (``device.id`` in one JAX program).
      src, dst: per tensor, its layouts.
      src_block, dst_block: per tensor, the shape of each of its source (destination) shards.
      stages: the stages, in plan order.
      stats: byte counts.
      sent_by: per rank, ``{Link: payload bytes it sends}``, its copies under ``Link.SAME_DEVICE`` (for a
        process's report).
      padded_by: per rank, the padding bytes it sends.
      messages_by: per rank, the segments it sends (one per permutation it sends in).
    """

    ranks: tuple[int, ...]
    src: tuple[Layout, ...]
    dst: tuple[Layout, ...]
    src_block: tuple[tuple[int, ...], ...]
    dst_block: tuple[tuple[int, ...], ...]
    stages: tuple[Stage, ...]
    stats: XlaStats
    sent_by: dict[int, dict[Link, int]]
    padded_by: dict[int, int]
    messages_by: dict[int, int]


def block_shape(layout: Layout, what: str) -> tuple[int, ...]:
    """The one shard shape of ``layout``.

    Raises:
      LayoutError: its shards differ in shape (an SPMD computation holds one block shape per array).
    """
    shapes = {layout.box_of(r).shape for r in layout.ranks}
    if len(shapes) != 1:
        raise LayoutError(
            f"{what} has shards of shapes {sorted(shapes)}; backend 'xla' needs every shard of a layout to have "
            "one shape (an even sharding): the fix is backend 'local' or an evenly divisible sharding"
        )
    return shapes.pop()


def _relative(box: Box, outer: Box) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rel = box.relative_to(outer)
    return rel.lo, rel.hi


def message_cap(staging_bytes: int) -> int:
    """The most bytes one pair sends in one permutation: half the staging budget (send plus receive fit)."""
    return max(staging_bytes // 2, 1)


def xla_plan(plan: Plan, ranks: Sequence[int] | None = None) -> XlaPlan:
    """The static XLA computation of ``plan`` over the mesh ``ranks`` (default: every rank of the plan, sorted).

    Raises:
      LayoutError: a layout with uneven shards (:func:`block_shape`).
      TransferError: the plan copies between two ranks on one device (ranks that share a device), which one
        JAX program, where a rank is a device, cannot hold.
    """
    tensors = plan.tensors
    every = sorted({r for t in tensors for r in (*t.src.ranks, *t.dst.ranks)})
    ranks = tuple(every if ranks is None else ranks)
    missing = sorted(set(every) - set(ranks))
    if missing:
        raise TransferError(f"xla_plan: ranks {missing} of the plan are not in the mesh {list(ranks)}")
    at = {r: i for i, r in enumerate(ranks)}
    n = len(ranks)
    src_block = tuple(block_shape(t.src, f"the source layout of tensor {t.name!r}") for t in tensors)
    dst_block = tuple(block_shape(t.dst, f"the destination layout of tensor {t.name!r}") for t in tensors)
    rank_plans = plan.rank_plans(every)
    cap = message_cap(plan.options.staging_bytes)
    copies: dict[int, list[list[BoxCopy]]] = defaultdict(lambda: [[] for _ in range(n)])
    sent_by: dict[int, dict[Link, int]] = defaultdict(lambda: dict.fromkeys(Link, 0))
    padded_by: dict[int, int] = defaultdict(int)
    messages_by: dict[int, int] = defaultdict(int)
    same_device_bytes = 0
    for r, rplan in rank_plans.items():
        for mv in rplan.copies:
            if mv.src != r:
                raise TransferError(
                    f"the plan copies tensor {mv.tensor} on one device from rank {mv.src} to rank {r}: two ranks "
                    "on one device; in one JAX program a rank is a device, so the fix is a topology with one rank per "
                    "device"
                )
            copies[0][at[r]].append(_copy(mv.tensor, SRC, mv.box, tensors, r))
            same_device_bytes += mv.nbytes
            sent_by[r][Link.SAME_DEVICE] += mv.nbytes
    by_stage: dict[int, list[Message]] = defaultdict(list)
    for r in every:
        for m in rank_plans[r].sends:
            if m.src == m.dst:
                side = SRC if m.stage == 0 else DST
                for p in m.pieces:
                    copies[m.stage][at[r]].append(_copy(p.tensor, side, p.box, tensors, r))
                    same_device_bytes += p.nbytes
                    sent_by[r][Link.SAME_DEVICE] += p.nbytes
            else:
                by_stage[m.stage].append(m)
    stages = []
    payload = {Link.NETWORK: 0, Link.FAST: 0, Link.SAME_DEVICE: 0}
    padding = nperms = nmsgs = 0
    for s in sorted(set(by_stage) | set(copies)):
        msgs = by_stage.get(s, [])
        perms = permutations([m.src for m in msgs], [m.dst for m in msgs], [m.nbytes for m in msgs], cap=cap)
        pack: list[list[list[Pack]]] = [[[] for _ in perms] for _ in range(n)]
        got: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)  # (message, piece) -> segments
        for k, perm in enumerate(perms):
            for seg in perm.segments:
                m = msgs[seg.message]
                side = SRC if m.stage == 0 else DST
                pos, start = 0, 0
                for j, p in enumerate(m.pieces):
                    stop = start + p.nbytes
                    a, b = max(seg.start, start), min(seg.stop, stop)
                    if a < b:
                        lay = tensors[p.tensor].src if side == SRC else tensors[p.tensor].dst
                        lo, hi = _relative(p.box, lay.box_of(m.src))
                        pack[at[m.src]][k].append(Pack(p.tensor, side, lo, hi, a - start, b - start))
                        got[(seg.message, j)].append((k, pos, b - a))
                        pos += b - a
                    start = stop
                link = Link.FAST if m.link == Link.SAME_DEVICE else m.link  # between two devices: a fast link
                payload[link] += seg.nbytes
                sent_by[m.src][link] += seg.nbytes
                padded_by[m.src] += perm.length - seg.nbytes
                messages_by[m.src] += 1
            padding += perm.wire_bytes - perm.payload_bytes
        received: list[list[Received]] = [[] for _ in range(n)]
        for i, m in enumerate(msgs):
            for j, p in enumerate(m.pieces):
                lo, hi = _relative(p.box, tensors[p.tensor].dst.box_of(m.dst))
                if p.nbytes:
                    received[at[m.dst]].append(Received(p.tensor, lo, hi, tuple(got[(i, j)])))
        pairs = tuple(tuple((at[msgs[g.message].src], at[msgs[g.message].dst]) for g in p.segments) for p in perms)
        cps = copies.get(s, [[] for _ in range(n)])
        stages.append(
            Stage(
                perms=tuple(perms),
                pairs=pairs,
                pack=tuple(tuple(tuple(x) for x in per) for per in pack),
                received=tuple(tuple(x) for x in received),
                copies=tuple(tuple(x) for x in cps),
            )
        )
        nperms += len(perms)
        nmsgs += len(msgs)
    stats = XlaStats(
        network_bytes=payload[Link.NETWORK],
        fast_bytes=payload[Link.FAST],
        same_device_bytes=same_device_bytes,
        padding_bytes=padding,
        permutations=nperms,
        messages=nmsgs,
    )
    return XlaPlan(
        ranks=ranks,
        src=tuple(t.src for t in tensors),
        dst=tuple(t.dst for t in tensors),
        src_block=src_block,
        dst_block=dst_block,
        stages=tuple(stages),
        stats=stats,
        sent_by={r: dict(v) for r, v in sent_by.items()},
        padded_by=dict(padded_by),
        messages_by=dict(messages_by),
    )


def _copy(tensor: int, side: int, box: Box, tensors: Sequence, rank: int) -> BoxCopy:
    t = tensors[tensor]
    src_lay = t.src if side == SRC else t.dst
    slo, shi = _relative(box, src_lay.box_of(rank))
    dlo, _ = _relative(box, t.dst.box_of(rank))
    return BoxCopy(tensor, side, slo, shi, dlo)


def message_sizes(plan: Plan) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per stage, the plan's messages between two different ranks as columns ``(src, dst, link, nbytes)``,
    sorted by ``(src, dst)``: what :func:`xla_plan` cuts into permutations, from the plan's rows alone
    (no rank plan, no piece objects), for plans too large to build rank plans of.
    """
    weight = Counter(id(tp) for tp in plan.tensor_plans)  # stamped tensors share one TensorPlan
    seen = {id(tp): tp for tp in plan.tensor_plans}
    cols = []
    for key, tp in seen.items():
        m = ((tp.link != Link.SAME_DEVICE) | (tp.phase != Phase.LAND)) & (tp.src != tp.dst)
        cols.append(
            np.stack([tp.stage[m], tp.src[m], tp.dst[m], tp.link[m], tp.nbytes[m] * weight[key]], axis=1).astype(
                np.int64
            )
        )
    rows = np.concatenate(cols) if cols else np.zeros((0, 5), np.int64)
    out = {}
    for s in np.unique(rows[:, 0]).tolist():
        r = rows[rows[:, 0] == s]
        keys, inv = np.unique(r[:, 1:4], axis=0, return_inverse=True)
        nbytes = np.bincount(inv.reshape(-1), weights=r[:, 4], minlength=len(keys)).astype(np.int64)
        out[int(s)] = (keys[:, 0], keys[:, 1], keys[:, 2], nbytes)
    return out


def stage_permutations(plan: Plan) -> dict[int, tuple[list[Permutation], np.ndarray]]:
    """Per stage, the permutations :func:`xla_plan` makes of the plan's messages, and the links of
    those messages (``links[segment.message]``): the computation's padding and ``ppermute`` count,
    computed without building it.

    Example:
      >>> import jreshard
      >>> from jreshard.sharding.layout import Layout
      >>> src = Layout.from_mesh([0, 1], ("x",), ("x",), (8, 8), "float32")
      >>> dst = Layout.from_mesh([2, 3], ("y",), (None, "y"), (8, 8), "float32")
      >>> cut = stage_permutations(jreshard.plan(src, dst))
      >>> [(s, len(perms), sum(p.payload_bytes for p in perms)) for s, (perms, _) in cut.items()]
      [(0, 2, 256)]
    """
    cap = message_cap(plan.options.staging_bytes)
    out = {}
    for s, (src, dst, link, nbytes) in message_sizes(plan).items():
        out[s] = (permutations(src.tolist(), dst.tolist(), nbytes.tolist(), cap=cap), link)
    return out
