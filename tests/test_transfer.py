"""jreshard.transfer / transfer_into in one process on 8 CPU devices, against jax.device_put."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax._src.array import ArrayImpl
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard import api
from jreshard.api import _plain_route
from jreshard.engine import pool
from jreshard.engine.recording import RecordingComm
from jreshard.errors import BackendUnavailableError, IndivisibleError, LayoutError, LayoutMismatchError, TopologyError
from jreshard.schedule.pairsched import MAIL_TAG
from jreshard.sharding.topology import Link, Topology

DEVS = np.array(jax.devices())
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.int32, jnp.bool_, jnp.uint8]


def _shards_equal(a: jax.Array, b: jax.Array) -> None:
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    sa = {s.device: s for s in a.addressable_shards}
    for s in b.addressable_shards:
        x = sa[s.device]
        assert x.index == s.index
        np.testing.assert_array_equal(np.asarray(x.data), np.asarray(s.data))


@st.composite
def sharding_on(draw, devices: list, ndim: int):
    n = len(devices)
    a = draw(st.sampled_from([d for d in (1, 2, 4, 8) if n % d == 0]))
    mesh = Mesh(np.array(devices).reshape(a, n // a), ("a", "b"))
    free, spec = ["a", "b"], []
    for _ in range(ndim):
        k = draw(st.integers(0, len(free)))
        pick = tuple(draw(st.permutations(free))[:k])
        free = [x for x in free if x not in pick]
        spec.append(pick if len(pick) != 1 else pick[0])
    return NamedSharding(mesh, P(*spec))


def _divisor(sh: NamedSharding, d: int) -> int:
    e = sh.spec[d] if d < len(sh.spec) else None
    axes = () if e is None else (e,) if isinstance(e, str) else e
    return int(np.prod([sh.mesh.shape[x] for x in axes]))


@st.composite
def sharding_pair(draw):
    perm = list(draw(st.permutations(list(DEVS))))
    n_src, n_dst = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    mode = draw(st.sampled_from(["disjoint", "same", "overlap"]))
    first = {"disjoint": 8 - n_dst, "same": 0, "overlap": 2}[mode] if n_dst < 8 else 0
    ndim = draw(st.integers(0, 3))
    s = draw(sharding_on(perm[:n_src], ndim))
    d = draw(sharding_on(perm[first : first + n_dst], ndim))
    shape = tuple(int(np.lcm(_divisor(s, k), _divisor(d, k))) * draw(st.integers(0, 3)) for k in range(ndim))
    dtype = draw(st.sampled_from(DTYPES))
    return s, d, shape, dtype


def _make(shape, dtype, sharding, seed=0):
    rng = np.random.default_rng(seed)
    host = rng.integers(0, 120, size=shape).astype(np.dtype(dtype))
    return jax.device_put(host, sharding)


@given(sharding_pair(), st.integers(0, 1000))
def test_transfer_equals_device_put(case, seed):
    s, d, shape, dtype = case
    x = _make(shape, dtype, s, seed)
    out = jreshard.transfer(x, d)
    assert out.sharding == d and out.shape == x.shape and out.dtype == x.dtype
    _shards_equal(out, jax.device_put(x, d))


@given(sharding_pair(), st.integers(0, 1000), st.sampled_from([1, 2, 4, 8]))
def test_message_path_equals_device_put_and_plan_bytes(case, seed, domain):
    s, d, shape, dtype = case
    x = _make(shape, dtype, s, seed)
    topo = Topology.uniform(range(8), domain_size=domain)
    comm = RecordingComm(ranks=range(8), topology=topo)
    opts = jreshard.Options(chunk_bytes=64, staging_bytes=256)
    out, stats, rank_plans = api.transfer_with({"w": x}, {"w": d}, comm, topology=topo, options=opts)
    _shards_equal(out["w"], jax.device_put(x, d))
    plan = jreshard.plan({"w": x}, {"w": d}, topo)
    assert rank_plans == plan.rank_plans(range(8))  # each rank's plan, planned alone, is the plan's slice
    if plan.tensors:
        ps, rec = plan.stats(), _data_bytes(comm)
        assert (rec[Link.NETWORK], rec[Link.FAST], stats.same_device_bytes) == (
            ps.network_bytes,
            ps.fast_bytes,
            ps.same_device_bytes,
        )
    assert max(stats.peak_staging_bytes.values(), default=0) <= 256


def _data_bytes(comm):
    """Bytes per link of the chunks the engine moved, without the few rounds of scheduling mail."""
    out = dict.fromkeys(Link, 0)
    for r in comm.records:
        if r.tag < MAIL_TAG:
            out[r.link] += r.nbytes
    return out


def _refit_tree(mesh):
    fsdp = NamedSharding(mesh, P("x"))
    tree = {"layers": [], "embed": None}
    for i, dt in enumerate(DTYPES):
        tree["layers"].append({"w": _make((8, 4), dt, fsdp, i), "b": _make((8,), dt, fsdp, i + 10)})
    tree["embed"] = _make((16, 2), jnp.bfloat16, fsdp, 99)
    tree["scalar"] = _make((), jnp.float32, NamedSharding(mesh, P()), 5)
    tree["empty"] = _make((0, 4), jnp.int32, fsdp, 6)
    return tree


def test_pytree_of_mixed_dtypes_with_none_targets_scalars_and_empty_leaves():
    src_mesh, dst_mesh = Mesh(DEVS[:4], ("x",)), Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp"))
    x = _refit_tree(src_mesh)
    tp = NamedSharding(dst_mesh, P(None, "tp"))
    target = jax.tree.map(lambda a: tp if a.ndim == 2 else NamedSharding(dst_mesh, P()), x)
    target["embed"] = None
    out = jreshard.transfer(x, target)
    assert out["embed"] is x["embed"]
    treedef = jax.tree.structure(x)
    for a, t, o in zip(jax.tree.leaves(x), treedef.flatten_up_to(target), jax.tree.leaves(out), strict=True):
        if t is not None:
            _shards_equal(o, jax.device_put(a, t))


def test_thousands_of_leaves_and_a_cached_second_transfer():
    src, dst = NamedSharding(Mesh(DEVS[:2], ("x",)), P("x")), NamedSharding(Mesh(DEVS[6:], ("y",)), P(None, "y"))
    x = [jax.device_put(jnp.full((2, 2), i, jnp.float32), src) for i in range(2000)]
    out = jreshard.transfer(x, dst)
    assert [float(o[1, 1]) for o in out[::400]] == [0.0, 400.0, 800.0, 1200.0, 1600.0]
    before = _plain_route.cache_info()  # (a plain call: its route and plan cached under its key)
    jreshard.transfer(x, dst)
    after = _plain_route.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


def test_identical_shardings_move_nothing():
    s = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
    x = {"a": _make((8, 8), jnp.float32, s), "b": _make((4,), jnp.int8, s)}
    out = jreshard.transfer(x, s)
    assert out["a"] is x["a"] and out["b"] is x["b"]
    # Equivalent sharding, other spec spelling: the target sharding, equal values, and new memory
    # (a result never shares a buffer with a source unless the whole leaf is returned as is).
    t = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x", None))
    y, rep = jreshard.transfer(x["a"], t, report=True)
    assert y.sharding == t and rep.same_device_bytes == x["a"].nbytes
    _shards_equal(y, jax.device_put(x["a"], t))
    ptrs = {s.data.unsafe_buffer_pointer() for s in x["a"].addressable_shards}
    assert not ptrs & {s.data.unsafe_buffer_pointer() for s in y.addressable_shards}


def test_same_devices_other_order_shares_shards_that_stay_put():
    s = NamedSharding(Mesh(DEVS[:4].reshape(2, 2), ("a", "b")), P("a", "b"))
    d = NamedSharding(Mesh(DEVS[:4].reshape(2, 2), ("a", "b")), P("a", None))
    x = _make((4, 4), jnp.float32, s)
    out = jreshard.transfer(x, d)
    _shards_equal(out, jax.device_put(x, d))


def test_global_array_is_never_materialised_on_the_host(monkeypatch):
    s, d = (
        NamedSharding(Mesh(DEVS[:4], ("x",)), P("x")),
        NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("a", "b")), P("b", "a")),
    )
    x = _make((64, 32), jnp.float32, s)
    into = jax.device_put(jnp.zeros((64, 32)), d)
    expect = jax.device_put(x, d)

    def forbidden(self, *args, **kwargs):
        raise AssertionError("the host value of a jax.Array was taken during a transfer")

    monkeypatch.setattr(ArrayImpl, "__array__", forbidden)
    monkeypatch.setattr(ArrayImpl, "_value", property(forbidden))
    monkeypatch.setattr(ArrayImpl, "tolist", forbidden)
    out = jreshard.transfer(x, d)
    out2 = jreshard.transfer_into(x, into)
    monkeypatch.undo()
    _shards_equal(out, expect)
    _shards_equal(out2, expect)


def test_transfer_into_writes_in_place_and_aliases():
    s, d = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x")), NamedSharding(Mesh(DEVS[4:], ("y",)), P(None, "y"))
    x = {"w": _make((8, 8), jnp.bfloat16, s, 1), "v": _make((8, 4), jnp.int32, s, 2)}
    into = {k: jax.device_put(jnp.zeros(v.shape, v.dtype), d) for k, v in x.items()}
    ptrs = {k: [sh.data.unsafe_buffer_pointer() for sh in v.addressable_shards] for k, v in into.items()}
    out = jreshard.transfer_into(x, into)
    for k in x:
        _shards_equal(out[k], jax.device_put(x[k], d))
        assert [sh.data.unsafe_buffer_pointer() for sh in out[k].addressable_shards] == ptrs[k]
        assert out[k].sharding == d


def test_transfer_into_leaves_destinations_untouched_on_error():
    s, d = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x")), NamedSharding(Mesh(DEVS[4:], ("y",)), P("y"))
    x = {"a": _make((8,), jnp.float32, s, 1), "b": _make((8,), jnp.float32, s, 2)}
    into = {"a": jax.device_put(jnp.zeros(8), d), "b": jax.device_put(jnp.zeros(4), d)}
    with pytest.raises(LayoutMismatchError, match="into holds"):
        jreshard.transfer_into(x, into)
    assert not np.asarray(into["a"]).any()
    into["b"] = jax.device_put(jnp.zeros(8, jnp.int32), d)
    with pytest.raises(LayoutMismatchError) as info:
        jreshard.transfer_into(x, into)
    assert info.value.what == "dtype" and not np.asarray(into["a"]).any()
    x["b"].delete()
    into["b"] = jax.device_put(jnp.zeros(8), d)
    with pytest.raises(LayoutError, match="deleted or donated"):
        jreshard.transfer_into(x, into)
    assert not np.asarray(into["a"]).any()


def test_bad_input_raises_specific_errors():
    s = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
    x = {"a": _make((8,), jnp.float32, s), "b": _make((6,), jnp.float32, NamedSharding(Mesh(DEVS[:2], ("x",)), P("x")))}
    with pytest.raises(LayoutMismatchError, match="structure"):
        jreshard.transfer(x, {"a": s})
    with pytest.raises(LayoutError, match=r"str \(\), not a jax\.Array"):
        jreshard.transfer({"a": "weights"}, {"a": s})  # numpy arrays and scalars move (test_device_put_parity)
    with pytest.raises(LayoutError, match="expected a jax Sharding"):
        jreshard.transfer(x, {"a": s, "b": "tp"})
    with pytest.raises(IndivisibleError):
        jreshard.transfer(x, s)  # 6 rows over 4 devices
    abstract = NamedSharding(jax.sharding.AbstractMesh((4,), ("x",)), P("x"))
    with pytest.raises(TopologyError):
        jreshard.transfer(x["a"], abstract)
    with pytest.raises(BackendUnavailableError, match="NCCL moves CUDA device buffers"):
        jreshard.transfer(x["a"], s, options=jreshard.Options(backend="nccl"))  # select_backend's message
    with pytest.raises(BackendUnavailableError, match=r"RefitGroup\.pull"):
        jreshard.transfer_into(x["a"], x["a"], options=jreshard.Options(backend="mpi"))


def test_backend_mpi_in_one_process_runs_the_message_passing_engine():
    pytest.importorskip("mpi4py.MPI")
    s, d = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x")), NamedSharding(Mesh(DEVS[4:], ("y",)), P(None, "y"))
    x = {"w": _make((8, 8), jnp.bfloat16, s, 3), "v": _make((8, 4), jnp.int32, s, 4)}
    out, rep = jreshard.transfer(x, d, options=jreshard.Options(backend="mpi"), report=True)
    assert rep.backend is jreshard.Backend.MPI and rep.backend_reason.startswith("requested")
    for k in x:
        _shards_equal(out[k], jax.device_put(x[k], d))


def test_report_of_a_local_transfer_counts_bytes_phases_and_fresh_memory():
    s = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
    d = NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    x = {"a": _make((64, 32), jnp.float32, s, 1), "b": _make((32, 8), jnp.bfloat16, s, 2)}
    pool.default_pool().clear()
    out, rep = jreshard.transfer(x, d, report=True)
    want = sum(sh.data.nbytes for leaf in jax.tree.leaves(out) for sh in leaf.addressable_shards)
    assert rep.backend is jreshard.Backend.LOCAL and rep.backend_reason.startswith("auto: every device")
    assert rep.bytes_by_link() == {Link.SAME_DEVICE: 0, Link.FAST: want, Link.NETWORK: 0}
    assert rep.fresh_bytes >= want and rep.messages == 0 and rep.peak_staging_bytes == 0
    assert rep.total_s >= rep.copy_s + rep.buffers_s + rep.plan_s - 1e-6 and rep.copy_s > 0
    del out
    out, rep2 = jreshard.transfer(x, d, report=True)  # the released buffers come back: nothing fresh
    assert rep2.fresh_bytes == 0 and rep2.moved_bytes == rep.moved_bytes
    same = jreshard.transfer(out, d, report=True)[1]
    assert same.moved_bytes == 0 and same.backend is jreshard.Backend.LOCAL
    into, rep3 = jreshard.transfer_into(x, out, report=True)
    assert rep3.moved_bytes == want and rep3.fresh_bytes == 0
    # With a topology that puts every device in one domain but gives 4..7 their own host: network bytes.
    topo = jreshard.Topology.from_domains({r: int(r >= 4) for r in range(8)})
    rep4 = jreshard.transfer(x, d, topology=topo, report=True)[1]
    # The in-process run is a lowering of the same plan: each byte enters domain 1 once, then fans out.
    stats = jreshard.plan(x, {"a": d, "b": d}, topo).stats()
    assert (rep4.network_bytes, rep4.fast_bytes) == (stats.network_bytes, stats.fast_bytes)
    assert rep4.network_bytes == stats.network_bytes_lower_bound == want // 2 and rep4.moved_bytes == want
    _shards_equal(into["a"], jax.device_put(x["a"], d))


def test_destination_buffers_are_reused_only_after_jax_releases_them():
    s, d = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x")), NamedSharding(Mesh(DEVS[4:], ("y",)), P(None, "y"))
    x = _make((64, 64), jnp.float32, s, 5)
    y = _make((64, 64), jnp.float32, s, 6)
    a = jreshard.transfer(x, d)
    ptrs_a = {sh.data.unsafe_buffer_pointer() for sh in a.addressable_shards}
    b = jreshard.transfer(y, d)  # `a` is alive: its buffers must not be handed out again
    assert ptrs_a.isdisjoint(sh.data.unsafe_buffer_pointer() for sh in b.addressable_shards)
    keep = a.addressable_shards[0].data  # one shard of `a` stays alive through a single-device array
    del a
    gc.collect()  # jax hands the host buffers back when its array objects are collected
    c = jreshard.transfer(y, d)
    ptrs_c = {sh.data.unsafe_buffer_pointer() for sh in c.addressable_shards}
    assert keep.unsafe_buffer_pointer() not in ptrs_c and len(ptrs_c & ptrs_a) == 3
    _shards_equal(b, c)
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(x)[:, :16])  # never overwritten


def test_buffer_pool_counts_caps_and_clears():
    p = pool.BufferPool(max_bytes=128)
    a, b = p.take(100), p.take(64)
    assert a.ctypes.data % pool.ALIGN == 0 and b.ctypes.data % pool.ALIGN == 0 and a.size == 100
    st = p.stats()
    assert (st.leased_bytes, st.misses, st.hits, st.fresh_bytes) == (192, 2, 0, 192)
    del a, b  # 128 + 64 > max_bytes: one of them is let go
    st = p.stats()
    assert st.leased_bytes == 0 and st.retained_bytes in (64, 128)
    assert p.clear() == st.retained_bytes and p.stats().retained_bytes == 0
    with pytest.raises(ValueError, match="max_bytes=-1"):
        pool.BufferPool(max_bytes=-1)
    for bad in (True, 1.5, "128"):
        with pytest.raises(ValueError, match=r"max_bytes=.* must be None or an int >= 0"):
            pool.BufferPool(max_bytes=bad)
    assert pool.BufferPool(max_bytes=np.int64(128))._max == 128  # numpy's integers are ints


def test_threaded_copies_equal_device_put():
    """Copies big enough to be cut into one part per thread (4 MiB parts) still land exactly."""
    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs[:4], ("tp",)), P(None, "tp"))
    dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    x = jax.device_put(np.arange(1024 * 4096, dtype=np.float32).reshape(1024, 4096), src)
    for threads in (1, 2, 3):
        y = jreshard.transfer(x, dst, options=jreshard.Options(copy_threads=threads))
        want = jax.device_put(x, dst)
        for a, b in zip(y.addressable_shards, want.addressable_shards, strict=True):
            assert a.device == b.device
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    with pytest.raises(ValueError, match="copy_threads=0"):
        jreshard.Options(copy_threads=0)


def test_multiprocess_path_over_any_transport():
    """transfer_multiprocess runs the plan over the transport it is given (NCCL passes its own):
    here a RecordingComm in one process, checked against device_put and the plan's bytes."""
    from jreshard.call.routes import transfer_multiprocess

    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
    dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    x = {"a": _make((8, 4), jnp.float32, src), "b": _make((16, 2), jnp.bfloat16, src, 1)}
    topo = Topology.uniform(range(8), domain_size=4)
    comm = RecordingComm(ranks=range(8), topology=topo)
    out = transfer_multiprocess(x, {"a": dst, "b": dst}, topology=topo, transport=comm)
    for k in x:
        _shards_equal(out[k], jax.device_put(x[k], dst))
    stats = jreshard.plan(x, {"a": dst, "b": dst}, topo).stats()
    rec = _data_bytes(comm)
    assert (rec[Link.NETWORK], rec[Link.FAST]) == (stats.network_bytes, stats.fast_bytes) != (0, 0)


