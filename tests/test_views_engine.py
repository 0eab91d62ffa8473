"""Views on the engine: a lowering's pieces scheduled as the engine's rounds (:mod:`jreshard.schedule.viewsched`)
and run by the one round loop, every rank its own "process" over LocalComm, so every piece that crosses ranks
travels as chunks of messages (packed and cast into staging in the wire dtype, forwarded by ``via`` ranks).
The destination shards equal the in-process executor's bit for bit; the bytes per link equal the lowering's;
with small chunks and ``max_group_ops=2`` no group holds more than 2 operations and no rank more staging
than the bound (from the recording transport)."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_engine import PostingComm
from test_views_properties import _bits, compositions, shardings

from jreshard import Layout, Options, Topology, views
from jreshard.engine.buffers import aligned_empty
from jreshard.engine.loopback import LocalComm
from jreshard.engine.recording import RecordingComm
from jreshard.engine.viewrun import run_view_schedule
from jreshard.options import Backend
from jreshard.report import ReportBuilder
from jreshard.schedule import kernels
from jreshard.schedule.viewsched import view_schedule
from jreshard.sharding.topology import Link
from jreshard.views.lowering import lower_tree
from jreshard.views.quant import QuantView


def _run(view, dst, topo, options=None, comm=None, pipelined=False):
    """Lower, schedule and run ``view`` into ``dst`` on the engine; returns (lowering, shards, stats, schedule)."""
    options = options or Options()
    leaves = view.leaves()
    layouts = [Layout.from_sharding(leaf.source.sharding, leaf.shape, leaf.dtype) for leaf in leaves]
    dst_lay = Layout.from_sharding(dst, view.shape, view.dtype)
    (low,) = lower_tree([view], leaves, layouts, [dst_lay], topo)
    quant = [(view.part, view.block, view.x.dtype)] if isinstance(view, QuantView) else [None]
    vs = view_schedule([low], layouts, [dst_lay], topo, options, quant, pipelined=pipelined)
    src = {}
    for i, leaf in enumerate(leaves):
        for s in leaf.source.addressable_shards:
            a = np.ascontiguousarray(np.asarray(s.data))
            src[(i, s.device.id)] = a.reshape(-1).view(np.uint8)
    outs = {}
    for r in dst_lay.ranks:
        nbytes = dst_lay.box_of(r).volume * dst_lay.np_dtype.itemsize
        outs[(0, r)] = aligned_empty(nbytes)
        outs[(0, r)][:] = 0xA5  # every byte must be written
    comm = comm or LocalComm(range(8))
    stats = run_view_schedule(
        vs, [view], layouts, [dst_lay], comm, src, outs, options=options, report=ReportBuilder(Backend.LOCAL)
    )
    typed = {r: outs[(0, r)].view(dst_lay.np_dtype).reshape(dst_lay.box_of(r).shape) for r in dst_lay.ranks}
    return low, typed, stats, vs


def _check(view, dst, topo, *, bound=False, **kw):
    low, outs, stats, vs = _run(view, dst, topo, **kw)
    ref = views.transfer(view, dst, topology=topo)
    for s in ref.addressable_shards:
        np.testing.assert_array_equal(_bits(outs[s.device.id]), _bits(s.data))
    assert vs.bytes_by_link[Link.NETWORK] == stats.sent_bytes[Link.NETWORK] == low.network_bytes
    assert stats.sent_bytes[Link.FAST] == low.fast_bytes
    if bound:  # the network bytes the engine sent equal the brute-force bound in the wire dtype
        leaves = view.leaves()
        lays = [Layout.from_sharding(lf.source.sharding, lf.shape, lf.dtype) for lf in leaves]
        dst_lay = Layout.from_sharding(dst, view.shape, view.dtype)
        want = views.brute_force_network_bound([view], leaves, lays, [dst_lay], topo)
        assert stats.sent_bytes[Link.NETWORK] == want > 0
    return low, stats, vs


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_compositions_on_the_engine_equal_the_in_process_result(data):
    """Over LocalComm, and over the posting double (two arenas a rank where they fit: packs ahead, forwards
    from the landed staging; a group's bytes move only when it is waited on)."""
    view, _ = data.draw(compositions())
    dst = data.draw(shardings(view.shape))
    topo = Topology.uniform(range(8), domain_size=data.draw(st.sampled_from([1, 2, 4, 8])))
    chunk = data.draw(st.sampled_from([16, 40, 1 << 20]))
    staging = max(64, data.draw(st.sampled_from([2, 16])) * chunk)
    comm = data.draw(st.sampled_from([LocalComm(range(8)), PostingComm(ranks=range(8), topology=topo)]))
    _check(view, dst, topo, options=Options(chunk_bytes=chunk, staging_bytes=staging), comm=comm)


def _devs():
    return np.array(jax.devices())


def test_fused_gqa_cast_forwards_through_via_ranks_in_small_chunks():
    devs = _devs()
    fsdp = NamedSharding(Mesh(devs[:4], ("f",)), P("f"))
    x = jax.device_put(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 7, fsdp)
    k = jax.device_put(jnp.ones((8, 4), jnp.float32) * 3.3, fsdp)
    fused = views.astype(views.concat([x, k, k], axis=1, groups=2), jnp.bfloat16)  # k repeated: GQA
    dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    topo = Topology.uniform(range(8), domain_size=4)
    options = Options(chunk_bytes=16, staging_bytes=64, max_group_ops=2)
    rec = RecordingComm(range(8), topo)
    low, stats, _ = _check(fused, dst, topo, bound=True, options=options, comm=rec)
    assert any(p.via is not None for p in low.pieces)
    assert 0 < max(stats.peak_staging_bytes.values()) <= 64
    assert 0 < rec.most_ops_in_a_group() <= 2
    assert max(r.nbytes for r in rec.records) <= 16
    assert rec.bytes_by_link()[Link.NETWORK] == low.network_bytes


@pytest.mark.parametrize("rows", [8, 4])  # 8-row blocks in 8-row source shards: quantised at the sender
@pytest.mark.parametrize("part", [0, 1])
def test_block_fp8_on_the_engine(rows, part):
    devs = _devs()
    x = jax.device_put(
        jnp.sin(jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 16)) * 300,
        NamedSharding(Mesh(devs[: 32 // rows], ("f",)), P("f")),
    )
    quant = views.quantize_fp8(x, block=(8, 8))[part]
    dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    topo = Topology.uniform(range(8), domain_size=4)
    low, _, vs = _check(quant, dst, topo, options=Options(chunk_bytes=32, staging_bytes=256))
    assert all(t.at_sender for t in low.tasks) == (rows == 8)
    assert bool(vs.encode) == (rows == 8)


def _transposed_fused():
    devs = _devs()
    fsdp = NamedSharding(Mesh(devs[:4], ("f",)), P("f"))
    a = jax.device_put(jnp.arange(8 * 12, dtype=jnp.float32).reshape(8, 12), fsdp)
    b = jax.device_put(-jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4), fsdp)
    fused = views.transpose(views.concat([a, b, b], axis=1, groups=2))  # (20, 8): fused, GQA repeat, transposed
    dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P("tp", None))
    return fused, dst


def test_the_gpu_launch_of_a_views_pack_table_matches_numpy():
    """The GPU pack kernel's launch of a views schedule's rows (a transpose: byte rows whose strides do not
    decrease), replayed in numpy (not run on GPU), writes the same staging as the CPU pack."""
    import ctypes

    from jreshard.cuda import kernels as CK
    from jreshard.schedule import kernels as K

    fused, dst = _transposed_fused()
    topo = Topology.uniform(range(8), domain_size=4)
    low, _, _, vs = _run(fused, dst, topo, options=Options(chunk_bytes=64, staging_bytes=256))
    leaves = fused.leaves()
    src = {
        (i, s.device.id): np.ascontiguousarray(np.asarray(s.data)).reshape(-1).view(np.uint8)
        for i, leaf in enumerate(leaves)
        for s in leaf.source.addressable_shards
    }
    checked = 0
    for r, steps in vs.schedule.steps.items():
        bufs = [src.get((t // 2, r)) if t % 2 == 0 else None for t in range(2 * vs.schedule.ntensors)]
        for step in steps.values():
            if not len(step.pack) or any(bufs[int(b)] is None for b in step.pack[:, K.BUF]):
                continue
            assert not np.any(step.pack[:, K.CAST])
            n = int((step.pack[:, K.STAGE] + step.pack[:, K.NBYTES]).max())
            want, got = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
            K.pack_cpu(step.pack, bufs, want)
            ptrs = [0 if b is None else b.ctypes.data for b in bufs]
            for s, d, w in zip(*CK.unit_addresses(CK.pack_launch(step.pack, ptrs, got.ctypes.data)), strict=True):
                ctypes.memmove(int(d), int(s), int(w))
            np.testing.assert_array_equal(got, want)
            checked += 1
    assert checked > 0 and any(p.axes != tuple(range(len(p.axes))) for p in low.pieces)


def test_views_over_a_device_memory_transport_twin():
    """transfer_cluster over a transport that takes only its backend's (device) memory, as NCCL does: fused,
    repeated and transposed views move bit-exact in small chunks, at most 2 operations a group, uncast and
    cast to bfloat16 (the cast rows through the GPU cast kernel's launch tables and index math)."""
    import sys

    from mpi_launch import BODIES

    sys.path.insert(0, str(BODIES))
    from device_like import DeviceLikeBuffers, DeviceOnlyComm

    from jreshard.call.views import transfer_cluster

    fused, dst = _transposed_fused()
    topo = Topology.uniform(range(8), domain_size=4)
    options = Options(chunk_bytes=32, staging_bytes=128, max_group_ops=2)
    buffers = DeviceLikeBuffers()
    rec = RecordingComm(range(8), topo)
    out = transfer_cluster(
        fused, dst, topology=topo, options=options, transport=DeviceOnlyComm(rec, buffers), buffers=buffers
    )
    ref = views.transfer(fused, dst, topology=topo)
    for a, b in zip(out.addressable_shards, ref.addressable_shards, strict=True):
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    assert 0 < rec.most_ops_in_a_group() <= 2
    assert buffers.cast_launches == 0  # float32 all the way: byte rows only
    cast = views.astype(fused, jnp.bfloat16)
    buffers = DeviceLikeBuffers()
    rec = RecordingComm(range(8), topo)
    out = transfer_cluster(
        cast, dst, topology=topo, options=options, transport=DeviceOnlyComm(rec, buffers), buffers=buffers
    )
    ref = views.transfer(cast, dst, topology=topo)
    for a, b in zip(out.addressable_shards, ref.addressable_shards, strict=True):
        np.testing.assert_array_equal(np.asarray(a.data).view(np.uint16), np.asarray(b.data).view(np.uint16))
    assert 0 < rec.most_ops_in_a_group() <= 2 and buffers.cast_launches > 0


def _links_by_round(sched):
    """Per round, the links of every chunk sent in it (every rank's sends)."""
    out: dict[int, list[Link]] = {}
    for steps in sched.steps.values():
        for rnd, step in steps.items():
            out.setdefault(rnd, []).extend(w.link for w in step.sends)
    return out


def _fused_qkv():
    """The MPI benchmark's trainer-to-server case, small: float32 q, k, v (TP4 on devices 0-3) into one bfloat16
    qkv (TP2 x DP2 on devices 4-7, a domain of its own); returns (the view, its target sharding, the topology)."""
    devs = _devs()
    tp = NamedSharding(Mesh(devs[:4], ("tp",)), P(None, "tp"))
    q, k, v = (jax.device_put(jnp.arange(32 * n, dtype=jnp.float32).reshape(32, n) / 7, tp) for n in (32, 16, 16))
    qkv = views.astype(views.concat([q, k, v], axis=1, groups=2), jnp.bfloat16)
    dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    return qkv, dst, Topology.uniform(range(8), domain_size=4)


def test_the_fan_out_of_a_chunk_runs_beside_the_network_phase_of_the_next():
    """The trainer-to-server case of the MPI benchmark, small: float32 q, k, v (TP4) into one bfloat16 qkv
    (TP2 x DP2), each byte entering the server's domain once and forwarded to the other replica. A forwarded
    chunk waits only for the landed chunks it reads, so the fast-link rounds trail the network rounds by one
    (not by the whole message), and the forwards of one carrier keep pace with its arrivals. Values and bytes
    are checked on the engine too."""
    qkv, dst, topo = _fused_qkv()
    options = Options(chunk_bytes=128, staging_bytes=1 << 12)
    _, stats, vs = _check(qkv, dst, topo, bound=True, options=options)
    by_round = _links_by_round(vs.schedule)
    network = [r for r, links in by_round.items() if Link.NETWORK in links]
    fast = [r for r, links in by_round.items() if Link.FAST in links]
    assert len(network) >= 4 and stats.sent_bytes[Link.FAST] > 0
    assert min(fast) == min(network) + 1  # the first forward right after the first landing
    assert max(fast) == max(network) + 1  # and the last right after the last: no tail of forwards
    for steps in vs.schedule.steps.values():  # each carrier forwards as many chunks a round as it lands
        landed = [sum(w.link is Link.NETWORK for w in s.recvs) for _, s in sorted(steps.items())]
        forwarded = [sum(w.link is Link.FAST for w in s.sends) for _, s in sorted(steps.items())]
        if any(forwarded):
            assert max(forwarded) <= max(landed)


def test_a_fused_casts_forwards_leave_from_the_staging_they_landed_in():
    """Over a transport that posts ahead (two arenas a rank), the server's forwards of the fused bfloat16 qkv
    are sent from the staging the chunks landed in: no pack reads a destination shard. The posting double
    moves a group's bytes only when it is waited on, so a forward that read a reused arena would arrive wrong."""
    from jreshard.engine.rounds import compile_rounds

    qkv, dst, topo = _fused_qkv()
    options = Options(chunk_bytes=256, staging_bytes=1 << 13)
    for pipelined in (False, True):
        comm = PostingComm(ranks=topo.ranks, topology=topo)
        _, stats, vs = _check(qkv, dst, topo, bound=True, options=options, comm=comm, pipelined=pipelined)
        assert stats.sent_bytes[Link.FAST] > 0 and all(
            held == 2 * vs.schedule.staging[r] for r, held in stats.peak_staging_bytes.items() if r >= 4
        )
        compiled = compile_rounds(vs.schedule, tuple(range(8)), (2,) * 8, options.max_group_ops)
        assert not any((t[:, kernels.BUF] % 2 == 1).any() for packs, _, _, _ in compiled.rounds for t, _, _ in packs)


def test_over_a_transport_that_posts_ahead_a_casting_sender_cuts_its_messages_for_the_pipeline(monkeypatch):
    """With ``pipelined`` (the transport moves a posted round while the sender packs the next) a message whose
    sender casts, and the forwards of what it brought, get at least ``PIPELINE_CHUNKS`` chunks where they stay
    ``PIPELINE_MIN_CHUNK`` bytes or more, never more than ``chunk_bytes``; a message without casts keeps its
    chunks. The destination shards and the bytes stay exact. (The minimum is lowered so small arrays show it.)"""
    from jreshard.schedule import viewsched

    monkeypatch.setattr(viewsched, "PIPELINE_MIN_CHUNK", 64)
    devs = _devs()
    tp = NamedSharding(Mesh(devs[:4], ("tp",)), P(None, "tp"))
    q, k, v = (jax.device_put(jnp.arange(32 * n, dtype=jnp.float32).reshape(32, n) / 7, tp) for n in (32, 16, 16))
    dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    topo = Topology.uniform(range(8), domain_size=4)
    options = Options(chunk_bytes=1 << 12, staging_bytes=1 << 14)
    for cast, want in ((True, viewsched.PIPELINE_CHUNKS), (False, 1)):
        view = views.concat([q, k, v], axis=1, groups=2)
        view = views.astype(view, jnp.bfloat16) if cast else view
        counts = {}
        for pipelined in (False, True):
            low, outs, stats, vs = _run(view, dst, topo, options=options, pipelined=pipelined)
            ref = views.transfer(view, dst, topology=topo)
            for sh in ref.addressable_shards:
                np.testing.assert_array_equal(_bits(outs[sh.device.id]), _bits(sh.data))
            assert stats.sent_bytes[Link.NETWORK] == low.network_bytes and stats.sent_bytes[Link.FAST] == low.fast_bytes
            sends = [w for steps in vs.schedule.steps.values() for st in steps.values() for w in st.sends]
            assert max(w.nbytes for w in sends) <= options.chunk_bytes
            counts[pipelined] = collections.Counter(  # chunks per (sender, receiver, stage)
                (rank, w.peer, w.tag >> 16)
                for rank, steps in vs.schedule.steps.items()
                for st in steps.values()
                for w in st.sends
            )
        assert min(counts[False].values()) == 1  # one chunk a message in 4 KiB chunks
        assert min(counts[True].values()) == want  # the casting senders' messages and their forwards: 4
