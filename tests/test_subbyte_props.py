"""Every packed sub-byte dtype, random shapes and random sharding pairs: bit for bit what ``jax.device_put``
places, and never a byte outside a buffer.

Shapes have ranks 1 to 4 and odd or even last dimensions; shard extents are odd where the draw makes
them so, so packed rows and shards end in the middle of a byte. Source and target are NamedShardings
over 1-, 2- and 3-axis meshes of any subset and order of the 8 CPU devices (a dimension split over one
axis or two), or single devices.

The oracle is ``jax.device_put`` of the same values from the host onto the target. It is never
``jax.device_put`` of the device array: on XLA's CPU client (jax 0.10.2) a device-to-device move of a
packed array between device assignments runs a collective permute that copies one byte per value
into buffers holding two or four values a byte, overrunning them (valgrind: "Invalid write ... 0 bytes
after a block of size 2", in ``InProcessCommunicator::CollectivePermute``). jreshard never hands a
packed array to that path (``jreshard.call.repack``).

:func:`test_the_properties_under_malloc_check` runs this file again in a child process with glibc's
checking allocator loaded (``MALLOC_CHECK_=3`` takes effect only with ``libc_malloc_debug.so`` preloaded
on glibc 2.34 and later) and ``JRESHARD_CHECK_BOUNDS=1`` (every copy checked against its buffers). That child
draws the profile's full count of examples for both properties, checked bit for bit as here and under both
checkers; the parent draws at most :data:`_PARENT_EXAMPLES` (a quick check where the child is not run, e.g.
``-m "not slow"``), so a suite does not run the full count twice.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.sharding.dtypes import packed_bits
from tests._device_put_oracle import assert_same_as_device_put

DEVS = np.array(jax.devices())
PACKED = [jnp.int2, jnp.uint2, jnp.int4, jnp.uint4, jnp.float4_e2m1fn]
_MESHES = [(1,), (2,), (4,), (8,), (2, 2), (2, 4), (4, 2), (1, 2), (2, 2, 2)]
_CHILD = "JRESHARD_SUBBYTE_CHILD"
_PARENT_EXAMPLES = 5
_examples = (
    settings()
    if os.environ.get(_CHILD) == "1"
    else settings(max_examples=min(_PARENT_EXAMPLES, settings().max_examples))
)


@st.composite
def _sharding(draw, ndim):
    """A sharding for a rank-``ndim`` array, and per dimension the number of shards it cuts it into."""
    if draw(st.integers(0, 5)) == 0:
        return SingleDeviceSharding(DEVS[draw(st.integers(0, 7))]), [1] * ndim
    sizes = draw(st.sampled_from(_MESHES))
    n = math.prod(sizes)
    devices = draw(st.permutations(list(DEVS)))[:n]
    names = ("a", "b", "c")[: len(sizes)]
    mesh = Mesh(np.array(devices).reshape(sizes), names)
    free = list(names)
    spec, splits = [], []
    for _ in range(ndim):
        pick = draw(st.sampled_from([None, *free, *([tuple(free[:2])] if len(free) >= 2 else [])]))
        axes = () if pick is None else (pick,) if isinstance(pick, str) else pick
        for a in axes:
            free.remove(a)
        spec.append(pick)
        splits.append(math.prod(mesh.shape[a] for a in axes))
    return NamedSharding(mesh, P(*spec)), splits


@st.composite
def packed_case(draw):
    dtype = draw(st.sampled_from(PACKED))
    ndim = draw(st.integers(1, 4))
    src, s_splits = draw(_sharding(ndim))
    dst, d_splits = draw(_sharding(ndim))
    odd_last = draw(st.booleans())
    shape = []
    for d in range(ndim):
        split = math.lcm(s_splits[d], d_splits[d])
        k = draw(st.sampled_from([1, 3, 5, 7] if d == ndim - 1 and odd_last else [1, 2, 3, 5]))
        shape.append(split * k)
    if odd_last and shape[-1] % 2 == 0:  # a split last dimension: its shards are odd, the whole is even
        assert shape[-1] // math.lcm(s_splits[-1], d_splits[-1]) % 2 == 1
    return dtype, tuple(shape), src, dst, draw(st.integers(0, 2**31))


def _values(dtype, shape, seed):
    """Every bit pattern of ``dtype``, one value a byte (numpy's form of a packed dtype)."""
    raw = np.random.default_rng(seed).integers(0, 1 << packed_bits(np.dtype(dtype)), size=shape, dtype=np.uint8)
    return raw.view(np.dtype(dtype))


@_examples
@given(packed_case())
def test_packed_transfer_and_transfer_into_equal_device_put_from_the_host(case):
    dtype, shape, src, dst, seed = case
    host = _values(dtype, shape, seed)
    x = jax.device_put(host, src)
    want = jax.device_put(host, dst)
    got = jreshard.transfer(x, dst)
    assert_same_as_device_put(got, want)
    into = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=dst)()
    out = jreshard.transfer_into(x, into)
    assert_same_as_device_put(out, want)
    assert into.is_deleted()
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), host.view(np.uint8))  # x unchanged