def test_transfer_into_says_when_a_copy_fails_midway(monkeypatch):
    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
    dst = NamedSharding(Mesh(devs[4:], ("x",)), P(None, "x"))
    x = _make((8, 8), jnp.float32, src)
    into = jreshard.transfer(x, dst)

    def broken(*args, **kwargs):
        raise OSError("simulated failure inside a copy")

    monkeypatch.setattr("jreshard.engine.strided.copy_classes", broken)
    with pytest.raises(jreshard.TransferError, match="consumed") as info:
        jreshard.transfer_into(x, into)
    assert info.value.destination_intact is False


def test_transfer_accepts_views_anywhere_a_leaf_is_allowed():
    """jreshard.transfer / transfer_into route a pytree with views to the views executor."""
    devs = np.array(jax.devices())
    fsdp = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
    tp2 = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    q, k, v = (_make((8, 16), jnp.float32, fsdp, i) for i in range(3))
    fused = jreshard.views.astype(jreshard.views.concat([q, k, v], axis=1, groups=2), jnp.bfloat16)
    out = jreshard.transfer({"qkv": fused, "q": q}, {"qkv": tp2, "q": tp2})
    want = jnp.concatenate([jnp.concatenate([a[:, h * 8 : h * 8 + 8] for a in (q, k, v)], axis=1) for h in (0, 1)], 1)
    _shards_equal(out["qkv"], jax.device_put(want.astype(jnp.bfloat16), tp2))
    _shards_equal(out["q"], jax.device_put(q, tp2))
    again = jreshard.transfer_into({"qkv": fused, "q": q}, out)
    _shards_equal(again["qkv"], jax.device_put(want.astype(jnp.bfloat16), tp2))
    _, rep = jreshard.transfer({"qkv": fused}, {"qkv": tp2}, report=True)
    assert rep.moved_bytes == want.size * 2 * 2  # bfloat16 bytes on the wire, for each of the two DP replicas


