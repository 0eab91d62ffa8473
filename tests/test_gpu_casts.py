"""GPU tests (marker ``gpu``) of views' casts and block FP8 on the GPU path: the CUDA cast kernel against
:func:`jreshard.views.casts.cast` bit for bit, and cast and block-FP8 views through ``CupyBuffers`` on one GPU.

They skip cleanly without CuPy, without a CUDA device, or when jax has no GPU backend, as
``tests/test_gpu.py`` does. Not run on GPU yet. ``JRESHARD_GPU_STANDIN=1`` runs them against the numpy
stand-ins of ``tests/cupy_numpy.py`` on jax's CPU devices (where the cast kernel is its numpy model, so
only a GPU run checks the compiled kernel's bits; on CPU ``tests/test_cuda_casts.py`` checks its source).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from test_cuda_casts import oracle, patterns

from jreshard.schedule import kernels as K
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.views.casts import CAST_DTYPES

pytestmark = pytest.mark.gpu

STANDIN = os.environ.get("JRESHARD_GPU_STANDIN") == "1"


@pytest.fixture(scope="module")
def env():
    """``(cupy, jax, first GPU)``, or a skip saying what is missing."""
    import jax

    if STANDIN:
        from cupy_numpy import install, uninstall

        cupy = install()
        yield cupy, jax, jax.devices()[0]
        uninstall()
        assert cupy.cuda.standin.order.races == []
        return
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # ImportError, or a CUDA error without a driver or device
        pytest.skip(f"no usable CuPy/CUDA here ({type(err).__name__}: {err})")
    if count < 1:
        pytest.skip("CuPy sees no CUDA device")
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError as err:
        pytest.skip(f"jax has no GPU backend here ({err}); run with JAX_PLATFORMS=cuda,cpu")
    yield cupy, jax, device


@pytest.mark.parametrize("src,dst", list(itertools.product(CAST_DTYPES, CAST_DTYPES)))
def test_the_cast_kernel_on_the_gpu_is_views_casts_bit_for_bit(env, src, dst):
    from jreshard.cuda.buffers import CupyBuffers

    cupy, _, device = env
    bufs = CupyBuffers(cupy=cupy)
    o = int(device.local_hardware_id)
    bits = patterns(src)
    a, b = numpy_dtype(src).itemsize, numpy_dtype(dst).itemsize
    host = np.ascontiguousarray(bits.astype(f"uint{8 * a}")).view(np.uint8)
    (row,) = K.element_rows([(0, 0, (a,), a)], (len(bits),), (src, dst), staged_itemsize=b)
    with cupy.cuda.Device(o), bufs.streams.pack(o):
        x = cupy.asarray(host)
    staging = bufs.staging(len(bits) * b, device)
    bufs.pack(row, [x], staging)
    bufs.synchronize()
    got = bufs.download(staging).view(f"uint{8 * b}").astype(np.uint32)
    want = oracle(bits, (src, dst))
    bad = np.nonzero(got != want)[0]
    assert not len(bad), [(hex(int(bits[i])), hex(int(got[i])), hex(int(want[i]))) for i in bad[:8]]
    bufs.release()


def test_cast_and_block_fp8_views_on_one_gpu(env):
    """A float32 matrix cast to bfloat16 and quantised to block FP8 (weights and scales), on one GPU."""
    from jreshard import Options, Topology, views
    from jreshard.call.views import transfer_cluster
    from jreshard.cuda.buffers import CupyBuffers
    from jreshard.local.gpu import CupyLocalComm
    from jreshard.views import quantize_fp8_reference

    cupy, jax, device = env
    g = (np.sin(np.arange(16 * 16) * 0.37) * 50).astype(np.float32).reshape(16, 16)
    x = jax.device_put(g, device)
    w8, s8 = views.quantize_fp8(x, block=(4, 8))
    tree = {"c": views.astype(x, "bfloat16"), "w8": w8, "s8": s8}
    sharding = jax.sharding.SingleDeviceSharding(device)
    bufs = CupyBuffers(cupy=cupy)
    out = transfer_cluster(
        tree,
        dict.fromkeys(tree, sharding),
        topology=Topology.uniform([device.id], domain_size=1),
        options=Options(chunk_bytes=64, staging_bytes=1 << 12),
        transport=CupyLocalComm([device.id], bufs),
        buffers=bufs,
    )
    ref_w, ref_s = quantize_fp8_reference(g, (4, 8))
    import jax.numpy as jnp

    ref_c = np.asarray(jnp.asarray(g).astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(out["c"]).view(np.uint16), ref_c.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(out["w8"]).view(np.uint8), ref_w.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(out["s8"]), ref_s)
    bufs.release()