@_examples
@given(packed_case())
def test_packed_leaves_in_one_pytree_with_others(case):
    """Packed leaves of every dtype beside a float32 leaf, in one call: each its own device_put."""
    _, shape, src, dst, seed = case
    hosts = {np.dtype(t).name: _values(t, shape, seed + i) for i, t in enumerate(PACKED)}
    hosts["float32"] = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x = {k: jax.device_put(v, src) for k, v in hosts.items()}
    got = jreshard.transfer(x, dst)
    for k, v in hosts.items():
        assert_same_as_device_put(got[k], jax.device_put(v, dst))


def test_the_case_first_reported_int2_rows_of_six():
    """int2 of shape (16, 6): rows of 12 bits, which do not end on a byte."""
    host = _values(jnp.int2, (16, 6), 0)
    a = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
    for b in (
        NamedSharding(Mesh(DEVS[4:6], ("y",)), P(None, "y")),
        NamedSharding(Mesh(DEVS[[5, 1]], ("y",)), P("y")),
        NamedSharding(Mesh(DEVS[:8].reshape(2, 4), ("y", "z")), P("z", "y")),
    ):
        assert_same_as_device_put(jreshard.transfer(jax.device_put(host, a), b), jax.device_put(host, b))


def _malloc_debug() -> str | None:
    """glibc's checking allocator, which ``MALLOC_CHECK_`` needs preloaded on glibc >= 2.34."""
    for path in (
        "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0",
        "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0",
        "/usr/lib64/libc_malloc_debug.so.0",
        "/usr/lib/aarch64-linux-gnu/libc_malloc_debug.so.0",
    ):
        if os.path.exists(path):
            return path
    return None


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(_CHILD) == "1", reason="the child run itself")
def test_the_properties_under_malloc_check():
    env = dict(os.environ, MALLOC_CHECK_="3", JRESHARD_CHECK_BOUNDS="1", JAX_PLATFORMS="cpu", **{_CHILD: "1"})
    env["HYPOTHESIS_PROFILE"] = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    debug = _malloc_debug()
    if debug is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, [debug, os.environ.get("LD_PRELOAD", "")]))
    elif sys.platform.startswith("linux"):
        import ctypes

        libc_version = ctypes.CDLL("libc.so.6").gnu_get_libc_version
        libc_version.restype = ctypes.c_char_p
        major, minor = (int(v) for v in libc_version().decode().split(".")[:2])
        assert (major, minor) < (2, 34), "glibc >= 2.34 without libc_malloc_debug.so: MALLOC_CHECK_ would be a no-op"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", __file__]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=root)
    tail = run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, tail
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) == 9 and "failed" not in run.stdout, tail


def test_byte_views_of_a_packed_buffer_are_refused():
    """The engine's byte views are sized one byte a value: of a packed buffer they would run past its end."""
    from jreshard.engine.buffers import export_source, writable_view
    from jreshard.errors import TransferError

    a = jax.device_put(_values(jnp.int2, (5,), 1), DEVS[1])
    for view in (export_source, writable_view):
        with pytest.raises(TransferError, match="packs values below a byte"):
            view(a)


@pytest.mark.parametrize("dtype", PACKED)
def test_packed_leaves_on_the_xla_backend(dtype):
    """backend='xla' moves the widened encoding too: the same bits as device_put from the host."""
    host = _values(dtype, (16, 6), 3)
    a = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
    b = NamedSharding(Mesh(DEVS[[6, 1]], ("y",)), P(None, "y"))
    got = jreshard.transfer(jax.device_put(host, a), b, options=jreshard.Options(backend="xla"))
    assert_same_as_device_put(got, jax.device_put(host, b))