def test_public_assembly_path_gives_the_same_results(monkeypatch):
    """Without jax's private DLPack import and array constructor (another jax version), results come from
    public calls (``jax.dlpack.from_dlpack``, ``jax.make_array_from_single_device_arrays``), equal."""
    import jreshard.engine.arrays as arrays
    import jreshard.engine.put as put

    monkeypatch.setattr(put, "_PUT", None)  # no batched put either: the DLPack path, through public calls
    monkeypatch.setattr(arrays, "_IMPORT", arrays._public_import)
    monkeypatch.setattr(arrays, "_ASSEMBLE", arrays._public_assemble)
    s, d = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x")), NamedSharding(Mesh(DEVS[4:], ("y",)), P(None, "y"))
    x = {"a": _make((8, 8), jnp.float32, s, 3), "b": _make((4, 4), jnp.bfloat16, s, 4)}
    out = jreshard.transfer(x, d)
    for k in x:
        _shards_equal(out[k], jax.device_put(x[k], d))


@pytest.mark.parametrize("backend", ["local", "xla", "mpi"])
@pytest.mark.parametrize("shape", [(8, 8), (0, 8), ()])
def test_a_weakly_typed_leaf_stays_weak_on_every_backend(backend, shape):
    """``jax.device_put`` keeps a source's ``weak_type`` (a Python scalar broadcast); so does every backend, the
    in-place results of ``transfer_into`` included. Backends xla and mpi (one process) used to return strongly
    typed arrays."""
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs[:4], ("x",)), P(*([None] * (len(shape) - 1)), "x") if shape else P())
    # (the destination's devices out of id order: the weak results were assembled in id order, and backend mpi
    # raised on such a mesh)
    dst = NamedSharding(Mesh(devs[4:][::-1], ("y",)), P("y") if shape else P())
    x = jax.device_put(jnp.broadcast_to(1.5, shape), src)
    want = jax.device_put(x, dst)
    assert x.weak_type and want.weak_type
    options = jreshard.Options(backend=backend)
    out = jreshard.transfer(x, dst, options=options)
    assert out.weak_type and out.dtype == want.dtype and np.array_equal(out, want)
    if backend != "mpi":  # transfer_into runs in one process on local and xla
        into = jax.device_put(jnp.broadcast_to(2.5, shape), dst)
        written = jreshard.transfer_into(x, into, options=options)
        assert written.weak_type and np.array_equal(written, want)


