"""Backend xla in one process on 8 CPU devices: parity with jax.device_put bit for bit, donation, byte counts."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from xla_parity_cases import DTYPES, LANE_DTYPES, PAIRS, host_value, same_bits, same_values

import jreshard
from jreshard.errors import LayoutError
from jreshard.options import Backend
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Topology
from jreshard.xla.lanes import check_dtype
from jreshard.xla.perms import padding_bytes
from jreshard.xla.run import compiled_for
from jreshard.xla.xlaplan import stage_permutations, xla_plan

XLA = jreshard.Options(backend="xla")
DEVS = jax.devices()


def _check_parity(pair, dtypes):
    src, dst = pair.src(DEVS), pair.dst(DEVS)
    with jax.enable_x64(True):
        host = {dt: host_value(pair.shape, dt, seed=i) for i, dt in enumerate(dtypes)}
        x = {dt: jax.device_put(v, src) for dt, v in host.items()}
        out, rep = jreshard.transfer(x, dst, options=XLA, report=True)
        assert rep.backend is Backend.XLA
        for dt in dtypes:
            ref = jax.device_put(x[dt], dst)
            got = out[dt]
            assert got.dtype == ref.dtype and got.shape == ref.shape, dt
            assert got.sharding == dst, dt
            assert got.sharding.is_equivalent_to(ref.sharding, len(pair.shape)), dt
            by_dev = {s.device: s for s in ref.addressable_shards}
            assert set(by_dev) == {s.device for s in got.addressable_shards}, dt
            for s in got.addressable_shards:
                assert s.index == by_dev[s.device].index, dt
                assert same_values(s.data, by_dev[s.device].data), (dt, s.device)
                assert same_bits(s.data, host[dt][s.index]), (dt, s.device)  # bit for bit, NaN payloads too
            assert not x[dt].is_deleted()


@pytest.mark.parametrize("pair", PAIRS, ids=[p.name for p in PAIRS])
def test_parity_with_device_put_over_sharding_kinds(pair):
    _check_parity(pair, LANE_DTYPES)


@pytest.mark.parametrize("pair", [PAIRS[1], PAIRS[9]], ids=[PAIRS[1].name, PAIRS[9].name])
def test_parity_with_device_put_every_dtype(pair):
    _check_parity(pair, DTYPES)


def test_transfer_into_donates_the_destination():
    a = NamedSharding(Mesh(np.array(DEVS[:4]), ("x",)), P("x"))
    b = NamedSharding(Mesh(np.array(DEVS[2:6]).reshape(2, 2), ("d", "t")), P(None, "t"))
    src = jax.device_put(jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48), a)
    dst = jax.device_put(jnp.zeros((64, 48), jnp.float32), b)
    ptrs = {s.device: s.data.unsafe_buffer_pointer() for s in dst.addressable_shards}
    out, rep = jreshard.transfer_into(src, dst, options=XLA, report=True)
    assert dst.is_deleted() and not src.is_deleted()
    assert {s.device: s.data.unsafe_buffer_pointer() for s in out.addressable_shards} == ptrs
    assert np.array_equal(out, src) and out.sharding == b
    assert rep.fresh_bytes == 0 and rep.not_in_place_bytes == 0
    # No second copy of the destination: every live buffer of a destination shard's size on a destination
    # device is one of the result's own buffers (the memory ``dst`` had).
    shard_bytes = 64 * 24 * 4
    for x in jax.live_arrays():
        if x.is_deleted() or x is src:
            continue
        for s in x.addressable_shards:
            if s.device in ptrs and s.data.nbytes == shard_bytes:
                assert s.data.unsafe_buffer_pointer() == ptrs[s.device], (x.shape, x.sharding)


def test_transfer_into_an_into_shared_with_a_source_gets_fresh_buffers():
    a = NamedSharding(Mesh(np.array(DEVS[:4]), ("x",)), P("x"))
    src = jax.device_put(jnp.arange(16.0).reshape(4, 4), a)
    out, rep = jreshard.transfer_into({"a": src, "b": src}, {"a": src, "b": None}, options=XLA, report=True)
    assert not src.is_deleted() and np.array_equal(out["a"], src) and out["b"] is src
    assert rep.not_in_place_bytes == src.nbytes


def test_network_bytes_equal_the_plans_and_the_hlo_collectives():
    devs = np.array(DEVS)
    a = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
    b = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P("dp"))  # replicas 4, 5 share a domain
    topo = Topology.uniform(range(8), 2)  # four domains: landings cross the network, fan-outs stay inside
    x = jax.device_put(jnp.arange(48 * 40, dtype=jnp.bfloat16).reshape(48, 40), a)
    out, rep = jreshard.transfer(x, b, topology=topo, options=XLA, report=True)
    assert np.array_equal(out, x)
    src, dst = Layout.from_sharding(a, x.shape, x.dtype), Layout.from_sharding(b, x.shape, x.dtype)
    stats = plan_layouts([(src, dst)], topo, XLA).stats()
    assert stats.network_bytes > 0 and stats.fast_bytes > 0
    compiled, _ = compiled_for([(src, dst)], topo, XLA)
    ps = compiled.plan.stats
    assert (ps.network_bytes, ps.fast_bytes, ps.same_device_bytes) == (
        stats.network_bytes,
        stats.fast_bytes,
        stats.same_device_bytes,
    )
    assert (rep.network_bytes, rep.fast_bytes) == (stats.network_bytes, stats.fast_bytes)
    assert rep.padding_bytes == ps.padding_bytes
    # The lowered computation's collective_permutes move exactly the payload plus the padding.
    permutes = re.findall(
        r"collective_permute.*?source_target_pairs = dense<(\[\[.*?\]\]|\[.*?\])>.*?tensor<(\d+)xui(8|16|32|64)>",
        compiled.hlo,
    )
    assert len(permutes) == ps.permutations
    cut = stage_permutations(plan_layouts([(src, dst)], topo, XLA))  # what the padding benchmark counts
    assert sum(len(p) for p, _ in cut.values()) == ps.permutations
    assert sum(padding_bytes(p) for p, _ in cut.values()) == ps.padding_bytes
    moved = sum(len(re.findall(r"\[\d+, \d+\]", pairs)) * int(n) * int(bits) // 8 for pairs, n, bits in permutes)
    assert moved == ps.wire_bytes == stats.network_bytes + stats.fast_bytes + ps.padding_bytes


def test_computations_are_cached_and_compile_time_is_reported():
    a = NamedSharding(Mesh(np.array(DEVS[:2]), ("x",)), P("x"))
    b = NamedSharding(Mesh(np.array(DEVS[2:4]), ("x",)), P(None, "x"))
    x = jax.device_put(jnp.ones((6, 4), jnp.int8), a)
    jreshard.clear_caches()
    _, first = jreshard.transfer(x, b, options=XLA, report=True)
    _, again = jreshard.transfer(x, b, options=XLA, report=True)
    assert first.compile_s > 0 and again.compile_s == 0


def test_padding_is_bounded_and_counted():
    # Uneven messages: one destination needs more from one source than the others.
    lay = Layout.from_sharding(NamedSharding(Mesh(np.array(DEVS[:3]), ("x",)), P("x")), (12, 8), jnp.float32)
    to = Layout.from_sharding(NamedSharding(Mesh(np.array(DEVS[3:7]), ("y",)), P("y")), (12, 8), jnp.float32)
    st = xla_plan(plan_layouts([(lay, to)], Topology.uniform(range(8), 1), XLA)).stats
    assert st.padding_bytes <= 0.0527 * (st.network_bytes + st.fast_bytes)


def test_a_typed_prng_key_moves_as_its_key_data():
    """The front door repacks key arrays (jreshard.call.repack) before the computation sees them: bit for bit."""
    a = NamedSharding(Mesh(np.array(DEVS[:2]), ("x",)), P("x"))
    b = NamedSharding(Mesh(np.array(DEVS[2:4]), ("x",)), P("x"))
    keys = jax.device_put(jax.random.split(jax.random.key(0, impl="rbg"), 4), a)
    out, rep = jreshard.transfer(keys, b, options=XLA, report=True)
    assert rep.backend is jreshard.Backend.XLA and out.dtype == keys.dtype and out.sharding == b
    np.testing.assert_array_equal(jax.random.key_data(out), jax.random.key_data(keys))
    with pytest.raises(LayoutError, match="extended dtype"):  # the computation itself refuses them
        check_dtype(keys.dtype, "keys")


def test_auto_keeps_the_direct_copies_in_one_process_and_says_why():
    a = NamedSharding(Mesh(np.array(DEVS[:2]), ("x",)), P("x"))
    b = NamedSharding(Mesh(np.array(DEVS[2:4]), ("x",)), P("x"))
    _, rep = jreshard.transfer(jax.device_put(jnp.ones(4), a), b, report=True)
    assert rep.backend is Backend.LOCAL and "xla" in rep.backend_reason


def test_kept_leaves_zero_size_leaves_and_a_pytree_of_several_layouts():
    a = NamedSharding(Mesh(np.array(DEVS[:4]), ("x",)), P("x"))
    b = NamedSharding(Mesh(np.array(DEVS[4:]), ("y",)), P(None, "y"))
    x = {
        "same": jax.device_put(jnp.ones((4, 4)), a),
        "none": jax.device_put(jnp.ones((4, 4)), a),
        "empty": jax.device_put(jnp.zeros((0, 8), jnp.int8), a),
        "moved": jax.device_put(jnp.arange(32, dtype=jnp.int32).reshape(4, 8), a),
    }
    out = jreshard.transfer(x, {"same": a, "none": None, "empty": b, "moved": b}, options=XLA)
    assert out["same"] is x["same"] and out["none"] is x["none"]
    assert out["empty"].shape == (0, 8) and out["empty"].sharding == b
    assert np.array_equal(out["moved"], x["moved"]) and out["moved"].sharding == b
