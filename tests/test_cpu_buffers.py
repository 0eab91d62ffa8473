"""The CPU buffers the engine reads and writes: source exports (every dtype jax holds, zero-copy, pinned against
donation) and the pool's buffers for many shards at once."""

from __future__ import annotations

import gc
import itertools
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jreshard.engine.buffers import CpuBuffers, export_source
from jreshard.engine.pool import ALIGN, SHARED_BELOW, BufferPool
from jreshard.errors import TransferError

WHOLE_BYTE_DTYPES = [
    "bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32", "complex64", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float8_e3m4", "float8_e4m3",
]  # fmt: skip


def _dtype(name):
    return np.dtype(getattr(ml_dtypes, name, name))


@pytest.mark.parametrize("name", WHOLE_BYTE_DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (7,), ()])
def test_an_export_is_the_shards_own_bytes_read_only(name, shape):
    dtype = _dtype(name)
    raw = np.random.default_rng(len(name)).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    host = raw.view(dtype).reshape(shape)
    shard = jax.device_put(host, jax.devices()[1])
    view = export_source(shard)
    assert view.dtype == np.uint8 and view.ndim == 1 and not view.flags.writeable
    assert view.ctypes.data == shard.unsafe_buffer_pointer()
    assert view.tobytes() == np.asarray(shard).tobytes() == host.tobytes()


@pytest.mark.parametrize("name", ["int2", "uint2", "int4", "uint4", "float4_e2m1fn"])
def test_a_packed_dtype_is_refused_by_name(name):
    shard = jnp.zeros((4, 6), _dtype(name))
    with pytest.raises(TransferError, match=rf"export_source: a {name}\[4, 6\] buffer packs values below a byte"):
        export_source(shard)


def test_a_deleted_shard_raises_jaxs_own_error():
    shard = jnp.ones((4, 4))
    shard.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        export_source(shard)


def test_an_export_keeps_a_donating_computation_off_its_buffer():
    """While an export lives, a computation that donates the array writes its output elsewhere: the bytes the
    export reads stay the array's."""
    x = jax.device_put(np.arange(1024, dtype=np.float32), jax.devices()[0])
    view = export_source(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jax: "Some donated buffers were not usable"
        y = jax.jit(lambda v: v * 0 - 1, donate_argnums=0)(x)
    assert float(y[0]) == -1.0 and y.unsafe_buffer_pointer() != view.ctypes.data
    np.testing.assert_array_equal(view.view(np.float32), np.arange(1024, dtype=np.float32))


def test_many_small_buffers_share_one_lease_and_large_ones_have_their_own():
    pool = BufferPool()
    sizes = [100, 0, SHARED_BELOW, 64, 7, SHARED_BELOW + 1, 1]
    bufs = pool.take_many(sizes)
    assert [b.size for b in bufs] == sizes
    assert all(b.ctypes.data % ALIGN == 0 for b in bufs)
    small = [b for b, n in zip(bufs, sizes, strict=True) if n < SHARED_BELOW]
    ends = sorted((b.ctypes.data, b.ctypes.data + b.size) for b in small)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ends))  # disjoint
    assert pool.stats().misses == 3  # one block for the five small ones, one each for the two large
    for i, b in enumerate(bufs):
        b[:] = i
    assert [int(b[0]) for b in bufs if b.size] == [i for i, n in enumerate(sizes) if n]  # no buffer overlaps
    large, keep = bufs[2], bufs[0]
    del bufs, small, b
    gc.collect()
    assert pool.stats().retained_bytes == (SHARED_BELOW + 1 + ALIGN - 1) // ALIGN * ALIGN  # the large one let go
    del keep  # the last small buffer: the shared block comes back
    gc.collect()
    assert pool.stats().leased_bytes == SHARED_BELOW and large.size == SHARED_BELOW


def test_the_cpu_buffers_allocate_from_the_pool_they_were_given():
    pool = BufferPool()
    bufs = CpuBuffers(pool).allocate([10, 20, 30], jax.devices()[0])
    assert [b.size for b in bufs] == [10, 20, 30] and pool.stats().misses == 1
    with pytest.raises(ValueError, match=r"sizes\[1\]=-1"):
        pool.take_many([4, -1])