def test_a_weakly_typed_leaf_beside_views_stays_weak():
    """A plain array in a tree with views (``jreshard.views``) keeps its ``weak_type`` as ``jax.device_put`` keeps
    it, through ``transfer`` and ``transfer_into``; a cast view's result is strongly typed, as ``astype`` makes it.
    The views' path used to make every result strongly typed."""
    from jreshard import views

    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
    dst = NamedSharding(Mesh(devs[4:], ("y",)), P("y"))
    weak = jax.device_put(jnp.broadcast_to(1.5, (8,)), src)
    strong = jax.device_put(jnp.arange(8, dtype=jnp.float32), src)
    assert weak.weak_type and jax.device_put(weak, dst).weak_type
    tree = {"cast": views.astype(strong, jnp.bfloat16), "plain": weak, "strong": strong}
    out = views.transfer(tree, dst)
    assert out["plain"].weak_type and not out["cast"].weak_type and not out["strong"].weak_type
    assert np.array_equal(out["plain"], jnp.full(8, 1.5))
    into = {k: jax.device_put(jnp.zeros(8, v.dtype), dst) for k, v in out.items()}
    written = views.transfer_into(tree, into)
    assert written["plain"].weak_type and not written["cast"].weak_type and not written["strong"].weak_type
    assert np.array_equal(written["plain"], jnp.full(8, 1.5))


