"""Many-leaf in-process calls: the compiled strided copies against numpy's, many leaves against device_put, and
the steady state of a transfer_into loop (in place, nothing shared, nothing stale)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.engine import ownership, strided
from jreshard.engine.copies import geometry
from jreshard.errors import TransferError

DEVS = np.array(jax.devices())
FSDP = NamedSharding(Mesh(DEVS[:4], ("fsdp",)), P("fsdp"))
TP = NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))

needs_kernel = pytest.mark.skipif(not strided.compiled(), reason="jreshard/engine/_strided.c was not built")


def _strides(shape, itemsize):
    out = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


@st.composite
def _pieces(draw):
    ndim = draw(st.integers(1, 4))
    src_shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    dst_shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    ext = tuple(draw(st.integers(1, min(a, b))) for a, b in zip(src_shape, dst_shape, strict=True))
    s_lo = tuple(draw(st.integers(0, a - e)) for a, e in zip(src_shape, ext, strict=True))
    d_lo = tuple(draw(st.integers(0, a - e)) for a, e in zip(dst_shape, ext, strict=True))
    itemsize = draw(st.sampled_from([1, 2, 4, 8, 64]))  # 64: runs long enough for streaming stores
    return src_shape, dst_shape, ext, s_lo, d_lo, itemsize, draw(st.integers(1, 30)), draw(st.integers(0, 15))


def _copy_case(case, seed, stream_min, copier=False):
    """Copy one class of pieces (each leaf its own buffers, misaligned by ``skew`` bytes); the destination
    bytes outside the pieces must stay as they were. ``copier``: through a :class:`strided.Copier` whose
    threads take every piece, however few bytes."""
    src_shape, dst_shape, ext, s_lo, d_lo, itemsize, leaves, skew = case
    rng = np.random.default_rng(seed)
    nbytes_s, nbytes_d = int(np.prod(src_shape)) * itemsize, int(np.prod(dst_shape)) * itemsize
    srcs = [rng.integers(0, 255, size=nbytes_s + skew, dtype=np.uint8) for _ in range(leaves)]
    dsts = [rng.integers(0, 255, size=nbytes_d + skew, dtype=np.uint8) for _ in range(leaves)]
    before = [d.copy() for d in dsts]
    s_str, d_str = _strides(src_shape, itemsize), _strides(dst_shape, itemsize)
    cls = geometry(ext, itemsize, s_str, d_str)
    s_off = skew + sum(a * b for a, b in zip(s_lo, s_str, strict=True))
    d_off = skew + sum(a * b for a, b in zip(d_lo, d_str, strict=True))
    src = np.array([a.ctypes.data + s_off for a in srcs], np.int64)
    dst = np.array([a.ctypes.data + d_off for a in dsts], np.int64)
    saved = strided.STREAM_MIN, strided.THREAD_MIN
    strided.STREAM_MIN, strided.THREAD_MIN = stream_min, 0
    try:
        if copier:
            c = strided.Copier(threads=2)
            c.start([(cls, src, dst)])
            c.wait()
        else:
            strided.copy_classes([(cls, src, dst)], threads=2)
    finally:
        strided.STREAM_MIN, strided.THREAD_MIN = saved
    box_s = tuple(slice(a, a + e) for a, e in zip(s_lo, ext, strict=True))
    box_d = tuple(slice(a, a + e) for a, e in zip(d_lo, ext, strict=True))
    for a, b, old in zip(srcs, dsts, before, strict=True):
        want = old[skew:].view(f"V{itemsize}").reshape(dst_shape).copy()
        want[box_d] = a[skew:].view(f"V{itemsize}").reshape(src_shape)[box_s]
        np.testing.assert_array_equal(b[skew:], want.reshape(-1).view(np.uint8))
        np.testing.assert_array_equal(b[:skew], old[:skew])


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(_pieces(), st.integers(0, 2**31), st.sampled_from([0, 1 << 40]))
def test_compiled_copies_equal_numpy_slicing(case, seed, stream_min):
    """The compiled kernel, with and without streaming stores, at any alignment, up to 4 outer dimensions."""
    _copy_case(case, seed, stream_min)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(_pieces(), st.integers(0, 2**31), st.sampled_from([0, 1 << 40]))
def test_copies_on_the_kernels_threads_equal_numpy_slicing(case, seed, stream_min):
    """The same pieces queued on a Copier: its threads copy them while the caller goes on, wait() ends them."""
    _copy_case(case, seed, stream_min, copier=True)


def _kernel_call(src, dst, n, run):
    """A ``copy_pieces`` call of ``n`` contiguous pieces of ``run`` bytes, and its address tables."""
    s = src.ctypes.data + np.arange(n, dtype=np.int64) * run
    d = dst.ctypes.data + np.arange(n, dtype=np.int64) * run
    return (s.ctypes.data, d.ctypes.data, n, run, (), (), (), True, (s, d))


@needs_kernel
def test_a_batch_of_copies_ends_by_wait_or_by_its_destructor():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 255, size=8 << 20, dtype=np.uint8)
    for workers in (0, 1, 3):
        for waited in (True, False):
            dst = np.zeros_like(src)
            batch = strided._KERNEL.Copies(workers)
            for k in range(8):  # 8 calls of 1 MiB
                part = slice(k << 20, (k + 1) << 20)
                batch.post(*_kernel_call(src[part], dst[part], 256, 4096))
            if waited:
                batch.wait()
                with pytest.raises(ValueError, match="after wait"):
                    batch.post(*_kernel_call(src, dst, 1, 64))
            del batch  # (unwaited: the destructor waits for every queued call)
            np.testing.assert_array_equal(dst, src)


@needs_kernel
def test_a_bad_call_is_refused_and_the_calls_queued_before_it_still_end():
    src = np.arange(4 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    batch = strided._KERNEL.Copies(2)
    batch.post(*_kernel_call(src, dst, 1024, 4096))
    bad = list(_kernel_call(src, dst, 4, 8))
    bad[4:7] = (-1,), (8,), (8,)
    with pytest.raises(ValueError, match="negative extent"):
        batch.post(*bad)
    with pytest.raises(ValueError, match="must be in"):
        strided._KERNEL.Copies(-1)
    batch.wait()
    np.testing.assert_array_equal(dst, src)


@settings(max_examples=30, deadline=None)
@given(_pieces(), st.integers(0, 2**31))
def test_numpy_copies_are_the_same_where_the_kernel_is_not_built(case, seed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(strided, "_KERNEL", None)
        assert not strided.compiled()
        _copy_case(case, seed, 1 << 40)
        _copy_case(case, seed, 1 << 40, copier=True)


def _leaves(n, side=128, seed=0):
    fill = jax.jit(lambda: [jnp.full((side, side), i + seed, jnp.float32) for i in range(n)], out_shardings=[FSDP] * n)
    return jax.block_until_ready(fill())


def _pointers(a):
    return {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}


def _equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.sharding is TP
        for s, r in zip(g.addressable_shards, w.addressable_shards, strict=True):
            assert s.device == r.device
            np.testing.assert_array_equal(np.asarray(s.data), np.asarray(r.data))


def test_many_leaves_equal_device_put_and_own_new_memory():
    """300 leaves of 64 KiB: equal to device_put, every result in memory no source has."""
    x = _leaves(300)
    out = jreshard.transfer(x, TP)
    _equal(out, jax.device_put(x, TP))
    sources = set().union(*(_pointers(a) for a in x))
    assert not sources & set().union(*(_pointers(a) for a in out))


def _prepared(x):
    from jreshard.call.front import Mode, flatten, prepare

    leaves, treedef, targets = flatten(x, TP)
    return prepare(leaves, treedef, targets, Mode.TRANSFER, None, jreshard.Options())


def test_many_leaves_under_bounds_checks_and_on_one_copy_thread(monkeypatch):
    monkeypatch.setenv("JRESHARD_CHECK_BOUNDS", "1")
    x = _leaves(300, seed=2)
    _equal(jreshard.transfer(x, TP), jax.device_put(x, TP))
    monkeypatch.delenv("JRESHARD_CHECK_BOUNDS")
    _equal(jreshard.transfer(x, TP, options=jreshard.Options(copy_threads=1)), jax.device_put(x, TP))


def test_steady_state_transfer_into_writes_in_place_every_step():
    """A refit loop: from the second step on, every leaf is written into the memory of the one before,
    nothing is reported as not in place, and each step's values are that step's."""
    held = jreshard.transfer(_leaves(64), TP)
    for step in range(1, 4):
        x = _leaves(64, seed=100 * step)
        before = [_pointers(a) for a in held]
        out, rep = jreshard.transfer_into(x, held, report=True)
        _equal(out, jax.device_put(x, TP))
        assert all(a.is_deleted() for a in held)
        if step > 1:  # the first step donates pool memory, which jax answers with a copy
            assert [_pointers(a) for a in out] == before
            assert rep.not_in_place == () and rep.not_in_place_bytes == 0
        held = out


def test_steady_state_into_that_a_source_shares_is_not_written_in_place():
    """The one-set-operation claim of the steady state falls back to the leaf-by-leaf rule when a source
    shares an into leaf's memory: that leaf gets fresh memory, and the source never changes."""
    held = jreshard.transfer(_leaves(16), TP)
    held = jreshard.transfer_into(_leaves(16, seed=50), held)
    x = _leaves(16, seed=60)
    shared = jax.make_array_from_single_device_arrays(held[3].shape, TP, [s.data for s in held[3].addressable_shards])
    x2 = list(x)
    x2[5] = shared  # leaf 5 reads the memory that into leaf 3 names
    want = [np.asarray(a) for a in x2]
    out, rep = jreshard.transfer_into(x2, held, report=True)
    assert [i for i, _ in rep.not_in_place] == [3]
    assert not shared.is_deleted()
    np.testing.assert_array_equal(np.asarray(shared), want[5])
    for a, w in zip(out, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), w)


