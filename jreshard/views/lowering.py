"""Lowering a view to pieces: which source shard fills which part of which destination shard.

For one view and its destination layout, every destination rank's box is cut into
the view's affine regions (:meth:`View.regions`), and each region into its
overlaps with the distinct source boxes of its leaf. A piece is then read from
a holder of that source box, chosen in this order: the destination's own device,
a rank of its fast-link domain, else the network. Bytes that cross the network
into a domain do so once per domain: the first destination rank there that needs
a source element (in a given wire dtype) receives it over the network; every other
rank of the domain that needs it gets it over fast links from that one
(``via``). Holders are spread by the bytes each has been given to send.

A cast chain is cut at its narrowest dtype (:func:`~jreshard.views.casts.wire_cut`):
the sender casts up to there, the receiver the rest, and the bytes of a piece are
counted in that wire dtype. Pure numpy: no jax.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Link, Topology
from jreshard.views.algebra import Leaf, Mapped, View
from jreshard.views.casts import wire_cut
from jreshard.views.quant import QuantView, blocks_in

__all__ = ["LeafLowering", "ViewPiece", "QuantTask", "lower", "lower_tree", "subtract"]


@dataclasses.dataclass(frozen=True, slots=True)
class ViewPiece:
    """One copy: a box of a source shard into a box of a destination shard (or of a quantisation tile).

    Attributes:
      leaf: the source leaf's index (in the list given to :func:`lower`).
      src_rank: the source rank read (a holder of ``src_box``).
      src_box: the source elements, in the leaf's global coordinates.
      dst_rank: the destination rank written.
      dst_box: where they land, in coordinates relative to the destination shard (or tile).
      axes: per destination axis, the source axis it runs along (-1: a new axis of extent 1).
      src_dtype: the leaf's dtype.
      sender_casts: the casts the sender applies; the bytes travel in the last one's dtype.
      receiver_casts: the casts the receiver applies after.
      link: how the bytes reach ``dst_rank``.
      via: for bytes another destination rank of the domain received over the network, that rank.
    """

    leaf: int
    src_rank: int
    src_box: Box
    dst_rank: int
    dst_box: Box
    axes: tuple[int, ...]
    src_dtype: str
    sender_casts: tuple[str, ...]
    receiver_casts: tuple[str, ...]
    link: Link
    via: int | None = None

    @property
    def wire_dtype(self) -> str:
        return self.sender_casts[-1] if self.sender_casts else self.src_dtype

    @property
    def dst_dtype(self) -> str:
        chain = self.sender_casts + self.receiver_casts
        return chain[-1] if chain else self.src_dtype

    @property
    def source_order(self) -> tuple[int, ...]:
        """The source axes in destination order (then the extent-1 ones no destination axis runs along):
        ``source[src_box].transpose(source_order).reshape(dst_box.shape)`` lands in ``dst_box``."""
        used = [a for a in self.axes if a >= 0]
        return (*used, *(a for a in range(self.src_box.ndim) if a not in used))

    @property
    def wire_bytes(self) -> int:
        return self.src_box.volume * numpy_dtype(self.wire_dtype).itemsize

    def byte_geometry(self, src_shard: Box, dst_shard_shape: Sequence[int]) -> tuple:
        """``(shape, src_offset, src_strides, dst_offset, dst_strides)`` in bytes, for a strided copy
        from a C-ordered source shard holding ``src_shard`` into a C-ordered destination shard."""
        s_item, d_item = numpy_dtype(self.src_dtype).itemsize, numpy_dtype(self.dst_dtype).itemsize
        s_strides = _c_strides(src_shard.shape, s_item)
        d_strides = _c_strides(tuple(dst_shard_shape), d_item)
        rel = [a - o for a, o in zip(self.src_box.lo, src_shard.lo, strict=True)]
        src_off = sum(r * s for r, s in zip(rel, s_strides, strict=True))
        dst_off = sum(a * s for a, s in zip(self.dst_box.lo, d_strides, strict=True))
        src_str = tuple(s_strides[a] if a >= 0 else 0 for a in self.axes)
        return self.dst_box.shape, src_off, src_str, dst_off, d_strides


def _c_strides(shape: Sequence[int], item: int) -> tuple[int, ...]:
    out, acc = [], item
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


@dataclasses.dataclass(frozen=True, slots=True)
class QuantTask:
    """A destination shard of a quantised leaf: the pieces fill a tile of ``x`` over ``hull``,
    quantised after they land; ``at_sender``: every block lies in one source piece, so a sender
    could quantise it and send float8 weights (or the float32 scales) instead."""

    dst_rank: int
    hull: Box
    box: Box
    pieces: tuple[ViewPiece, ...]
    at_sender: bool


@dataclasses.dataclass(frozen=True, slots=True)
class LeafLowering:
    """Everything one destination leaf needs: its pieces (or quantisation tasks) and their bytes."""

    pieces: tuple[ViewPiece, ...]
    tasks: tuple[QuantTask, ...]
    network_bytes: int
    fast_bytes: int
    same_device_bytes: int
    loads: tuple[tuple[int, Link, bool, int], ...] = ()  # (rank, link, sending?, bytes), one row per rank and link


class _Domains:
    """Per fast-link domain and wire key, the source boxes already received and by whom."""

    def __init__(self) -> None:
        self.landed: dict[tuple, _Landed] = {}
        self.sent: dict[int, int] = {}

    def pick(self, holders: Sequence[int], nbytes: int) -> int:
        r = min(holders, key=lambda h: (self.sent.get(h, 0), h))
        self.sent[r] = self.sent.get(r, 0) + nbytes
        return r


class _Landed:
    """The boxes that entered one domain from one source box, in order, as ``[box, receiving rank, arrived
    yet]`` entries, with their bounds in numpy so a box finds the entries it may meet without a scan."""

    __slots__ = ("_hi", "_lo", "entries")

    def __init__(self, ndim: int) -> None:
        self.entries: list[list[Any]] = []
        self._lo = np.empty((8, ndim), np.int64)
        self._hi = np.empty((8, ndim), np.int64)

    def add(self, box: Box, via: int, arrived: bool) -> None:
        n = len(self.entries)
        if n == len(self._lo):
            self._lo = np.concatenate([self._lo, np.empty_like(self._lo)])
            self._hi = np.concatenate([self._hi, np.empty_like(self._hi)])
        self._lo[n] = box.lo
        self._hi[n] = box.hi
        self.entries.append([box, via, arrived])

    def meeting(self, box: Box) -> list[list[Any]]:
        """The entries, in order, whose box overlaps ``box`` on every axis (all of them when few): a superset
        of those that meet ``box`` or any box inside it."""
        n = len(self.entries)
        if n <= _SCAN:
            return self.entries
        return [self.entries[j] for j in _overlapping(self._lo[:n], self._hi[:n], box)]


def lower_tree(
    views: Sequence[View], leaves: Sequence[Leaf], layouts: Sequence[Layout], dsts: Sequence[Layout], topology: Topology
) -> list[LeafLowering]:
    """:func:`lower` for every destination leaf of a tree, sharing the domains' received bytes:
    a source element two destination leaves need in one wire dtype enters a domain once."""
    state = _Domains()
    return [lower(v, leaves, layouts, d, topology, _state=state) for v, d in zip(views, dsts, strict=True)]


def lower(
    view: View,
    leaves: Sequence[Leaf],
    layouts: Sequence[Layout],
    dst: Layout,
    topology: Topology,
    *,
    _state: _Domains | None = None,
) -> LeafLowering:
    """The pieces of ``view`` into every rank of ``dst`` (module docstring).

    Args:
      view: the destination leaf.
      leaves: every source leaf, in a fixed order (a piece names its leaf by index).
      layouts: ``layouts[i]`` is the layout of ``leaves[i]``.
      dst: the destination layout (shape ``view.shape``, dtype ``view.dtype``).
      topology: every source and destination rank.

    Example:
      >>> import numpy as np
      >>> from jreshard.views import concat, astype
      >>> src = Layout.from_mesh(np.arange(2), ("x",), ("x",), (4, 6), "float32")
      >>> q, k = Leaf(src), Leaf(dataclasses.replace(src))  # two tensors of one layout
      >>> fused = astype(concat([q, k], axis=1, groups=2), "bfloat16")
      >>> dst = Layout.from_mesh(np.arange(2, 4), ("tp",), (None, "tp"), (4, 12), "bfloat16")
      >>> low = lower(fused, [q, k], [src, src], dst, Topology.uniform(range(4), domain_size=2))
      >>> low.network_bytes, sorted({p.wire_dtype for p in low.pieces})  # 48 float32 in, as bfloat16
      (96, ['bfloat16'])
    """
    if view.shape != dst.shape:
        raise ValueError(f"lower: the view has shape {view.shape} but the destination layout {dst.shape}")
    index = {id(leaf.source): i for i, leaf in enumerate(leaves)}
    state = _Domains() if _state is None else _state
    order = sorted(dst.ranks, key=lambda r: (topology.domain_of(r), r))
    pieces: list[ViewPiece] = []
    tasks: list[QuantTask] = []
    cache: dict[Box, list[Mapped]] = {}
    quant = view if isinstance(view, QuantView) else None
    reps: dict[tuple[int, Box], tuple[int, ...]] = {}
    for r in order:
        key = (topology.domain_of(r), dst.box_of(r))
        reps[key] = (*reps.get(key, ()), r)
    for r in order:
        box = dst.box_of(r)
        g = topology.domain_of(r)
        if quant is None:
            if box not in cache:
                cache[box] = view.regions(box)
            pieces += _pieces(cache[box], box.lo, r, index, layouts, topology, state, reps[(g, box)], view.ndim)
            continue
        hull = quant.hull(box)
        content = ("fp8", quant.part, quant.block)  # weights and scales of one x are different bytes
        ps = _pieces(
            quant.x.regions(hull), hull.lo, r, index, layouts, topology, state, reps[(g, box)], view.ndim - 2, content
        )
        aligned = all(_block_aligned(p.dst_box, hull, quant.block, quant.x.shape) for p in ps)
        tasks.append(QuantTask(r, hull, box, tuple(ps), aligned))
    net = fast = same = 0
    loads: dict[tuple[int, Link, bool], int] = {}
    for p in pieces:
        net, fast, same = _count(p, p.wire_bytes, net, fast, same, loads)
    for t in tasks:
        for p in t.pieces:
            nbytes = p.wire_bytes
            if t.at_sender and quant is not None:
                part = intersect(_global(p.dst_box, t.hull), t.box if quant.part == "weights" else t.hull)
                nbytes = 0 if part is None else part.volume  # one float8 byte a weight
                if quant.part == "scales":
                    nbytes = blocks_in(p.dst_box, quant.block) * 4
            net, fast, same = _count(p, nbytes, net, fast, same, loads)
    rows = tuple((r, lk, out, n) for (r, lk, out), n in sorted(loads.items()))
    return LeafLowering(tuple(pieces), tuple(tasks), net, fast, same, rows)


def _global(rel: Box, outer: Box) -> Box:
    return _box(
        tuple(a + o for a, o in zip(rel.lo, outer.lo, strict=True)),
        tuple(b + o for b, o in zip(rel.hi, outer.lo, strict=True)),
    )


def _count(p: ViewPiece, nbytes: int, net: int, fast: int, same: int, loads: dict) -> tuple[int, int, int]:
    if p.link is not Link.SAME_DEVICE:
        sender = p.via if p.via is not None else p.src_rank
        for key in ((sender, p.link, True), (p.dst_rank, p.link, False)):
            loads[key] = loads.get(key, 0) + nbytes
    if p.link is Link.NETWORK:
        return net + nbytes, fast, same
    if p.link is Link.FAST:
        return net, fast + nbytes, same
    return net, fast, same + nbytes


def _block_aligned(b: Box, hull: Box, block: tuple[int, int], shape: tuple[int, ...]) -> bool:
    g = _global(b, hull)
    for k, n in zip((-2, -1), block, strict=True):
        if g.lo[k] % n or (g.hi[k] % n and g.hi[k] != shape[k]):
            return False
    return True


def _pieces(
    regions: list[Mapped],
    origin: tuple[int, ...],
    r: int,
    index: dict[int, int],
    layouts: Sequence[Layout],
    topo: Topology,
    state: _Domains,
    replicas: tuple[int, ...],
    blocked_from: int,
    content: tuple = (),
) -> list[ViewPiece]:
    """The pieces that fill ``regions`` on rank ``r`` (boxes relative to ``origin``); ``replicas``: the
    ranks of ``r``'s domain with the same destination box, ascending (``r`` among them). New bytes are
    striped along source axes that view axes below ``blocked_from`` run along (so quantisation blocks stay whole).
    ``content`` names what the bytes on the wire are beyond their source elements and wire dtype (a quantised
    output's part and block): bytes that entered the domain are shared only between pieces of the same content."""
    out: list[ViewPiece] = []
    g = topo.domain_of(r)
    for m in regions:
        i = index[id(m.leaf.source)]
        lay = layouts[i]
        k = wire_cut(lay.dtype, m.chain)
        send, recv = m.chain[:k], m.chain[k:]
        item = numpy_dtype(send[-1] if send else lay.dtype).itemsize
        whole = m.src_box()
        for sbox, holders in _groups_meeting(lay, whole):
            part = intersect(whole, sbox)
            if part is None:
                continue
            links = [topo.link(h, r) for h in holders]
            if Link.SAME_DEVICE in links or Link.FAST in links:
                best = Link.SAME_DEVICE if Link.SAME_DEVICE in links else Link.FAST
                near = [h for h, lk in zip(holders, links, strict=True) if lk is best]
                src = state.pick(near, part.volume * item)
                out.append(_piece(m, part, i, src, r, origin, lay.dtype, send, recv, best, None))
                continue
            todo = [part]
            landed = state.landed.get((g, i, send, sbox, content))  # what already entered G from this box
            if landed is None:
                landed = state.landed[(g, i, send, sbox, content)] = _Landed(len(part.lo))
            for entry in landed.meeting(part):
                if not todo:
                    break
                done, via, arrived = entry
                nxt = []
                for b in todo:
                    x = intersect(b, done)
                    if x is None:
                        nxt.append(b)
                        continue
                    if via != r:  # another rank of G receives it: over the fast links from there
                        src, lk = state.pick(holders, 0), Link.FAST
                    elif arrived:  # this rank has it already (a part used twice)
                        src, lk = state.pick(holders, 0), Link.SAME_DEVICE
                    else:  # this rank's own stripe of its replica group, promised earlier
                        src, lk = state.pick(holders, x.volume * item), Link.NETWORK
                        entry[2] = True
                    out.append(_piece(m, x, i, src, r, origin, lay.dtype, send, recv, lk, via if via != r else None))
                    nxt += subtract(b, x)
                todo = nxt
            for b in todo:  # new to G: striped over the replicas of this box in G, one NIC each
                free = [a for d, a in enumerate(m.axes) if a >= 0 and d < blocked_from]
                for stripe, lander in zip(_stripes(b, len(replicas), free), replicas, strict=False):
                    if lander == r:
                        src = state.pick(holders, stripe.volume * item)
                        out.append(_piece(m, stripe, i, src, r, origin, lay.dtype, send, recv, Link.NETWORK, None))
                    else:
                        src = state.pick(holders, 0)
                        out.append(_piece(m, stripe, i, src, r, origin, lay.dtype, send, recv, Link.FAST, lander))
                    landed.add(stripe, lander, lander == r)
    return out


_SCAN = 16  # replica groups a layout may have before a box finds the ones it meets through numpy


@functools.lru_cache(maxsize=4096)
def _group_bounds(lay: Layout) -> tuple[np.ndarray, np.ndarray]:
    groups = lay.replica_groups()
    n, d = len(groups), len(lay.shape)
    lo = np.array([b.lo for b, _ in groups], np.int64).reshape(n, d)
    hi = np.array([b.hi for b, _ in groups], np.int64).reshape(n, d)
    return lo, hi


def _groups_meeting(lay: Layout, box: Box) -> Sequence[tuple[Box, tuple[int, ...]]]:
    """The replica groups of ``lay`` (in their order) whose box may meet ``box``: all of them when they are
    few, else those whose box overlaps ``box`` on every axis (a superset of those that meet it: the caller
    still intersects)."""
    groups = lay.replica_groups()
    if len(groups) <= _SCAN:
        return groups
    return [groups[j] for j in _overlapping(*_group_bounds(lay), box)]


def _overlapping(lo: np.ndarray, hi: np.ndarray, box: Box) -> list[int]:
    """The rows, ascending, of the boxes with bounds ``lo``, ``hi`` (a box a row) that overlap ``box`` on every axis."""
    return np.flatnonzero(((lo < np.array(box.hi, np.int64)) & (hi > np.array(box.lo, np.int64))).all(axis=1)).tolist()


def _stripes(b: Box, k: int, axes: Sequence[int]) -> list[Box]:
    """``b`` cut along the longest of ``axes`` into at most ``k`` near-equal non-empty parts."""
    if k <= 1 or not axes:
        return [b]
    d = max(axes, key=lambda a: b.shape[a])
    n = min(k, b.shape[d])
    cuts = [b.lo[d] + (b.shape[d] * j) // n for j in range(n + 1)]
    return [_box((*b.lo[:d], cuts[j], *b.lo[d + 1 :]), (*b.hi[:d], cuts[j + 1], *b.hi[d + 1 :])) for j in range(n)]


def _piece(
    m: Mapped,
    part: Box,
    i: int,
    src: int,
    r: int,
    origin: tuple[int, ...],
    dtype: str,
    send: tuple[str, ...],
    recv: tuple[str, ...],
    link: Link,
    via: int | None,
) -> ViewPiece:
    lo, hi = list(m.box.lo), list(m.box.hi)  # Mapped.restrict_src, inlined: this runs per piece
    for d, a in enumerate(m.axes):
        if a >= 0:
            lo[d] = m.box.lo[d] + part.lo[a] - m.src_lo[a]
            hi[d] = lo[d] + part.hi[a] - part.lo[a]
    rel = _box(
        tuple(x - o for x, o in zip(lo, origin, strict=True)), tuple(x - o for x, o in zip(hi, origin, strict=True))
    )
    return ViewPiece(i, src, part, r, rel, m.axes, dtype, send, recv, link, via)


def _box(lo: tuple[int, ...], hi: tuple[int, ...]) -> Box:
    """A Box from bounds already known valid (skips the checks: this module makes millions)."""
    b = object.__new__(Box)
    object.__setattr__(b, "lo", lo)
    object.__setattr__(b, "hi", hi)
    return b


def intersect(a: Box, b: Box) -> Box | None:
    """``jreshard.sharding.box.intersect``, on the fast constructor."""
    lo = tuple(map(max, a.lo, b.lo))
    hi = tuple(map(min, a.hi, b.hi))
    for x, y in zip(lo, hi, strict=True):
        if y <= x:
            return None
    return _box(lo, hi)


def subtract(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as disjoint boxes (slabs along each axis in turn).

    Example:
      >>> [x.shape for x in subtract(Box((0, 0), (4, 4)), Box((1, 1), (3, 3)))]
      [(1, 4), (1, 4), (2, 1), (2, 1)]
    """
    x = intersect(a, b)
    if x is None:
        return [a]
    out = []
    lo, hi = list(a.lo), list(a.hi)
    for d in range(a.ndim):
        if lo[d] < x.lo[d]:
            out.append(_box(tuple(lo), (*hi[:d], x.lo[d], *hi[d + 1 :])))
        if x.hi[d] < hi[d]:
            out.append(_box((*lo[:d], x.hi[d], *lo[d + 1 :]), tuple(hi)))
        lo[d], hi[d] = x.lo[d], x.hi[d]
    return out
