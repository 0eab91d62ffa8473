"""The cost model: hand-computed cases, the bound, and the published FFN-MoE case."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import plan_case

from jreshard.cost import Port, predict
from jreshard.errors import TopologyError
from jreshard.options import Options
from jreshard.sharding.baselines import flat_direct_layouts, gather_broadcast_layouts
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.plan import Plan
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.rows import Phase, TensorPlan, TensorSpec
from jreshard.sharding.topology import Link, Links, Topology


def _approx(x: float) -> object:
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def test_one_message_costs_bytes_over_bandwidth_plus_latency():
    # 4 x 1000 float32 = 16000 B from rank 0 (domain 0) to rank 1 (domain 1).
    src = Layout.replicated([0], (4, 1000), "float32")
    dst = Layout.replicated([1], (4, 1000), "float32")
    topo = Topology.from_domains({0: 0, 1: 1}, network_bw=1e9, latency_s=1e-3)
    pr = predict(plan_layouts([(src, dst)], topo))
    # busy = 16000 / 1e9 + 1 message * 1e-3 on both ends; one stage, so no fill.
    assert pr.seconds == _approx(16e-6 + 1e-3)
    assert pr.bound_seconds == _approx(16e-6 + 1e-3)
    assert pr.fill_seconds == 0.0
    # The send and the receive port tie; ties go to the lower port.
    assert (pr.bottleneck_rank, pr.bottleneck_port, pr.bottleneck_bytes) == (0, Port.NETWORK_SEND, 16000)
    assert dict(pr.port_seconds)[Port.NETWORK_RECV] == _approx(16e-6 + 1e-3)


def test_landing_then_fanout_pipelines_by_chunk():
    # 8 x 1000 float32 = 32000 B on rank 0 (domain 0), wanted whole by ranks 1 and 2 (domain 1).
    src = Layout.replicated([0], (8, 1000), "float32")
    dst = Layout.replicated([1, 2], (8, 1000), "float32")
    topo = Topology.from_domains({0: 0, 1: 1, 2: 1}, network_bw=1e9, fast_bw=1e10, latency_s=1e-6)
    p = plan_layouts([(src, dst)], topo, Options(min_stripe_bytes=0, chunk_bytes=4000, staging_bytes=4000))
    # The plan lands rows 0-3 on rank 1 and rows 4-7 on rank 2, which then swap halves over the fast link.
    loads = p.rank_loads()
    assert loads["network_send"] == {0: 32000}
    assert loads["network_recv"] == {1: 16000, 2: 16000}
    assert loads["fast_send"] == loads["fast_recv"] == {1: 16000, 2: 16000}
    pr = predict(p)
    # Bottleneck: rank 0 sends 32000 B in 2 messages: 32 us + 2 us.
    assert (pr.bottleneck_rank, pr.bottleneck_port) == (0, Port.NETWORK_SEND)
    assert pr.busy_seconds == _approx(34e-6)
    # Stage 0 chunk: 1 us + 4000 B / 1e9 = 5 us; stage 1 chunk: 1 us + 4000 B / 1e10 = 1.4 us.
    assert pr.fill_seconds == _approx(1.4e-6)
    assert pr.seconds == _approx(35.4e-6)
    # Bound: domain 0 has one rank (34 us); domain 1 spreads 2 x 17 us of receiving over 2 ranks.
    assert pr.bound_seconds == _approx(34e-6)
    assert pr.stages == 2


def _chain_plan(chunk: int) -> Plan:
    """Hand-made rows: 1000 B go 0 -> 1 -> 2 over the network (a relay), then 2 -> 3 over a fast link."""
    shape = (1000,)
    rows = [
        (0, 1, Link.NETWORK, Phase.LAND, 0, 0, Box((0,), (1000,))),
        (1, 2, Link.NETWORK, Phase.RELAY, 1, 0, Box((0,), (1000,))),
        (2, 3, Link.FAST, Phase.FANOUT, 2, 0, Box((0,), (1000,))),
    ]
    tp = TensorPlan.from_rows(rows, 1, 1)
    topo = Topology.from_domains({0: 0, 1: 1, 2: 2, 3: 2}, network_bw=1e3, fast_bw=1e4, latency_s=0.0)
    spec = TensorSpec("x", Layout.replicated([0], shape, "uint8"), Layout.replicated([1, 2, 3], shape, "uint8"))
    return Plan([spec], topo, Options(chunk_bytes=chunk, staging_bytes=max(chunk, 1 << 20)), [tp])


def test_stage_depth_adds_one_chunk_per_extra_hop():
    pr = predict(_chain_plan(chunk=100))
    # Every network port moves 1000 B at 1000 B/s: busy 1 s. Chunks: 0.1 s per network hop, 0.01 s fast.
    assert pr.busy_seconds == _approx(1.0)
    assert pr.fill_seconds == _approx(0.1 + 0.1 + 0.01 - 0.1)
    assert pr.seconds == _approx(1.11)
    assert pr.bound_seconds == _approx(1.0)
    assert pr.stages == 3
    # A chunk larger than the message is one short chunk: each stage then costs the whole message.
    big = predict(_chain_plan(chunk=1 << 20))
    assert big.fill_seconds == _approx(1.0 + 0.1)


def test_identical_layouts_cost_local_copies_only():
    lay = Layout.from_mesh(np.arange(4), ("tp",), ("tp",), (8, 4), "float32")
    topo = Topology.uniform(range(4), 4, same_device_bw=1e6)
    pr = predict(plan_layouts([(lay, lay)], topo))
    assert pr.bottleneck_port == Port.SAME_DEVICE
    assert pr.seconds == _approx(32 / 1e6)  # each rank copies its 2 x 4 float32 block


def test_a_plan_that_moves_nothing_is_predicted_free():
    lay = Layout.replicated([0], (0, 3), "float32")
    pr = predict(plan_layouts([(lay, lay)], Topology.uniform([0], 1)))
    assert pr.seconds == pr.bound_seconds == 0.0
    assert pr.bottleneck_port is None
    assert "nothing moves" in str(pr)


def test_links_may_change_but_not_domains():
    src = Layout.replicated([0], (1000,), "uint8")
    dst = Layout.replicated([1], (1000,), "uint8")
    topo = Topology.from_domains({0: 0, 1: 1}, network_bw=1e3, latency_s=0.0)
    p = plan_layouts([(src, dst)], topo)
    faster = dataclasses.replace(topo, links=Links(network_bw=2e3, latency_s=0.0))
    assert predict(p, faster).seconds == _approx(predict(p).seconds / 2)
    with pytest.raises(TopologyError, match="rank 1 is in domain 0"):
        predict(p, Topology.from_domains({0: 0, 1: 0}))
    with pytest.raises(TopologyError, match="not in the topology"):
        predict(p, Topology.from_domains({0: 0}))


def test_printed_numbers_are_labelled_predicted():
    text = str(predict(_chain_plan(chunk=100)))
    assert text.startswith("predicted ") and "predicted bound" in text


@given(
    plan_case(),
    st.sampled_from([1e3, 5e10]),
    st.sampled_from([1e4, 9e11]),
    st.sampled_from([0.0, 5e-6]),
    st.sampled_from([1, 64, 1 << 20]),
)
def test_no_plan_is_predicted_faster_than_its_bound(case, net, fast, lat, chunk):
    src, dst, topo, opts = case
    topo = dataclasses.replace(topo, links=Links(network_bw=net, fast_bw=fast, latency_s=lat))
    options = Options(chunk_bytes=chunk, staging_bytes=1 << 20, **opts)
    for p in (
        plan_layouts([(src, dst)], topo, options),
        gather_broadcast_layouts([(src, dst)], topo, options),
        gather_broadcast_layouts([(src, dst)], topo, options, ring=True),
        flat_direct_layouts([(src, dst)], topo, options),
    ):
        pr = predict(p)
        assert pr.seconds >= pr.bound_seconds * (1 - 1e-12), (p.kind, pr)
        assert pr.seconds == pytest.approx(pr.busy_seconds + pr.fill_seconds)
        assert pr.fill_seconds >= 0


@pytest.mark.parametrize("r", [2, 4, 8])
def test_published_ffn_moe_case_is_within_10_percent_of_the_floor(r):
    # One [256, 2048, 7168] bf16 expert tensor, EP16 on 16 GPUs of one NVL72 rack, to TP8 x r on another
    # rack; 50 GB/s NICs, NVLink 900 GB/s each way. Floor: 7168 MB / (16 x 50 GB/s) = 8.96 ms.
    shape = (256, 2048, 7168)
    src = Layout.from_mesh(np.arange(16), ("ep",), ("ep",), shape, "bfloat16")
    dst = Layout.from_mesh(np.arange(72, 72 + 8 * r).reshape(r, 8), ("dp", "tp"), (None, None, "tp"), shape, "bfloat16")
    topo = Topology.uniform(range(72 + 8 * r), 72, network_bw=50e9, fast_bw=900e9)
    pr = predict(plan_layouts([(src, dst)], topo))
    floor = 7168e6 / (16 * 50e9)
    assert floor <= pr.seconds <= 1.10 * floor
    assert (pr.bottleneck_port, pr.bottleneck_bytes) == (Port.NETWORK_SEND, 256 * 2048 * 7168 * 2 // 16)
    # Flat direct sends every destination's pieces from the 16 source NICs: r x 8 x 7168 MB / 8 / 16.
    flat = predict(flat_direct_layouts([(src, dst)], topo))
    assert flat.seconds == pytest.approx(r * 256 * 2048 * 7168 * 2 / 16 / 50e9 + 8 * r * 5e-6)
