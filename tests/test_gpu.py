"""GPU tests (marker ``gpu``): DLPack round trips, bf16/fp8, stream ordering, the
pack/unpack kernel, and NCCL through the engine on one GPU.

They skip cleanly without CuPy, without a CUDA device, when jax has no GPU
backend (the suite defaults ``JAX_PLATFORMS`` to ``cpu``; ``benchmarks/gpu_check.py``
runs them with ``JAX_PLATFORMS=cuda,cpu``), and (the NCCL test) when CuPy's NCCL
did not load libnccl. Buffers are filled on the backend's stream, the one its
kernels run on (the pack stream for what packs read; a staging fill that an unpack
reads may go on the comm stream, which unpacks wait for), so no fill races a kernel.
The NCCL communicators they make are destroyed when the module ends. Not run on GPU yet: written against the CuPy and
jax documentation, and the calls checked against the installed modules by the
contract tests.

``JRESHARD_GPU_STANDIN=1`` (set by ``gpu_check.py --standin`` only) runs them against
the numpy stand-ins of ``tests/cupy_numpy.py`` on jax's CPU devices, at smaller sizes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from strategies import byte_shape

from jreshard.schedule import kernels as K
from jreshard.sharding.box import Box

pytestmark = pytest.mark.gpu


STANDIN = os.environ.get("JRESHARD_GPU_STANDIN") == "1"


@pytest.fixture(scope="module")
def env():
    """``(cupy, jax, first GPU)``, or a skip saying what is missing; destroys the NCCL
    communicators the module's tests made when it ends (not at interpreter exit)."""
    import jax

    if STANDIN:
        from cupy_numpy import install

        cupy, device = install(), jax.devices()[0]
    else:
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
    from jreshard.nccl.cupy_nccl import destroy_cached_communicators

    destroy_cached_communicators()
    if STANDIN:  # the stand-in's check of stream order: no access raced one it conflicts with
        assert cupy.cuda.standin.order.races == []


def upload(cupy, bufs, ordinal: int, host: np.ndarray):
    """``host`` copied to GPU ``ordinal`` on the backend's pack stream there (ordered before its packs)."""
    with cupy.cuda.Device(ordinal), bufs.streams.pack(ordinal):
        return cupy.asarray(host)


def zeros_on(cupy, bufs, ordinal: int, n: int):
    """``n`` zero bytes on GPU ``ordinal``, written on the backend's pack stream there."""
    with cupy.cuda.Device(ordinal), bufs.streams.pack(ordinal):
        return cupy.zeros(n, cupy.uint8)


def nccl_or_skip():
    """``cupy.cuda.nccl``, or a skip when CuPy imports without libnccl (it says so in ``available``)."""
    from jreshard.errors import BackendUnavailableError
    from jreshard.nccl.nccl_support import import_cupy

    try:
        return import_cupy("cupy.cuda.nccl")
    except BackendUnavailableError as err:
        pytest.skip(str(err))


@pytest.fixture
def bufs(env):
    from jreshard.cuda.buffers import CupyBuffers

    b = CupyBuffers()
    yield b
    b.synchronize()
    b.release()


def test_export_is_zero_copy_and_holds_the_bytes(env, bufs):
    cupy, jax, gpu = env
    x = jax.device_put(np.arange(4096, dtype=np.float32).reshape(64, 64), gpu)
    view = bufs.export_source(x)
    assert view.dtype == cupy.uint8 and view.size == x.nbytes
    assert view.data.ptr == x.unsafe_buffer_pointer()  # no copy
    bufs.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(view), np.asarray(x).reshape(-1).view(np.uint8))
    assert bufs.release() == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16", "int8", "bool"])
def test_round_trip_through_cupy_bytes_keeps_dtype_and_aliases(env, bufs, dtype):
    cupy, jax, gpu = env
    import ml_dtypes  # noqa: F401 - registers bfloat16/float8 with numpy

    host = (np.arange(2 * 3 * 256) % 7).astype(np.float32).reshape(2, 3, 256).astype(np.dtype(dtype))
    x = jax.device_put(host, gpu)
    src = bufs.export_source(x)
    (dst,) = bufs.allocate([x.nbytes], gpu)
    assert dst.data.ptr % 256 == 0
    with cupy.cuda.Device(gpu.local_hardware_id), bufs.streams.pack(gpu.local_hardware_id):
        dst[:] = src  # on the pack stream, which the export made wait for device_put
    y = bufs.import_shard(dst, x.shape, np.dtype(dtype), gpu)
    assert y.dtype == np.dtype(dtype) and y.devices() == {gpu}
    assert y.unsafe_buffer_pointer() == dst.data.ptr  # imported without a copy
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), host.view(np.uint8))


def test_export_waits_for_a_pending_jax_computation(env, bufs):
    cupy, jax, gpu = env
    import jax.numpy as jnp

    @jax.jit
    def slow(a):
        for _ in range(20):
            a = jnp.tanh(a @ a) * 0.5
        return a + 1.0

    n = 256 if STANDIN else 4096
    a = jax.device_put(np.eye(n, dtype=np.float32) * 0.1, gpu)
    y = slow(a)  # dispatched, still running on the GPU
    view = bufs.export_source(y)  # must not block the host, and must order after `slow`
    (stage,) = bufs.allocate([n * 4], gpu)
    t = K.build_table([(0, (n, n * 4), Box((7, 0), (8, n * 4)))])
    bufs.pack(t, [view], stage)  # on the export stream: after the computation
    bufs.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(stage), np.asarray(y)[7].view(np.uint8))