def test_remembered_addresses_are_swept_as_results_die():
    for seed in range(12):
        jreshard.transfer(_leaves(500, side=8, seed=seed), TP)
    live = sum(1 for ref, _, _ in ownership._KNOWN.values() if ref() is not None)
    assert len(ownership._KNOWN) <= max(4096, 2 * live) + 500


def test_a_group_with_one_destination_order_says_so():
    from jreshard.engine.prepared import Group

    x = _leaves(2)
    g = _prepared(x).shape.groups[0]
    assert g.common_dst == g.dst_order[0]
    mixed = Group(g.src, g.dst, (0, 1), g.src_order, (g.dst_order[0], g.dst_order[0][::-1]), g.devices)
    assert mixed.common_dst is None


def _steady(n, seed=0):
    """``n`` leaves held by a transfer_into result (the memory jax allocated: the steady state)."""
    held = jreshard.transfer(_leaves(n, seed=seed), TP)
    return jreshard.transfer_into(_leaves(n, seed=seed + 1), held)


def test_steady_state_into_of_many_leaves_writes_in_place():
    held = _steady(300)
    for step in range(2):
        x = _leaves(300, seed=10 + step)
        before = [_pointers(a) for a in held]
        out, rep = jreshard.transfer_into(x, held, report=True)
        _equal(out, jax.device_put(x, TP))
        assert [_pointers(a) for a in out] == before
        assert rep.not_in_place == () and all(a.is_deleted() for a in held)
        held = out


