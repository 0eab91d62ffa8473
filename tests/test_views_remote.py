"""Views across processes, in one process: every rank its own "process" over LocalComm, so every piece
that crosses ranks travels as a message (packed in the wire dtype, forwarded by ``via`` ranks), and the
destination shards equal the in-process executor's, bit for bit; bytes per link equal the lowering's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_views_properties import _bits, compositions, shardings

from jreshard import Layout, Topology, views
from jreshard.engine.loopback import LocalComm
from jreshard.sharding.topology import Link
from jreshard.views.lowering import lower_tree
from jreshard.views.quant import _Quant
from jreshard.views.remote import run_pieces


def _run_remote(view, dst, topo, process_of):
    leaves = view.leaves()
    layouts = [Layout.from_sharding(leaf.source.sharding, leaf.shape, leaf.dtype) for leaf in leaves]
    dst_lay = Layout.from_sharding(dst, view.shape, view.dtype)
    (low,) = lower_tree([view], leaves, layouts, [dst_lay], topo)
    quant = isinstance(view, _Quant)
    src, boxes = {}, {}
    for i, leaf in enumerate(leaves):
        for s in leaf.source.addressable_shards:
            src[(i, s.device.id)] = np.asarray(s.data)
            boxes[(i, s.device.id)] = layouts[i].box_of(s.device.id)
    outs = {(r, -1): np.full(dst_lay.box_of(r).shape, 0, dst_lay.np_dtype) for r in dst_lay.ranks}
    for k, task in enumerate(low.tasks):
        outs[(task.dst_rank, k)] = np.full(task.hull.shape, np.nan, np.float32)
    stats = run_pieces(
        [low],
        LocalComm(range(8)),
        process_of,
        src,
        boxes,
        lambda t, r, k: outs[(r, k)],
        quants={0: view} if quant else {},
        timeout_s=10.0,
    )
    for k, task in enumerate(low.tasks):  # the tasks quantised after the bytes land
        if not task.at_sender:
            outs[(task.dst_rank, -1)][...] = view.compute(outs[(task.dst_rank, k)], task.hull, task.box)
    return low, {r: outs[(r, -1)] for r in dst_lay.ranks}, stats


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_pieces_as_messages_equal_the_in_process_result(data):
    view, _ = data.draw(compositions())
    dst = data.draw(shardings(view.shape))
    topo = Topology.uniform(range(8), domain_size=data.draw(st.sampled_from([1, 2, 4, 8])))
    group = data.draw(st.sampled_from([1, 2]))  # ranks per "process"
    low, outs, stats = _run_remote(view, dst, topo, {r: r // group for r in range(8)})
    ref = views.transfer(view, dst, topology=topo)
    for s in ref.addressable_shards:
        np.testing.assert_array_equal(_bits(outs[s.device.id]), _bits(s.data))
    assert stats.bytes_by_link[Link.NETWORK] == low.network_bytes
    assert stats.bytes_by_link[Link.FAST] == low.fast_bytes
    assert stats.bytes_by_link[Link.LOCAL] == low.local_bytes


def test_via_ranks_forward_what_they_received():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = np.array(jax.devices())
    fsdp = NamedSharding(Mesh(devs[:4], ("f",)), P("f"))
    x = jax.device_put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16), fsdp)
    k = jax.device_put(jnp.ones((8, 4), jnp.float32), fsdp)
    fused = views.astype(views.concat([x, k, k], axis=1, groups=2), jnp.bfloat16)  # k repeated: GQA
    dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    topo = Topology.uniform(range(8), domain_size=4)
    low, outs, stats = _run_remote(fused, dst, topo, {r: r for r in range(8)})
    assert any(p.via is not None for p in low.pieces) and stats.messages > 4
    ref = views.transfer(fused, dst, topology=topo)
    for s in ref.addressable_shards:
        np.testing.assert_array_equal(_bits(outs[s.device.id]), _bits(s.data))
    assert stats.bytes_by_link[Link.NETWORK] == low.network_bytes < fused.size * 2 * 2  # DP replicas: sent once


@pytest.mark.parametrize("rows", [8, 4])  # 8-row blocks in 8-row source shards: quantised at the sender
@pytest.mark.parametrize("part", [0, 1])
def test_block_fp8_is_quantised_at_the_sender_when_its_blocks_lie_in_one_piece(rows, part):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = np.array(jax.devices())
    x = jax.device_put(
        jnp.sin(jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 16)) * 300,
        NamedSharding(Mesh(devs[: 32 // rows], ("f",)), P("f")),
    )
    quant = views.quantize_fp8(x, block=(8, 8))[part]
    dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    topo = Topology.uniform(range(8), domain_size=4)
    low, outs, stats = _run_remote(quant, dst, topo, {r: r for r in range(8)})
    assert all(t.at_sender for t in low.tasks) == (rows == 8)
    ref = views.transfer(quant, dst, topology=topo)
    for s in ref.addressable_shards:
        np.testing.assert_array_equal(_bits(outs[s.device.id]), _bits(s.data))
    assert stats.bytes_by_link[Link.NETWORK] == low.network_bytes
    assert stats.bytes_by_link[Link.FAST] == low.fast_bytes
    if rows == 8:  # one byte a weight (or four a scale) on the wire, not four a float32
        assert low.network_bytes == quant.size * (1 if part == 0 else 4)
