"""The seed baselines, as plans in the same representation as jreshard's own.

- *gather-broadcast*: the source ranks all-gather every full tensor (each
  rank receives every disjoint source box it lacks, from the box's replicas in
  turn), then one source rank (tensor ``t`` uses source rank ``t mod n``)
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


def _gather_broadcast_rows(t: int, src: Layout, dst: Layout, topo: Topology, ring: bool = False) -> list[tuple]:
    sidx = source_index(src)
    rows: list[tuple] = []
    for q, r in enumerate(src.ranks):
        mine = src.box_of(r)
        for box, holders in zip(sidx.boxes, sidx.holders, strict=True):
            if r in holders or box.empty or mine.contains(box):
                continue
            h = holders[(q + t) % len(holders)]
            rows.append((h, r, topo.link(h, r), Phase.LAND, 0, 0, box))
    full = Box.full(src.shape)
    root = src.ranks[t % len(src.ranks)]
    chain = sorted(dst.ranks, key=lambda r: (topo.domain_of(r), r))
    prev = root
    for hop, r in enumerate(chain):
        if ring:
            rows.append((prev, r, topo.link(prev, r), Phase.LAND, hop + 1, 0, full))
            prev = r
        else:
            rows.append((root, r, topo.link(root, r), Phase.LAND, 1, 0, full))
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
