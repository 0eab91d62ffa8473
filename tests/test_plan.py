"""Unit tests of the planner on named cases: the seed example, relays, balance,
same-device copies, coalescing, uneven and overlapping layouts."""

from __future__ import annotations

import numpy as np
import pytest
from _reference import brute_force_lower_bound, check_destinations, execute, network_entries, random_values

import jreshard
from jreshard.options import Options
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts, rank_plan
from jreshard.sharding.rows import Phase
from jreshard.sharding.topology import Link, Topology
from jreshard.sharding.units import stripe

MiB = 1 << 20


def checked(pairs, topo, **opts):
    p = plan_layouts(pairs, topo, Options(**opts))
    values = random_values(p)
    check_destinations(p, values, execute(p, values))
    s = p.stats()
    assert s.network_bytes == s.network_bytes_lower_bound
    assert s.network_bytes_lower_bound == sum(brute_force_lower_bound(a, b, topo) for a, b in pairs)
    return p


def seed_layouts(shape=(64, 256), dtype="bfloat16"):
    """4 trainer ranks TP4 (one domain) -> 4 inference ranks TP2 x DP2 (another domain)."""
    src = Layout.from_mesh(np.arange(4), ("tp",), (None, "tp"), shape, dtype)
    dst = Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), shape, dtype)
    return src, dst, Topology.uniform(range(8), domain_size=4)


def test_seed_example_tp4_to_tp2_dp2():
    src, dst, topo = seed_layouts()
    p = checked([(src, dst)], topo)
    s = p.stats()
    shard = src.nbytes // 4
    # Each source shard crosses the network exactly once...
    net = [t for t in p.transfers() if t.link == Link.NETWORK]
    assert sorted(t.src for t in net) == [0, 1, 2, 3]
    assert all(t.nbytes == shard and t.box == src.box_of(t.src) for t in net)
    assert s.network_bytes == src.nbytes
    # ... and each landing is shared with the other replica over fast links.
    fan = [t for t in p.transfers() if t.phase == Phase.FANOUT]
    assert all(t.link == Link.FAST for t in fan) and sum(t.nbytes for t in fan) == src.nbytes
    # Every inference NIC receives one shard: the load is balanced.
    assert s.max_rank_network_recv_bytes == shard and s.max_rank_network_send_bytes == shard
    # Flat direct sends send every shard twice (once per data-parallel replica).
    flat = jreshard.baselines.flat_direct(src, dst, topo).stats()
    assert flat.network_bytes == 2 * s.network_bytes
    # Gather-and-broadcast moves at least twice the network bytes.
    gb = jreshard.baselines.gather_broadcast(src, dst, topo).stats()
    assert gb.network_bytes >= 2 * s.network_bytes
    assert gb.fast_bytes > s.fast_bytes