@pytest.mark.parametrize("seed", range(6))
def test_pack_unpack_kernels_match_numpy(env, bufs, seed):
    cupy, _, gpu = env
    rng = np.random.default_rng(seed)
    itemsize = int(rng.choice([1, 2, 4, 8]))
    shape = tuple(int(v) for v in rng.integers(2, 40, size=3))
    outer = byte_shape(shape, itemsize)
    host = rng.integers(0, 256, size=int(np.prod(outer)), dtype=np.uint8)
    pieces, taken = [], []
    for _ in range(8):
        lo = [int(rng.integers(0, n)) for n in shape]
        box = Box(tuple(lo), tuple(int(rng.integers(x + 1, n + 1)) for x, n in zip(lo, shape, strict=True)))
        if all(box.hi[d] <= o.lo[d] or o.hi[d] <= box.lo[d] for o in taken for d in range(3)):
            taken.append(box)
            pieces.append((0, outer, K.byte_box(box, itemsize)))
    table = K.build_table(pieces)
    o = gpu.local_hardware_id
    dev = upload(cupy, bufs, o, host)
    stage = zeros_on(cupy, bufs, o, K.table_bytes(table))
    want = np.zeros(K.table_bytes(table), np.uint8)
    K.pack_cpu(table, [host], want)
    bufs.pack(table, [dev], stage)
    bufs.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(stage), want)
    fresh = rng.integers(0, 256, size=want.size, dtype=np.uint8)
    expected = host.copy()
    K.unpack_cpu(table, fresh, [expected])
    with cupy.cuda.Device(o):
        stage.set(fresh, stream=bufs.stream(o))
    bufs.unpack(table, stage, [dev])
    bufs.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(dev), expected)


@pytest.mark.parametrize("stream_ordered", [False, True])
def test_one_gpu_nccl_sends_to_itself_through_the_engine(env, stream_ordered):
    """Ranks 0 (source) and 1, 2 (destination, split by columns) are different devices to
    the planner, so it plans FAST messages; NcclComm maps all three to the one GPU's NCCL
    rank 0, which sends to and receives from itself inside one group; with the host waiting
    after every exchange, and stream-ordered (``NcclComm.buffers()``)."""
    cupy, jax, gpu = env
    nccl_or_skip()
    from schedule_oracle import build_schedule

    from jreshard.cuda.buffers import CupyBuffers
    from jreshard.engine.rounds import Shards, execute
    from jreshard.nccl.cupy_nccl import NcclComm
    from jreshard.nccl.rendezvous import KeyValueRendezvous
    from jreshard.options import Options
    from jreshard.sharding.layout import Layout
    from jreshard.sharding.planner import plan_layouts
    from jreshard.sharding.topology import Topology

    shape = (256, 1024)
    src = Layout.from_boxes(shape, "float32", {0: Box((0, 0), shape)})
    dst = Layout.from_boxes(shape, "float32", {1: Box((0, 0), (256, 512)), 2: Box((0, 512), shape)})
    topo = Topology.from_domains({0: 0, 1: 0, 2: 0}, devices={0: 0, 1: 1, 2: 2})
    opts = Options(backend="nccl", chunk_bytes=128 << 10, staging_bytes=1 << 20, timeout_s=60.0)
    plan = plan_layouts([(src, dst)], topo, opts)
    assert plan.stats().fast_bytes == 256 * 1024 * 4
    o = gpu.local_hardware_id
    comm = NcclComm(
        devices={0: 0, 1: 0, 2: 0},
        local_devices={0: o, 1: o, 2: o},
        rendezvous=KeyValueRendezvous.in_process(),
        namespace=f"gpu-test-self-{stream_ordered}",
    )
    # Stream-ordered: no host wait per exchange, one bounded wait at the end of execute.
    bufs = comm.buffers(timeout_s=60.0) if stream_ordered else CupyBuffers(streams={o: comm.stream(0)})
    host = np.arange(256 * 1024, dtype=np.float32).reshape(shape)
    x = jax.device_put(host, gpu)
    d1, d2 = bufs.allocate([256 * 512 * 4, 256 * 512 * 4], gpu)
    with cupy.cuda.Device(o):
        execute(
            build_schedule(plan, opts),
            comm,
            Shards(src={(0, 0): bufs.export_source(x)}, dst={(0, 1): d1, (0, 2): d2}),
            options=opts,
            buffers=bufs,
        )
    y1 = bufs.import_shard(d1, (256, 512), np.dtype("float32"), gpu)
    y2 = bufs.import_shard(d2, (256, 512), np.dtype("float32"), gpu)
    np.testing.assert_array_equal(np.asarray(y1), host[:, :512])
    np.testing.assert_array_equal(np.asarray(y2), host[:, 512:])
    bufs.release()


def test_transfer_into_writes_into_the_donated_into_memory(env):
    """On GPUs in one process ``transfer_into`` writes into ``into``'s own memory: the results have
    its buffer pointers and ``into`` is consumed (under the stand-in, jax's CPU path does the same)."""
    _, jax, gpu = env
    import jax.numpy as jnp

    import jreshard

    x = {"big": jax.device_put(jnp.arange(256 * 1024, dtype=jnp.float32).reshape(256, 1024), gpu),
         "small": jax.device_put(jnp.arange(64, dtype=jnp.bfloat16), gpu)}  # fmt: skip
    into = {k: jax.device_put(jnp.zeros_like(v), gpu) for k, v in x.items()}
    before = {k: v.unsafe_buffer_pointer() for k, v in into.items()}
    out = jreshard.transfer_into(x, into)
    for k in x:
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(x[k]))
        assert out[k].unsafe_buffer_pointer() == before[k] and into[k].is_deleted()
