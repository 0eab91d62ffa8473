"""Views: casts bit-exact with jnp.astype, block FP8 against the numpy reference, bytes counted in the wire
dtype, transfer_into in place, no host materialisation, and the errors."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.array import ArrayImpl
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard import Layout, Topology, views
from jreshard.errors import LayoutError, LayoutMismatchError
from jreshard.report import NotInPlace
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.views.casts import CAST_DTYPES, cast, cast_into, wire_cut
from jreshard.views.lowering import lower_tree

DEVS = np.array(jax.devices())
FSDP4 = NamedSharding(Mesh(DEVS[:4], ("fsdp",)), P("fsdp"))
TP2DP2 = Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp"))


def _bits(a):
    a = np.asarray(a)
    return a.view(f"uint{8 * a.dtype.itemsize}")


def _samples(dtype, rng):
    dt = numpy_dtype(dtype)
    if dt.itemsize <= 2:  # every bit pattern
        return np.arange(2 ** (8 * dt.itemsize), dtype=f"uint{8 * dt.itemsize}").view(dt)
    special = [0, -0.0, 1e-45, 1e-40, -1e-40, 3e38, np.inf, -np.inf, np.nan, 448, 464, 57344, 65520, 127.5, -128.5]
    bits = rng.integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([bits, np.array(special, np.float32)])


@pytest.mark.parametrize("src,dst", list(itertools.product(CAST_DTYPES, CAST_DTYPES)))
def test_cast_is_bit_exact_with_jnp_astype(src, dst):
    x = _samples(src, np.random.default_rng(0))
    want = _bits(jnp.asarray(x).astype(dst))
    np.testing.assert_array_equal(_bits(cast(x, dst)), want)
    out = np.empty(x.shape, numpy_dtype(dst))
    cast_into(out, x, (dst,))  # the one-pass cast of the executor
    np.testing.assert_array_equal(_bits(out), want)


def _sharded(shape, dtype, sharding, seed=0):
    x = (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float32)
    return jax.device_put(jnp.asarray(x).astype(dtype), sharding)


def _assert_shards_equal(out, ref):
    assert out.sharding == ref.sharding and out.dtype == ref.dtype
    got = {s.device: _bits(s.data) for s in out.addressable_shards}
    for s in ref.addressable_shards:
        np.testing.assert_array_equal(got[s.device], _bits(s.data))


def test_fused_qkv_with_gqa_repeats_cast_to_bfloat16_counts_wire_bytes():
    # 4 query heads and 1 key/value head of 4, TP2: rank r holds [q heads of r, k, v] (k, v on both ranks).
    q, k, v = (_sharded((8, s), jnp.float32, FSDP4, i) for i, s in enumerate((16, 4, 4)))
    kk, vv = views.concat([k, k], axis=1), views.concat([v, v], axis=1)
    fused = views.astype(views.concat([q, kk, vv], axis=1, groups=2), jnp.bfloat16)
    dst = NamedSharding(TP2DP2, P(None, "tp"))
    out = views.transfer(fused, dst)
    ref = jnp.concatenate(
        [jnp.split(x, 2, axis=1)[g] for g in range(2) for x in (q, jnp.tile(k, 2), jnp.tile(v, 2))], axis=1
    ).astype(jnp.bfloat16)
    _assert_shards_equal(out, jax.device_put(ref, dst))
    # Trainer on devices 0-3 (one domain), inference on 4-7 (another): every float32 element of q, k, v
    # enters the inference domain once, cast at the sender, in bfloat16.
    topo = Topology.uniform(range(8), domain_size=4)
    leaves = fused.leaves()
    lays = [Layout.from_sharding(leaf.source.sharding, leaf.shape, leaf.dtype) for leaf in leaves]
    assert len(leaves) == 3  # k and v are each one source, though used twice
    (low,) = lower_tree([fused], leaves, lays, [Layout.from_sharding(dst, (8, 32), "bfloat16")], topo)
    assert low.network_bytes == 8 * (16 + 4 + 4) * 2
    assert {p.wire_dtype for p in low.pieces} == {"bfloat16"}
    assert low.fast_bytes > 0  # the other dp replica gets its half over the fast links


def test_widening_cast_happens_at_the_receiver():
    assert wire_cut("bfloat16", ("float32",)) == 0 and wire_cut("float32", ("bfloat16",)) == 1
    x = _sharded((8, 8), jnp.bfloat16, FSDP4)
    w = views.astype(x, jnp.float32)
    dst = NamedSharding(TP2DP2, P("tp"))
    lay = Layout.from_sharding(x.sharding, x.shape, x.dtype)
    (low,) = lower_tree(
        [w],
        [w.leaves()[0]],
        [lay],
        [Layout.from_sharding(dst, (8, 8), "float32")],
        Topology.uniform(range(8), domain_size=4),
    )
    assert low.network_bytes == 64 * 2 and all(p.receiver_casts == ("float32",) for p in low.pieces)
    _assert_shards_equal(views.transfer(w, dst), jax.device_put(x.astype(jnp.float32), dst))


def test_shape_dtype_struct_target_casts():
    x = _sharded((8, 8), jnp.float32, FSDP4)
    dst = NamedSharding(TP2DP2, P(None, "tp"))
    out = views.transfer({"a": x}, {"a": jax.ShapeDtypeStruct((8, 8), jnp.float16, sharding=dst)})["a"]
    _assert_shards_equal(out, jax.device_put(x.astype(jnp.float16), dst))


@pytest.mark.parametrize("src_spec,dst_spec", [(P("fsdp"), P(None, "tp")), (P(None, "fsdp"), P("tp", None))])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_fp8_matches_the_numpy_reference(src_spec, dst_spec, dtype):
    # Blocks of (4, 6) over a (2, 12, 20) stack: blocks straddle shards, the last column of blocks is partial.
    x = _sharded((2, 12, 20), dtype, NamedSharding(Mesh(DEVS[:4], ("fsdp",)), P(None, *src_spec)))
    w, s = views.quantize_fp8(x, block=(4, 7))
    dst = NamedSharding(TP2DP2, P(None, *dst_spec))
    out = views.transfer({"w": w, "s": s}, {"w": dst, "s": NamedSharding(TP2DP2, P())})
    ref_w, ref_s = views.quantize_fp8_reference(np.asarray(x), (4, 7))
    assert out["w"].dtype == jnp.float8_e4m3fn and out["s"].shape == (2, 3, 3)
    _assert_shards_equal(out["w"], jax.device_put(ref_w, dst))
    _assert_shards_equal(out["s"], jax.device_put(ref_s, NamedSharding(TP2DP2, P())))
    deq = ref_w.astype(np.float32) * np.repeat(np.repeat(ref_s, 4, 1), 7, 2)[:, :12, :20]
    np.testing.assert_allclose(deq, np.asarray(x.astype(jnp.float32)), rtol=0.07, atol=1e-6)


def test_views_never_take_the_host_value_of_a_source(monkeypatch):
    q, k = _sharded((8, 8), jnp.float32, FSDP4, 1), _sharded((8, 8), jnp.float32, FSDP4, 2)
    dst = NamedSharding(TP2DP2, P(None, "tp"))
    into = jax.device_put(jnp.zeros((8, 16), jnp.bfloat16), dst)
    fused = views.astype(views.concat([q, views.transpose(k)], axis=1, groups=2), jnp.bfloat16)
    w, _ = views.quantize_fp8(q, block=(4, 4))

    def forbidden(self, *args, **kwargs):
        raise AssertionError("the host value of a jax.Array was taken during a transfer")

    monkeypatch.setattr(ArrayImpl, "__array__", forbidden)
    monkeypatch.setattr(ArrayImpl, "_value", property(forbidden))
    monkeypatch.setattr(ArrayImpl, "tolist", forbidden)
    out = views.transfer({"f": fused, "w": w}, {"f": dst, "w": dst})
    out2 = views.transfer_into(fused, into)
    monkeypatch.undo()
    ref = jnp.concatenate([jnp.split(x, 2, axis=1)[g] for g in range(2) for x in (q, k.T)], axis=1)
    _assert_shards_equal(out["f"], jax.device_put(ref.astype(jnp.bfloat16), dst))
    _assert_shards_equal(out2, jax.device_put(ref.astype(jnp.bfloat16), dst))


def test_transfer_into_writes_in_place():
    x = _sharded((4, 8, 8), jnp.float32, NamedSharding(Mesh(DEVS[:4], ("e",)), P("e")))
    dst = NamedSharding(TP2DP2, P(None, "tp"))
    into = jax.device_put(jnp.zeros((8, 8), jnp.bfloat16), dst)
    ptrs = [s.data.unsafe_buffer_pointer() for s in into.addressable_shards]
    out = views.transfer_into(views.astype(views.unstack(x)[2], jnp.bfloat16), into)
    _assert_shards_equal(out, jax.device_put(x[2].astype(jnp.bfloat16), dst))
    assert [s.data.unsafe_buffer_pointer() for s in out.addressable_shards] == ptrs


def test_transfer_into_never_writes_memory_another_array_can_see():
    # The ownership rule of transfer_into holds for views: an into leaf that is a source, or whose
    # buffers another live array shares, is left as it is and the result gets fresh memory.
    x = _sharded((8, 8), jnp.float32, FSDP4)
    x_bits = np.asarray(x).copy()
    out, rep = jreshard.transfer_into(views.astype(x, jnp.float32), x, report=True)
    np.testing.assert_array_equal(np.asarray(x), x_bits)
    np.testing.assert_array_equal(np.asarray(out), x_bits)
    assert not x.is_deleted() and rep.not_in_place_bytes == x.nbytes
    into = jax.device_put(jnp.ones((8, 8), jnp.bfloat16), NamedSharding(TP2DP2, P(None, "tp")))
    third = jax.make_array_from_single_device_arrays(
        into.shape, into.sharding, [s.data for s in into.addressable_shards]
    )  # a second array over into's buffers, as a caller may hold
    out2 = jreshard.transfer_into(views.astype(x, jnp.bfloat16), into)
    # as with jax.jit(donate_argnums): an array over donated memory is deleted, never changed under the caller
    assert third.is_deleted() or (np.asarray(third, np.float32) == 1).all()
    _assert_shards_equal(out2, jax.device_put(x.astype(jnp.bfloat16), into.sharding))
    both = jreshard.transfer_into({"a": views.as_view(x), "b": views.as_view(x)}, {"a": out, "b": out})
    np.testing.assert_array_equal(np.asarray(both["a"]), x_bits)
    np.testing.assert_array_equal(np.asarray(both["b"]), x_bits)


def test_views_report_counts_the_lowerings_bytes():
    x = _sharded((4, 16, 24), jnp.float32, NamedSharding(Mesh(DEVS[:4], ("e",)), P("e")))
    fused = views.astype(views.concat([x[0], x[1]], axis=1, groups=2), jnp.bfloat16)
    dst = NamedSharding(TP2DP2, P(None, "tp"))
    topo = Topology.uniform(range(8), domain_size=4)
    out, rep = jreshard.transfer(fused, dst, topology=topo, report=True)
    leaves = fused.leaves()
    layouts = [Layout.from_sharding(leaf.source.sharding, leaf.shape, leaf.dtype) for leaf in leaves]
    (low,) = lower_tree([fused], leaves, layouts, [Layout.from_sharding(dst, fused.shape, fused.dtype)], topo)
    assert (rep.network_bytes, rep.fast_bytes, rep.same_device_bytes) == (
        low.network_bytes,
        low.fast_bytes,
        low.same_device_bytes,
    )
    assert rep.network_bytes > 0 and rep.copy_s > 0 and rep.not_in_place_bytes == 0
    # out's memory came from jreshard's pool, which jax cannot take over: the first transfer_into writes
    # fresh memory (its shard addresses change) and says so; the next one, over jax's memory, is in place.
    ptrs = [s.data.unsafe_buffer_pointer() for s in out.addressable_shards]
    again, rep2 = jreshard.transfer_into(fused, out, topology=topo, report=True)
    assert rep2.moved_bytes == rep.moved_bytes and out.is_deleted()
    assert [s.data.unsafe_buffer_pointer() for s in again.addressable_shards] != ptrs
    held = sum(s.data.nbytes for s in again.addressable_shards)  # (replicas included)
    assert rep2.not_in_place == ((0, NotInPlace.NOT_HANDED_OVER),) and rep2.not_in_place_bytes == held
    ptrs = [s.data.unsafe_buffer_pointer() for s in again.addressable_shards]
    third, rep3 = jreshard.transfer_into(fused, again, topology=topo, report=True)
    assert [s.data.unsafe_buffer_pointer() for s in third.addressable_shards] == ptrs
    assert rep3.not_in_place == () and rep3.not_in_place_bytes == 0
    ref = jnp.concatenate([x[0][:, :12], x[1][:, :12], x[0][:, 12:], x[1][:, 12:]], axis=1)
    _assert_shards_equal(third, jax.device_put(ref.astype(jnp.bfloat16), dst))


def test_errors_name_the_argument():
    x = _sharded((8, 8), jnp.float32, FSDP4)
    y = _sharded((8, 4), jnp.bfloat16, FSDP4)
    with pytest.raises(TypeError, match="dtype int32 is not one views cast"):
        views.astype(x, jnp.int32)
    with pytest.raises(TypeError, match="dtypes"):
        views.concat([x, y], axis=1)
    with pytest.raises(ValueError, match="groups=3"):
        views.concat([x, x], axis=1, groups=3)
    with pytest.raises(ValueError, match="differ outside axis 1"):
        views.concat([x, views.transpose(views.astype(y, jnp.float32))], axis=1)
    with pytest.raises(ValueError, match="perm"):
        views.transpose(x, (0, 0))
    with pytest.raises(IndexError, match="unit-step"):
        views.as_view(x)[::2]
    with pytest.raises(LayoutMismatchError, match="shape"):
        views.transfer(x, jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=FSDP4))
    w, _ = views.quantize_fp8(x)
    with pytest.raises(TypeError, match="destination leaves"):
        views.transfer(views.transpose(w), FSDP4)


def test_piece_byte_geometry_is_a_strided_copy():
    # The lead's batched executor reads pieces as (shape, byte offset and strides) pairs: replay them with
    # as_strided on the raw bytes and compare with the numpy executor's result.
    from numpy.lib.stride_tricks import as_strided

    a = _sharded((4, 6, 8), jnp.float32, NamedSharding(Mesh(DEVS[:4], ("x",)), P(None, None, "x")))
    b = _sharded((8, 6), jnp.float32, FSDP4, 1)
    view = views.concat([views.transpose(a[1], (1, 0)), b], axis=1, groups=2)  # (8, 12)
    dst = NamedSharding(TP2DP2, P("tp", "dp"))
    out = views.transfer(view, dst)
    leaves = view.leaves()
    lays = [Layout.from_sharding(lf.source.sharding, lf.shape, lf.dtype) for lf in leaves]
    dlay = Layout.from_sharding(dst, (8, 12), "float32")
    (low,) = lower_tree([view], leaves, lays, [dlay], Topology.uniform(range(8), domain_size=4))
    assert any(p.axes != tuple(range(len(p.axes))) for p in low.pieces)  # some pieces are transposed
    got = {r: np.zeros(dlay.box_of(r).shape, np.float32) for r in dlay.ranks}
    for p in low.pieces:
        shard = {s.device.id: np.asarray(s.data) for s in leaves[p.leaf].source.addressable_shards}[p.src_rank]
        shape, s_off, s_str, d_off, d_str = p.byte_geometry(lays[p.leaf].box_of(p.src_rank), got[p.dst_rank].shape)
        src = as_strided(shard.reshape(-1).view(np.uint8)[s_off:], (*shape, 4), (*s_str, 1))
        dst_bytes = as_strided(got[p.dst_rank].reshape(-1).view(np.uint8)[d_off:], (*shape, 4), (*d_str, 1))
        dst_bytes[...] = src
    for s in out.addressable_shards:
        np.testing.assert_array_equal(got[s.device.id], np.asarray(s.data))


def test_threaded_copies_match(monkeypatch):
    # Large transfers copy destination shards on a thread pool: the same bits.
    from jreshard.engine import viewcopy

    monkeypatch.setattr(viewcopy, "_THREADED_BYTES", 0)
    x = _sharded((4, 16, 24), jnp.float32, NamedSharding(Mesh(DEVS[:4], ("e",)), P("e")))
    w, s = views.quantize_fp8(x, block=(8, 8))
    fused = views.astype(views.concat([x[0], x[1]], axis=1, groups=2), jnp.bfloat16)
    dst = NamedSharding(TP2DP2, P(None, "tp"))
    out = views.transfer({"f": fused, "w": w, "s": s}, {"f": dst, "w": NamedSharding(TP2DP2, P("dp")), "s": dst})
    ref_f = jnp.concatenate([jnp.split(y, 2, axis=1)[g] for g in range(2) for y in (x[0], x[1])], axis=1)
    _assert_shards_equal(out["f"], jax.device_put(ref_f.astype(jnp.bfloat16), dst))
    ref_w, ref_s = views.quantize_fp8_reference(np.asarray(x), (8, 8))
    _assert_shards_equal(out["w"], jax.device_put(ref_w, NamedSharding(TP2DP2, P("dp"))))
    _assert_shards_equal(out["s"], jax.device_put(ref_s, dst))


def test_deleted_source_is_refused_before_any_byte_moves():
    x = _sharded((8, 8), jnp.float32, FSDP4)
    v = views.astype(x, jnp.bfloat16)
    x.delete()
    with pytest.raises(LayoutError, match="deleted"):
        views.transfer(v, NamedSharding(TP2DP2, P()))


def test_scalars_from_integer_indices():
    x = _sharded((8,), jnp.float32, FSDP4)
    dst = NamedSharding(TP2DP2, P())
    out = views.transfer(
        {"s": views.astype(views.as_view(x)[5], jnp.bfloat16), "t": views.stack([x[1], x[6]])},
        {"s": dst, "t": NamedSharding(TP2DP2, P("tp"))},
    )
    _assert_shards_equal(out["s"], jax.device_put(x[5].astype(jnp.bfloat16), dst))
    _assert_shards_equal(out["t"], jax.device_put(jnp.stack([x[1], x[6]]), NamedSharding(TP2DP2, P("tp"))))


def test_views_on_another_platform_are_refused_by_name():
    from jreshard.call.views import _check_cpu
    from jreshard.errors import BackendUnavailableError

    class Device:
        platform = "gpu"

    class Sharding:
        device_set = frozenset({Device()})

    _check_cpu([("source leaf 0", FSDP4)], "transfer")  # CPU devices pass
    with pytest.raises(BackendUnavailableError, match="target leaf 3 is on gpu devices"):
        _check_cpu([("target leaf 3", Sharding())], "transfer")


def test_copy_threads_option_bounds_the_threads(monkeypatch):
    import threading

    from jreshard.engine import viewcopy

    seen = []
    real = viewcopy.run_task

    def recording(task, src, dst):
        seen.append(threading.current_thread())
        real(task, src, dst)

    monkeypatch.setattr(viewcopy, "run_task", recording)
    monkeypatch.setattr(viewcopy, "_THREADED_BYTES", 0)
    x = _sharded((4, 16, 24), jnp.float32, NamedSharding(Mesh(DEVS[:4], ("e",)), P("e")))
    fused = views.astype(views.concat([x[0], x[1], x[2]], axis=1, groups=2), jnp.bfloat16)
    dst = NamedSharding(TP2DP2, P(None, "tp"))
    ref = jreshard.transfer(fused, dst, options=jreshard.Options(copy_threads=1))
    assert len(seen) > 1 and set(seen) == {threading.current_thread()}
    seen.clear()
    out = jreshard.transfer(fused, dst, options=jreshard.Options(copy_threads=2))
    _assert_shards_equal(out, ref)
    # at most two threads: the calling thread (which takes the first task) and one pool thread
    assert threading.current_thread() in seen and len(set(seen)) <= 2


def test_the_lowerings_box_index_finds_every_landed_box_a_query_meets_in_order():
    """``_Landed.meeting`` (numpy bounds past a few entries) against a scan of every entry, on random boxes."""
    from jreshard.sharding.box import Box
    from jreshard.views.lowering import _SCAN, _Landed, intersect

    rng = np.random.default_rng(7)
    for ndim in (1, 2, 3):
        landed = _Landed(ndim)
        for n in range(3 * _SCAN):
            lo = rng.integers(0, 12, ndim)
            landed.add(Box(tuple(lo.tolist()), tuple((lo + rng.integers(1, 5, ndim)).tolist())), n, False)
            q_lo = rng.integers(0, 12, ndim)
            q = Box(tuple(q_lo.tolist()), tuple((q_lo + rng.integers(1, 6, ndim)).tolist()))
            got = landed.meeting(q)
            want = [e for e in landed.entries if intersect(e[0], q) is not None]
            assert [e for e in got if intersect(e[0], q) is not None] == want  # none lost, in landing order
            overlaps = [
                e
                for e in landed.entries
                if all(a < d and c < b for a, b, c, d in zip(e[0].lo, e[0].hi, q.lo, q.hi, strict=True))
            ]
            assert got == (landed.entries if len(landed.entries) <= _SCAN else overlaps)  # past a few: only overlaps


def test_view_sizes_take_numpys_integers_and_refuse_bools_and_floats():
    q = k = jnp.zeros((8, 8), jnp.float32)
    assert views.concat([q, k], axis=1, groups=np.int64(2)).groups == 2
    assert views.quantize_fp8(q, block=(np.int64(4), 4))[0].block == (4, 4)
    for bad in (True, 2.0, "2"):
        with pytest.raises(ValueError, match=r"concat: groups=.* must be a positive integer"):
            views.concat([q, k], axis=1, groups=bad)
        with pytest.raises(ValueError, match=r"quantize_fp8: block=.* must be two positive integers"):
            views.quantize_fp8(q, block=(bad, 4))


def test_axes_and_extents_are_integers_never_rounded_as_jax_numpy_refuses_floats():
    x = jnp.zeros((8, 8), jnp.float32)
    assert views.reshape(x, (np.int64(4), 16)).shape == (4, 16)
    assert views.transpose(x, (np.int32(1), 0)).shape == (8, 8)
    assert views.concat([x, x], axis=np.int64(1)).shape == (8, 16)
    assert views.stack([x, x], axis=np.int64(0)).shape == (2, 8, 8)
    with pytest.raises(TypeError, match=r"reshape: shape=\(4\.5, 16\): expected integers"):
        views.reshape(x, (4.5, 16))  # 4.5 * 16 is 72, but int(4.5) * 16 would have passed as 64
    with pytest.raises(TypeError, match=r"transpose: perm=\(1\.5, 0\.2\): expected integers"):
        views.transpose(x, (1.5, 0.2))
    for bad in (1.0, "1"):
        with pytest.raises(TypeError, match=rf"concat: axis={re.escape(repr(bad))}: expected an integer"):
            views.concat([x, x], axis=bad)
        with pytest.raises(TypeError, match=rf"stack: axis={re.escape(repr(bad))}: expected an integer"):
            views.stack([x, x], axis=bad)
    with pytest.raises(TypeError, match=r"reshape: shape=\(4\.0, 16\): expected integers"):  # as jnp.reshape
        views.reshape(x, (4.0, 16))
    # What jax.numpy takes as an integer, a view takes too (a bool: jnp.reshape(x, (True, 64)) is (1, 64)).
    assert views.reshape(x, (True, 64)).shape == jnp.reshape(x, (True, 64)).shape == (1, 64)
    assert views.concat([x, x], axis=True).shape == jnp.concatenate([x, x], axis=True).shape


def test_an_index_of_numpys_integers_reads_as_jax_numpys():
    x = jnp.arange(64.0).reshape(8, 8)
    dst = NamedSharding(TP2DP2, P())
    for index in ((np.int64(2),), (slice(None), np.int32(-1)), (np.uint8(3), slice(np.int64(1), np.int64(5)))):
        got = views.transfer(views.as_view(x)[index], dst)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(x[index]))
    with pytest.raises(IndexError, match=r"views take ints, unit-step slices and \.\.\., not True"):
        views.as_view(x)[True]  # a mask to jax.numpy, not an integer
