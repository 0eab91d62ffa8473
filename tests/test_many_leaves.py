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


def _copy_case(case, seed, stream_min):
    """Copy one class of pieces (each leaf its own buffers, misaligned by ``skew`` bytes); the destination
    bytes outside the pieces must stay as they were."""
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
    saved = strided.STREAM_MIN
    strided.STREAM_MIN = stream_min
    try:
        strided.copy_classes([(cls, src, dst)], threads=2)
    finally:
        strided.STREAM_MIN = saved
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


@settings(max_examples=30, deadline=None)
@given(_pieces(), st.integers(0, 2**31))
def test_numpy_copies_are_the_same_where_the_kernel_is_not_built(case, seed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(strided, "_KERNEL", None)
        assert not strided.compiled()
        _copy_case(case, seed, 1 << 40)


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
    """A stand-in for the compiled copies that fails on its second call."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def copy_pieces(self, *args):
        self.calls += 1
        if self.calls == 2:
            raise OSError("injected copy failure")
        return self.real.copy_pieces(*args)


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
