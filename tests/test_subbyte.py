"""Packed sub-byte dtypes and typed PRNG keys: moved bit for bit, never a byte past a buffer.

Boxes are drawn to start and end at odd element offsets, so every packed shard boundary
splits a byte. The same property runs again in a child process under ``MALLOC_CHECK_=3`` (with
glibc's checking allocator preloaded, without which glibc 2.34 and later ignore it) and
``JRESHARD_CHECK_BOUNDS=1`` (every copy checked against its buffers). The oracle places the values
from the host: ``jax.device_put`` of a packed device array to other devices overruns its buffers
(tests/test_subbyte_props.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.engine import strided
from jreshard.errors import LayoutError, TransferError
from jreshard.sharding.dtypes import packed_bits, storage_bytes
from tests.test_subbyte_props import _malloc_debug

DEVS = np.array(jax.devices())
SUB_BYTE = [jnp.int4, jnp.uint4, jnp.int2, jnp.uint2, jnp.float4_e2m1fn]


def _bits(a: jax.Array) -> np.ndarray:
    """The values of ``a`` as raw bits, one per element (numpy holds sub-byte values one a byte)."""
    host = np.asarray(a)
    return host.view(np.uint8) if host.dtype.itemsize == 1 else host.view(np.uint16)


def _values(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    bits = packed_bits(np.dtype(dtype))
    raw = rng.integers(0, 1 << bits, size=shape).astype(np.uint8)
    host = raw.view(np.dtype(dtype))  # every bit pattern, NaN-free types only
    return host


@st.composite
def odd_case(draw):
    dtype = draw(st.sampled_from(SUB_BYTE))
    perm = list(draw(st.permutations(list(DEVS))))
    n_src, n_dst = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4, 8]))
    odd = draw(st.sampled_from([1, 3, 5, 7]))  # shard extents odd: boxes start at odd element offsets
    rows = draw(st.sampled_from([1, 3]))
    src = NamedSharding(Mesh(np.array(perm[:n_src]), ("a",)), P("a"))
    kind = draw(st.sampled_from(["named", "cols", "single"]))
    first = draw(st.integers(0, 8 - n_dst))
    if kind == "single":
        dst = SingleDeviceSharding(perm[first])
    elif kind == "cols":
        dst = NamedSharding(Mesh(np.array(perm[first : first + n_dst]), ("b",)), P(None, "b"))
    else:
        dst = NamedSharding(Mesh(np.array(perm[first : first + n_dst]), ("b",)), P("b"))
    n = int(np.lcm(n_src, n_dst)) * odd
    return dtype, (n, n_dst * odd * rows), src, dst


@settings(max_examples=40, deadline=None)
@given(odd_case(), st.integers(0, 1000))
def test_sub_byte_transfer_and_transfer_into_equal_device_put(case, seed):
    dtype, shape, src, dst = case
    x = jax.device_put(_values(dtype, shape, seed), src)
    want = jax.device_put(_values(dtype, shape, seed), dst)  # from the host (test_subbyte_props.py says why)
    got = jreshard.transfer(x, dst)
    assert got.dtype == want.dtype and got.sharding == dst
    np.testing.assert_array_equal(_bits(got), _bits(want))
    into = jax.device_put(np.zeros(shape, np.dtype(dtype)), dst)
    ptrs = [s.data.unsafe_buffer_pointer() for s in into.addressable_shards]
    out = jreshard.transfer_into(x, into)
    np.testing.assert_array_equal(_bits(out), _bits(want))
    assert into.is_deleted() and [s.data.unsafe_buffer_pointer() for s in out.addressable_shards] == ptrs
    np.testing.assert_array_equal(_bits(x), _bits(jax.device_put(_values(dtype, shape, seed), src)))  # x unchanged


def test_the_first_reported_case_a_plain_copy_of_int4():
    x = jax.device_put((jnp.arange(24) % 8).astype(jnp.int4), DEVS[0])
    y = jreshard.transfer(x, SingleDeviceSharding(DEVS[5]))
    assert y.dtype == jnp.int4
    np.testing.assert_array_equal(np.asarray(y), np.arange(24) % 8)


def test_sub_byte_leaves_in_a_pytree_with_others_and_a_report():
    a = NamedSharding(Mesh(DEVS[:2], ("x",)), P("x"))
    b = NamedSharding(Mesh(DEVS[2:5], ("y",)), P("y"))
    x = {
        "w4": jax.device_put(_values(jnp.int4, (6, 5), 1), a),
        "f4": jax.device_put(_values(jnp.float4_e2m1fn, (6,), 2), a),
        "f32": jax.device_put(np.arange(6, dtype=np.float32), a),
        "keep": jax.device_put(_values(jnp.uint2, (6,), 3), a),
    }
    targets = {"w4": b, "f4": b, "f32": b, "keep": None}
    out, rep = jreshard.transfer(x, targets, report=True)
    for k in ("w4", "f4", "f32"):
        np.testing.assert_array_equal(_bits(out[k]), _bits(jax.device_put(np.asarray(x[k]), b)))
        assert out[k].sharding == b
    assert out["keep"] is x["keep"]
    assert rep.moved_bytes > 0


def test_layouts_refuse_packed_dtypes_before_any_byte_moves():
    with pytest.raises(LayoutError, match="packs 2 values a byte"):
        jreshard.Layout.from_sharding(NamedSharding(Mesh(DEVS[:2], ("x",)), P("x")), (4,), "int4")


def test_storage_bytes_counts_packed_values():
    assert storage_bytes(np.dtype(ml_dtypes.int4), 7) == 4
    assert storage_bytes(np.dtype(ml_dtypes.uint2), 9) == 3
    assert storage_bytes(np.dtype(ml_dtypes.bfloat16), 3) == 6
    assert storage_bytes(np.dtype(np.bool_), 3) == 3


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_typed_key_arrays_move_as_their_key_data(impl):
    a = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
    b = NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("y", "z")), P("z", None))
    keys = jax.device_put(jax.random.split(jax.random.key(7, impl=impl), 8).reshape(4, 2), a)
    want = jax.device_put(keys, b)
    got = jreshard.transfer(keys, b)
    assert got.dtype == keys.dtype and jax.random.key_impl(got) == jax.random.key_impl(keys)
    assert got.sharding == b
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
    one = jreshard.transfer(jax.random.key(3, impl=impl), SingleDeviceSharding(DEVS[6]))
    np.testing.assert_array_equal(jax.random.key_data(one), jax.random.key_data(jax.random.key(3, impl=impl)))
    into = jax.device_put(jax.random.split(jax.random.key(0, impl=impl), 8).reshape(4, 2), b)
    out = jreshard.transfer_into(keys, into)
    np.testing.assert_array_equal(jax.random.key_data(out), jax.random.key_data(want))
    assert into.is_deleted()
    # usable as keys: the same numbers as from the originals
    np.testing.assert_array_equal(jax.random.uniform(got[0, 0]), jax.random.uniform(keys[0, 0]))


def test_transfer_into_a_sub_byte_leaf_that_is_also_a_source_writes_fresh_memory():
    a = NamedSharding(Mesh(DEVS[:2], ("x",)), P("x"))
    x = jax.device_put(_values(jnp.int4, (6,), 5), a)
    y = jax.device_put(_values(jnp.int4, (6,), 6), a)
    out, rep = jreshard.transfer_into({"p": x, "q": y}, {"p": y, "q": x}, report=True)
    np.testing.assert_array_equal(_bits(out["p"]), _bits(x))
    np.testing.assert_array_equal(_bits(out["q"]), _bits(y))
    assert not x.is_deleted() and not y.is_deleted() and rep.not_in_place_bytes > 0


def test_bounds_mode_refuses_a_copy_past_its_buffer_and_copies_nothing():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(32, np.uint8)
    cls = strided.CopyClass(run=8, outer=(), src_strides=(), dst_strides=())
    bufs = (
        strided.AddressRanges.of([(src.ctypes.data, src.ctypes.data + 64)]),
        strided.AddressRanges.of([(dst.ctypes.data, dst.ctypes.data + 32)]),
    )
    ok = [(cls, np.array([src.ctypes.data], np.int64), np.array([dst.ctypes.data + 24], np.int64))]
    assert strided.copy_classes(ok, bounds=bufs) == 8
    bad = [
        (
            cls,
            np.array([src.ctypes.data, src.ctypes.data], np.int64),
            np.array([dst.ctypes.data, dst.ctypes.data + 25], np.int64),
        )
    ]
    dst[:] = 0
    with pytest.raises(TransferError, match="bounds check: a copy would write 8 bytes"):
        strided.copy_classes(bad, bounds=bufs)
    assert not dst.any()


@pytest.mark.slow
def test_the_property_under_malloc_check_and_the_bounds_mode():
    if os.environ.get("JRESHARD_CHECK_BOUNDS"):
        pytest.skip("already the child run")
    env = dict(os.environ, MALLOC_CHECK_="3", JRESHARD_CHECK_BOUNDS="1", JAX_PLATFORMS="cpu")
    debug = _malloc_debug()  # MALLOC_CHECK_ is a no-op on glibc >= 2.34 without it
    if debug is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, [debug, os.environ.get("LD_PRELOAD", "")]))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        __file__,
        "-k",
        "not malloc_check",
    ]
    run = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__))
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