def test_relays_when_domains_outnumber_source_replicas():
    shape = (32, 64)
    src = Layout.from_mesh(np.arange(2), ("tp",), ("tp",), shape, "float32")
    dst = Layout.from_mesh(np.arange(8, 16).reshape(4, 2), ("dp", "tp"), ("tp",), shape, "float32")
    topo = Topology.from_domains({0: 0, 1: 0, **{r: 1 + (r - 8) // 2 for r in range(8, 16)}})
    with_relays = checked([(src, dst)], topo, relays=True)
    without = checked([(src, dst)], topo, relays=False)
    shard = src.nbytes // 2
    s, w = with_relays.stats(), without.stats()
    assert s.network_bytes == w.network_bytes == 4 * src.nbytes  # 4 domains need it all
    assert w.max_rank_network_send_bytes == 4 * shard  # each source sends once per domain
    assert s.max_rank_network_send_bytes == shard  # with relays: once in all
    assert s.relay_bytes == 3 * src.nbytes
    assert s.stages > w.stages
    # A relay sender only forwards what it received at an earlier stage (checked by
    # the executor); the first domain of the chain hears from the source.
    assert {t.src for t in with_relays.transfers() if t.phase == Phase.LAND and t.link == Link.NETWORK} == {0, 1}


def test_relays_split_into_one_chain_per_replica():
    shape = (16, 16)
    src = Layout.from_mesh(np.arange(4).reshape(2, 2), ("dp", "tp"), ("tp",), shape, "float32")  # 2 replicas
    dst = Layout.replicated(range(10, 16), shape, "float32")
    topo = Topology.from_domains({**{r: 0 for r in range(4)}, **{r: r for r in range(10, 16)}})
    p = checked([(src, dst)], topo)
    sends = p.rank_loads()["network_send"]
    assert [sends[r] for r in range(4)] == [src.nbytes // 2] * 4  # each source rank sends its shard once
    # A relaying destination sends no more than it received.
    recv = p.rank_loads()["network_recv"]
    assert all(sends.get(r, 0) <= recv[r] for r in range(10, 16))
    heads = {t.dst for t in p.transfers() if t.phase == Phase.LAND and t.link == Link.NETWORK}
    assert len(heads) == 2  # two chains


def test_source_replicas_share_the_sending():
    shape = (64, 64)
    # 4 data-parallel replicas of TP2 in one domain; 4 destination domains of TP2.
    src = Layout.from_mesh(np.arange(8).reshape(4, 2), ("dp", "tp"), (None, "tp"), shape, "float32")
    dst = Layout.from_mesh(np.arange(8, 16).reshape(4, 2), ("dp", "tp"), (None, "tp"), shape, "float32")
    topo = Topology.from_domains({**{r: 0 for r in range(8)}, **{r: 1 + (r - 8) // 2 for r in range(8, 16)}})
    p = checked([(src, dst)], topo)
    loads = p.rank_loads()["network_send"]
    assert sorted(loads) == list(range(8)), "every source replica sends"
    assert max(loads.values()) == min(loads.values()) == src.nbytes // 2


def test_landing_is_striped_across_receiving_replicas():
    shape = (64, 32)
    src = Layout.replicated([0], shape, "float32")  # one piece, one sender
    dst = Layout.replicated(range(1, 5), shape, "float32")
    topo = Topology.from_domains({0: 0, 1: 1, 2: 1, 3: 1, 4: 1})
    p = checked([(src, dst)], topo, min_stripe_bytes=0)
    recv = p.rank_loads()["network_recv"]
    assert sorted(recv) == [1, 2, 3, 4] and set(recv.values()) == {src.nbytes // 4}
    # Without striping, one NIC would take it all.
    q = checked([(src, dst)], topo, min_stripe_bytes=src.nbytes)
    assert q.stats().max_rank_network_recv_bytes == src.nbytes


def test_stripe_covers_each_piece_once_and_balances():
    pieces = [(0, Box((0, 0), (10, 8))), (1, Box((10, 0), (13, 8))), (2, Box((13, 0), (40, 8)))]
    out = stripe(pieces, 3, 4, 0)
    total = np.zeros((40, 8), int)
    for _, b, _ in out:
        total[b.slices()] += 1
    assert (total == 1).all()
    per = [sum(b.volume for _, b, q in out if q == k) for k in range(3)]
    assert max(per) - min(per) <= 8  # within one row of 8 elements
    assert [q for _, _, q in out] == sorted(q for _, _, q in out)


def test_local_first_when_colocated():
    shape = (16, 16)
    src = Layout.from_mesh(np.arange(4), ("tp",), ("tp",), shape, "float32")
    dst = Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), ("tp",), shape, "float32")
    # Inference rank 4+i shares trainer rank i's device (colocated), all in one domain.
    topo = Topology.from_domains({r: 0 for r in range(8)}, devices={r: r % 4 for r in range(8)})
    p = checked([(src, dst)], topo)
    s = p.stats()
    assert s.network_bytes == 0
    # Ranks 4 and 7 find one of their two shards on their own device; 5 and 6 find neither.
    assert s.same_device_bytes == 2 * src.nbytes // 4
    assert s.fast_bytes == 6 * src.nbytes // 4


def test_identical_layouts_move_nothing_between_ranks():
    src, _, topo = seed_layouts()
    p = checked([(src, src)], topo)
    s = p.stats()
    assert s.network_bytes == s.fast_bytes == 0 and s.messages == 0
    assert all(t.src == t.dst and t.link == Link.SAME_DEVICE for t in p.transfers())


def test_many_tensors_travel_as_few_messages():
    src, dst, topo = seed_layouts(shape=(8, 16))
    one = plan_layouts([(src, dst)], topo).stats()
    many = plan_layouts([(src, dst)] * 100, topo).stats()
    assert many.network_bytes == 100 * one.network_bytes
    assert many.messages <= 2 * one.messages  # rotation may pick other replicas, never 100x
    rp = rank_plan([(src, dst)] * 100, 0, topo)
    assert len(rp.sends) == 1 and len(rp.sends[0].pieces) == 100
    assert [p.tensor for p in rp.sends[0].pieces] == list(range(100))


def test_uneven_explicit_boxes():
    shape = (10, 7)
    src = Layout.from_boxes(shape, "float32", {0: Box((0, 0), (3, 7)), 1: Box((3, 0), (10, 7))})
    dst = Layout.from_boxes(
        shape, "float32", {5: Box((0, 0), (10, 2)), 6: Box((0, 2), (10, 7)), 7: Box((0, 2), (10, 7))}
    )
    topo = Topology.from_domains({0: 0, 1: 0, 5: 1, 6: 1, 7: 1})
    checked([(src, dst)], topo, min_stripe_bytes=0)


def test_overlapping_source_boxes_halo():
    shape = (12, 4)
    src = Layout.from_boxes(shape, "int32", {0: Box((0, 0), (7, 4)), 1: Box((5, 0), (12, 4))})  # rows 5-6 on both
    dst = Layout.from_boxes(shape, "int32", {2: Box((4, 0), (8, 4)), 3: Box((0, 0), (12, 4))})
    topo = Topology.from_domains({0: 0, 1: 1, 2: 1, 3: 2})
    p = checked([(src, dst)], topo)
    # Rank 2 shares domain 1 with source rank 1 (rows 5-11): only rows 4 crosses the network.
    assert p.rank_loads()["network_recv"][2] == 1 * 4 * 4


def test_source_must_cover_destination():
    shape = (8,)
    src = Layout.from_boxes(shape, "float32", {0: Box((0,), (4,))})
    dst = Layout.from_boxes(shape, "float32", {1: Box((0,), (8,))})
    with pytest.raises(jreshard.LayoutError, match="covers only 4 of the 8"):
        plan_layouts([(src, dst)])


@pytest.mark.parametrize("shape", [(), (0, 4), (4, 0, 2)])
def test_scalars_and_zero_size(shape):
    mesh = np.arange(2)
    spec = (None,) * len(shape)
    src = Layout.from_mesh(mesh, ("x",), spec, shape, "float32")
    dst = Layout.from_mesh(mesh + 2, ("x",), spec, shape, "float32")
    p = checked([(src, dst)], Topology.uniform(range(4), 2))
    assert p.stats().network_bytes == (4 if shape == () else 0)


def test_plans_are_cached_and_deterministic():
    src, dst, topo = seed_layouts()
    a = plan_layouts([(src, dst)], topo)
    assert plan_layouts([(src, dst)], topo) is a
    fresh_src = Layout.from_json(src.to_json())
    b = plan_layouts([(fresh_src, dst)], topo, Options(min_stripe_bytes=1))
    assert [(t.src, t.dst, t.box) for t in a.transfers()] == [(t.src, t.dst, t.box) for t in b.transfers()]


def test_network_entries_oracle_counts_duplicates():
    src, dst, topo = seed_layouts()
    p = jreshard.baselines.flat_direct(src, dst, topo)
    # Both replicas of a destination box in one domain get every element over the network.
    assert max(c.max() for c in network_entries(p).values()) == 2
    assert p.stats().network_bytes == 2 * p.stats().network_bytes_lower_bound
