"""The seed baselines, as plans in the same representation as jreshard's own.

- *gather-broadcast*: the source ranks all-gather every full tensor as an FSDP
  trainer does (:func:`_all_gather_rows`: a ring inside each gather group, the
  group kept inside a fast-link domain wherever the layout allows it), then one
  source rank (tensor ``t`` uses source rank ``t mod n``)
  broadcasts the full tensor to every destination rank, and each destination
  keeps its slice. By default (``ring=False``) the root sends the full tensor to
  each destination rank, the seed definition of the baseline; with ``ring=True``
  the broadcast runs along a chain through the destination ranks ordered by
  (domain, rank), as NCCL's ring broadcast does, so the full tensor crosses into
  each domain once. Its rows carry the full tensor box: a receiver keeps
  ``box ∩ its own box``.
- *flat-direct*: every destination rank receives each piece of its box
  straight from a source replica (replicas in turn), with no domain grouping.
"""

from __future__ import annotations

from collections.abc import Sequence

from jreshard.options import Options
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.pieces import pieces_of, source_index
from jreshard.sharding.plan import Plan
from jreshard.sharding.planner import check_pairs, default_topology, tensor_names
from jreshard.sharding.rows import Phase, TensorPlan, TensorSpec
from jreshard.sharding.topology import Topology

__all__ = ["flat_direct_layouts", "gather_broadcast_layouts"]


def _all_gather_rows(src: Layout, topo: Topology) -> tuple[list[tuple], int]:
    """Every source rank ends with the full tensor, gathered as an FSDP trainer's all-gather runs; returns
    the rows and the number of stages they take.

    The source boxes (disjoint cells) with ``k`` replicas each form ``k`` gather groups: group ``j``
    holds the ``j``-th replica of every cell, replicas ordered by (domain, rank), so a group lies inside
    one domain wherever the layout has a full copy there (HSDP: shards inside a node, replicas across
    nodes), and spans the fewest domains otherwise. Inside its group a rank receives, as NCCL's ring
    all-gather does, every cell it lacks from its predecessor on the ring of the group's members
    ordered by (domain, rank): a ring over ``m`` members whose domains are contiguous crosses
    ``D`` domain boundaries when it spans ``D > 1`` domains, each carrying the ``m - 1`` contributions
    that pass it, and none when ``D = 1``. Step ``k`` of the ring is stage ``k - 1``: a rank forwards at
    stage ``s`` what it received at stage ``s - 1``.

    A layout whose cells have unequal replica counts, or whose ranks would sit in two groups (overlapping
    boxes), has no such groups: each rank then receives every cell it lacks from its nearest holder
    (the same domain first, then the lowest rank).
    """
    sidx = source_index(src)

    def order(r: int) -> tuple[int, int]:
        return (topo.domain_of(r), r)

    holders = [sorted(h, key=order) for h in sidx.holders]
    live = [c for c, box in enumerate(sidx.boxes) if not box.empty]
    counts = {len(holders[c]) for c in live}
    groups: list[dict[int, list[int]]] = []  # per group: member -> the cells it contributes
    if len(counts) == 1:
        for j in range(counts.pop()):
            group: dict[int, list[int]] = {}
            for c in live:
                group.setdefault(holders[c][j], []).append(c)
            groups.append(group)
    members = [r for g in groups for r in g]
    rows: list[tuple] = []
    if groups and len(members) == len(set(members)):
        for group in groups:
            ring = sorted(group, key=order)
            for i, r in enumerate(ring):
                mine = src.box_of(r)
                prev = ring[i - 1]
                for k in range(1, len(ring)):
                    for c in group[ring[i - k]]:
                        box = sidx.boxes[c]
                        if r not in sidx.holders[c] and not mine.contains(box):
                            rows.append((prev, r, topo.link(prev, r), Phase.LAND, k - 1, 0, box))
        return rows, max((len(g) - 1 for g in groups), default=0)
    for r in src.ranks:
        mine = src.box_of(r)
        for c in live:
            box = sidx.boxes[c]
            if r in sidx.holders[c] or mine.contains(box):
                continue
            h = min(sidx.holders[c], key=lambda q: (topo.domain_of(q) != topo.domain_of(r), q))
            rows.append((h, r, topo.link(h, r), Phase.LAND, 0, 0, box))
    return rows, 1 if rows else 0


def _gather_broadcast_rows(t: int, src: Layout, dst: Layout, topo: Topology, ring: bool = False) -> list[tuple]:
    rows, depth = _all_gather_rows(src, topo)
    full = Box.full(src.shape)
    root = src.ranks[t % len(src.ranks)]
    chain = sorted(dst.ranks, key=lambda r: (topo.domain_of(r), r))
    prev = root
    for hop, r in enumerate(chain):
        if ring:
            rows.append((prev, r, topo.link(prev, r), Phase.LAND, depth + hop, 0, full))
            prev = r
        else:
            rows.append((root, r, topo.link(root, r), Phase.LAND, depth, 0, full))
    return rows


def _flat_direct_rows(t: int, src: Layout, dst: Layout, topo: Topology) -> list[tuple]:
    sidx = source_index(src)
    rows: list[tuple] = []
    for q, r in enumerate(dst.ranks):
        for box, j in pieces_of(dst.box_of(r), sidx):
            holders = sidx.holders[j]
            same = [h for h in holders if topo.device_of(h) == topo.device_of(r)]
            h = same[0] if same else holders[(q + t) % len(holders)]
            rows.append((h, r, topo.link(h, r), Phase.LAND, 0, 0, box))
    return rows


def _baseline(kind, rows_fn, pairs, topology, options, names) -> Plan:
    pairs = tuple((s, d) for s, d in pairs)
    topology = topology or default_topology(pairs)
    names = tensor_names(pairs, names)
    check_pairs(pairs, topology, names)
    tps = [TensorPlan.from_rows(rows_fn(t, s, d, topology), s.ndim, s.itemsize) for t, (s, d) in enumerate(pairs)]
    specs = [TensorSpec(n, s, d) for n, (s, d) in zip(names, pairs, strict=True)]
    return Plan(specs, topology, options or Options(), tps, kind=kind)


def gather_broadcast_layouts(
    pairs: Sequence[tuple[Layout, Layout]],
    topology: Topology | None = None,
    options: Options | None = None,
    names: Sequence[str] | None = None,
    *,
    ring: bool = False,
) -> Plan:
    """The gather-broadcast baseline (module docstring) for layout pairs."""

    def rows(t: int, s: Layout, d: Layout, topo: Topology) -> list[tuple]:
        return _gather_broadcast_rows(t, s, d, topo, ring)

    return _baseline("gather-broadcast-ring" if ring else "gather-broadcast", rows, pairs, topology, options, names)


def flat_direct_layouts(
    pairs: Sequence[tuple[Layout, Layout]],
    topology: Topology | None = None,
    options: Options | None = None,
    names: Sequence[str] | None = None,
) -> Plan:
    """The flat-direct-sends baseline (module docstring) for layout pairs."""
    return _baseline("flat-direct", _flat_direct_rows, pairs, topology, options, names)
