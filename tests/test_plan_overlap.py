"""Destination boxes that overlap inside one domain, and destination ranks that share a device."""

from __future__ import annotations

from _reference import (
    check_destinations,
    check_exact_and_minimal,
    execute,
    random_values,
)
from hypothesis import given
from strategies import overlap_case

from jreshard.options import Options
from jreshard.sharding.baselines import flat_direct_layouts, gather_broadcast_layouts
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts, rank_plan
from jreshard.sharding.rows import Phase
from jreshard.sharding.topology import Link, Topology


def test_overlapping_boxes_in_one_domain_enter_it_once():
    # Rank 0 holds the vector; ranks 1 and 2 (one domain) want [0, 3) and [1, 4): 4 elements enter, not 6.
    src = Layout.replicated([0], (8,), "float32")
    dst = Layout.from_boxes((8,), "float32", {1: Box((0,), (3,)), 2: Box((1,), (4,))})
    topo = Topology.from_domains({0: 0, 1: 1, 2: 1})
    p = plan_layouts([(src, dst)], topo)
    s = p.stats()
    assert s.network_bytes == s.network_bytes_lower_bound == 16
    ring = gather_broadcast_layouts([(src, dst)], topo, ring=True).stats().network_bytes
    assert s.network_bytes <= min(ring, flat_direct_layouts([(src, dst)], topo).stats().network_bytes)
    values = random_values(p)
    check_destinations(p, values, execute(p, values))


def test_fanout_between_ranks_on_one_device_is_local():
    src = Layout.replicated([0], (8,), "float32")
    dst = Layout.replicated([1, 2], (8,), "float32")
    topo = Topology.from_domains({0: 0, 1: 1, 2: 1}, devices={0: 0, 1: 5, 2: 5})
    p = plan_layouts([(src, dst)], topo)
    fan = [t for t in p.transfers() if t.phase == Phase.FANOUT]
    assert [(t.src, t.dst, t.link) for t in fan] == [(1, 2, Link.SAME_DEVICE)]
    assert p.stats().same_device_bytes == 32 and p.stats().fast_bytes == 0
    # It runs after the landing it forwards: a message at its stage, not a stage-0 same-device copy.
    rp = p.rank_plan(2)
    assert rp.copies == () and [(m.src, m.link, m.stage) for m in rp.recvs] == [(1, Link.SAME_DEVICE, 1)]


@given(overlap_case())
def test_overlap_plans_deliver_exactly_and_minimally(case):
    src, dst, topo, opts = case
    p = plan_layouts([(src, dst)], topo, Options(**opts))
    check_exact_and_minimal(p, src, dst, topo)
    s = p.stats()
    for base in (
        flat_direct_layouts([(src, dst)], topo),
        gather_broadcast_layouts([(src, dst)], topo),
        gather_broadcast_layouts([(src, dst)], topo, ring=True),
    ):
        assert s.network_bytes <= base.stats().network_bytes


@given(overlap_case())
def test_overlap_links_follow_topology(case):
    src, dst, topo, opts = case
    for t in plan_layouts([(src, dst)], topo, Options(**opts)).transfers():
        assert t.link == topo.link(t.src, t.dst)


@given(overlap_case())
def test_overlap_rank_plans_equal_slices(case):
    src, dst, topo, opts = case
    o = Options(**opts)
    whole = plan_layouts([(src, dst), (src, dst)], topo, o)
    for r in sorted(set(src.ranks) | set(dst.ranks)):
        assert rank_plan([(src, dst), (src, dst)], r, topo, o) == whole.rank_plan(r)