def test_a_donation_that_fails_leaves_into_as_it_was(monkeypatch):
    held = _steady(300, seed=20)
    want = [np.asarray(a) for a in held]

    def fail(*args, **kwargs):
        raise RuntimeError("injected donation failure")

    monkeypatch.setattr(ownership, "donate", fail)
    with pytest.raises(RuntimeError, match="injected donation failure"):
        jreshard.transfer_into(_leaves(300, seed=30), held)
    for a, w in zip(held, want, strict=True):
        assert not a.is_deleted()
        np.testing.assert_array_equal(np.asarray(a), w)


class _FailingKernel:
    """A stand-in for the compiled copies that fails on its second call, run at once or queued on a batch."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def _call(self):
        self.calls += 1
        if self.calls == 2:
            raise OSError("injected copy failure")

    def copy_pieces(self, *args):
        self._call()
        return self.real.copy_pieces(*args)

    def Copies(self, workers):  # (the kernel's own name)
        return _FailingBatch(self, self.real.Copies(workers))


class _FailingBatch:
    def __init__(self, kernel, real):
        self.kernel, self.real = kernel, real

    def post(self, *args):
        self.kernel._call()
        return self.real.post(*args)

    def wait(self):
        return self.real.wait()


@needs_kernel
@pytest.mark.parametrize("mode", ["transfer", "into"])
def test_a_failed_compiled_copy_raises_transfer_error(monkeypatch, mode):
    held = _steady(300, seed=80)
    monkeypatch.setattr(strided, "_KERNEL", _FailingKernel(strided._KERNEL))
    x = _leaves(300, seed=90)
    with pytest.raises(TransferError, match="injected copy failure") as err:
        jreshard.transfer(x, TP) if mode == "transfer" else jreshard.transfer_into(x, held)
    if mode == "into":
        assert err.value.destination_intact is False
    assert strided._KERNEL.calls == 2  # (queued on the kernel's threads: the stand-in saw the batch)


def test_results_made_while_copying_are_the_copied_buffers(monkeypatch):
    """transfer makes its results while the copies run, over the pool's buffers: checked, and where the check
    says jax copied a buffer, the results are made again once the copies have ended."""
    from jreshard.engine import inprocess

    x = _leaves(300, seed=40)
    want = jax.device_put(x, TP)
    _equal(jreshard.transfer(x, TP), want)
    checked = []
    real = inprocess._over
    monkeypatch.setattr(inprocess, "_over", lambda a, views: checked.append(real(a, views)) or False)
    _equal(jreshard.transfer(x, TP), want)
    assert checked == [True]  # one check a group, which jax passed; the stand-in said it failed


def test_the_aliasing_check_tells_a_copy_from_the_buffers_themselves():
    from jreshard.engine import inprocess
    from jreshard.engine.buffers import aligned_empty

    devices = list(TP._device_assignment)
    views = [aligned_empty(128 * 64 * 4).view(np.float32).reshape(128, 64) for _ in range(4)]  # jax aliases these
    for k, v in enumerate(views):
        v[:] = k
    a = jax.make_array_from_single_device_arrays(
        (128, 128), TP, [jax.device_put(v, d) for v, d in zip(views, devices, strict=True)]
    )
    in_order = [views[devices.index(s.device)] for s in a.addressable_shards]
    assert [s.data.unsafe_buffer_pointer() for s in a.addressable_shards] == [v.ctypes.data for v in in_order]
    assert inprocess._over(a, in_order)
    assert not inprocess._over(a, [v.copy() for v in in_order])
    assert not inprocess._over(a, in_order[::-1])


def _addresses(a):
    return [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]


def test_a_loop_whose_into_arrays_were_reallocated_writes_only_into_the_new_ones():
    """The addresses of a loop's results are remembered; once the caller drops them and passes new arrays
    (which may lie where the old ones were), every byte goes into the new arrays, nothing else changes."""
    held = _steady(64, seed=200)
    held = jreshard.transfer_into(_leaves(64, seed=201), held)
    del held  # the remembered arrays die; new ones may take their memory
    bystanders = [jax.device_put(jnp.full((128, 128), -1.0, jnp.float32), TP) for _ in range(32)]
    into = [jax.device_put(jnp.full((128, 128), -2.0, jnp.float32), TP) for _ in range(64)]
    before = [_addresses(a) for a in into]
    for step in range(3):
        x = _leaves(64, seed=300 + step)
        into, rep = jreshard.transfer_into(x, into, report=True)
        _equal(into, jax.device_put(x, TP))
        assert [_addresses(a) for a in into] == before and rep.not_in_place == ()
    for a in bystanders:
        np.testing.assert_array_equal(np.asarray(a), -1.0)


def test_a_loop_that_changes_layout_or_dtype_equals_device_put_at_every_step():
    """One loop through three shapes of the same tree: TP, then another layout, then bfloat16 leaves of a third;
    every step equals device_put, and each layout's second step writes where its first left the results."""
    rows = NamedSharding(Mesh(DEVS[4:], ("x",)), P("x"))
    fill16 = jax.jit(lambda: [jnp.full((128, 128), i, jnp.bfloat16) for i in range(48)], out_shardings=[FSDP] * 48)
    cases = [(lambda seed: _leaves(48, seed=seed), TP), (lambda seed: _leaves(48, seed=seed), rows)]
    cases.append((lambda seed: [a + seed for a in fill16()], TP))
    for make, target in cases:
        held = jreshard.transfer(make(0), target)
        for step in range(1, 4):
            x = make(step)
            before = [_addresses(a) for a in held]
            out, rep = jreshard.transfer_into(x, held, report=True)
            want = jax.device_put(x, target)
            for g, w in zip(out, want, strict=True):
                assert g.sharding == target and g.dtype == w.dtype
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
            if step > 1:  # (the first step donates pool memory, which jax answers with a copy)
                assert [_addresses(a) for a in out] == before and rep.not_in_place == ()
            held = out


def test_one_call_of_many_groups_made_while_copying_equals_device_put():
    """Groups of several dtypes and sizes in one call (some below the size worth a copy thread)."""
    fill = jax.jit(
        lambda: (
            [jnp.full((128, 128), i, jnp.float32) for i in range(40)],
            [jnp.full((64, 32), i, jnp.bfloat16) for i in range(40)],
            [jnp.full((8, 8), i, jnp.int8) for i in range(40)],
        ),
        out_shardings=([FSDP] * 40, [FSDP] * 40, [FSDP] * 40),
    )
    x = jax.block_until_ready(fill())
    out = jreshard.transfer(x, TP)
    for g, w in zip(jax.tree.leaves(out), jax.tree.leaves(jax.device_put(x, TP)), strict=True):
        assert g.sharding is TP and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