@pytest.mark.parametrize("backend", ["local", "xla", "mpi"])
@pytest.mark.parametrize("dtype", ["float64", "complex128", "int64", "uint64"])
def test_64_bit_dtypes_under_x64_move_on_every_backend(backend, dtype):
    """With ``jax.enable_x64``, 8- and 16-byte elements through every backend. The message-passing engine
    (``backend="mpi"``, and so ``RefitGroup``) used to refuse ``float64`` (a check for 6-bit floats matched
    its name) and fail on ``complex128`` (its views went through a 128-bit unsigned integer, which no library
    has)."""
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    with jax.enable_x64(True):
        devs = np.array(jax.devices())
        src = NamedSharding(Mesh(devs[:4], ("x",)), P("x"))
        dst = NamedSharding(Mesh(devs[4:], ("y",)), P(None, "y"))
        host = (np.arange(64) * 3 - 7).astype(dtype).reshape(8, 8)
        if np.dtype(dtype).kind == "c":
            host = host * (1 + 0.5j)
        x = jax.device_put(host, src)
        assert x.dtype == np.dtype(dtype)
        out = jreshard.transfer(x, dst, options=jreshard.Options(backend=backend))
        assert out.dtype == x.dtype and out.sharding == dst
        assert np.asarray(out).tobytes() == host.tobytes()
