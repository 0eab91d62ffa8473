"""CupyBuffers' cast rows, against the numpy stand-in of CuPy that moves real bytes (``tests/cupy_numpy.py``).

None of it has run on a GPU. A table with byte rows and cast rows packs, unpacks and copies (on one
GPU, and between two GPUs without peer access, through staging) as ``kernels.pack_cpu``/``unpack_cpu``/
``copy_cpu`` do: the byte rows as copies or the byte kernel, the cast rows as one launch of the cast
kernel on the same stream; and every access is ordered after those it conflicts with.
"""

from __future__ import annotations

import numpy as np
import pytest
from cupy_numpy import NumpyCuda, make_cupy

from jreshard.cuda import buffers as gpu_buffers
from jreshard.schedule import kernels as K

ROWS, COLS = 6, 8


@pytest.fixture
def cp():
    cp = make_cupy(NumpyCuda(2))
    yield cp
    assert cp.cuda.standin.order.races == []


def host_f32() -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32) * 1000
    x[1, 3], x[2, 2], x[4, 5] = np.nan, np.inf, 1e-42
    return x


def mixed_table() -> np.ndarray:
    """Row 0 of a (6, 8) float32 shard as bytes, then columns 2..5 of rows 0..4, transposed, to bfloat16,
    then column 7 to int8 (staged right after the bfloat16 elements: an odd offset)."""
    (byte,) = K.element_rows([(0, 0, (32, 4), 4)], (1, COLS))
    (bf16,) = K.element_rows([(0, 8, (4, 32), 4)], (4, 5), ("float32", "bfloat16"), stage=32, staged_itemsize=2)
    (i8,) = K.element_rows([(0, 28, (32,), 4)], (ROWS,), ("float32", "int8"), stage=72, staged_itemsize=1)
    return np.concatenate([byte, bf16, i8])


def launches(cp) -> list[str]:
    return [e[2] for e in cp.cuda.standin.log if e[0] == "launch"]


def test_pack_and_unpack_cast_rows_with_the_cast_kernel(cp):
    bufs = gpu_buffers.CupyBuffers(cupy=cp)
    host = host_f32().reshape(-1).view(np.uint8)
    src = cp.asarray(host)
    table = mixed_table()
    stage = cp.zeros(72 + ROWS, cp.uint8)
    cp.cuda.Device(0).synchronize()
    cp.cuda.standin.log.clear()
    bufs.pack(table, [src], stage)
    bufs.synchronize()
    want = np.zeros(72 + ROWS, np.uint8)
    K.pack_cpu(table, [host], want)
    np.testing.assert_array_equal(cp.asnumpy(stage), want)
    assert launches(cp) == ["jreshard_cast"]  # the byte row is a plain copy, the cast rows one launch
    # back: the staged bfloat16 and int8 into float32 columns of another shard
    back = np.concatenate(
        [
            K.element_rows([(0, 0, (32, 4), 4)], (1, COLS))[0],
            K.element_rows([(0, 8, (4, 32), 4)], (4, 5), ("bfloat16", "float32"), stage=32, staged_itemsize=2)[0],
            K.element_rows([(0, 28, (32,), 4)], (ROWS,), ("int8", "float32"), stage=72, staged_itemsize=1)[0],
        ]
    )
    out = cp.zeros(host.size, cp.uint8)
    expect = np.zeros(host.size, np.uint8)
    K.unpack_cpu(back, want, [expect])
    cp.cuda.Device(0).synchronize()
    bufs.unpack(back, stage, [out])
    bufs.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), expect)


@pytest.mark.parametrize("peer", [True, False], ids=["peer", "through-staging"])
def test_copies_cast_on_one_gpu_and_between_two(cp, peer):
    if not peer:  # the stand-in's answer, as a GPU pair without peer access gives it
        cp.cuda.runtime.deviceCanAccessPeer = lambda device, peerDevice: False
    bufs = gpu_buffers.CupyBuffers(cupy=cp)
    host = host_f32().reshape(-1).view(np.uint8)
    with cp.cuda.Device(1):
        src = cp.asarray(host)
    with cp.cuda.Device(0):
        dst = cp.zeros(ROWS * COLS * 2, cp.uint8)  # a (6, 8) float16 shard
    pairs = [
        (0, 0, (32, 4), 4, 0, 0, (16, 2), 2, (1, COLS), ("float32", "float16")),  # row 0
        (0, 40, (4, 32), 4, 0, 20, (2, 16), 2, (3, 4), ("float32", "float16")),  # a transposed block
    ]
    src_rows, dst_rows = [], []
    for sb, so, ss, si, db, do, ds, di, ext, chain in pairs:
        s, d = K.element_rows([(sb, so, ss, si), (db, do, ds, di)], ext, chain)
        src_rows.append(s)
        dst_rows.append(d)
    st, dt = np.concatenate(src_rows), np.concatenate(dst_rows)
    want = np.zeros(ROWS * COLS * 2, np.uint8)
    K.copy_cpu(st, [host], dt, [want])
    for d in (0, 1):
        cp.cuda.Device(d).synchronize()
    cp.cuda.standin.log.clear()
    bufs.copy(st, [src], dt, [dst])
    bufs.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(dst), want)
    assert "jreshard_cast" in launches(cp)
    assert ("memcpy" in [e[0] for e in cp.cuda.standin.log]) == (not peer)  # the peer copy of the staged bytes


def test_the_views_matrix_through_cupy_buffers_on_the_numpy_standin():
    """Every case of the views acceptance matrix through ``CupyBuffers`` itself (casts by the cast kernel's
    launches, block FP8 through its ``download``/``upload``) and in-process GPU copies, on jax's CPU devices
    standing in for 8 GPUs: bit-exact, every access stream-ordered."""
    import sys

    import jax
    from cupy_numpy import install, uninstall
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from mpi_launch import BODIES

    from jreshard import Options, Topology, views
    from jreshard.call.views import transfer_cluster
    from jreshard.cuda.buffers import CupyBuffers
    from jreshard.local.gpu import CupyLocalComm

    sys.path.insert(0, str(BODIES))
    from views_cases import SPECS, bits, build, globals_, references

    cp = install(ndev=8)
    try:
        devs = np.array(jax.devices())
        fsdp = NamedSharding(jax.sharding.Mesh(devs[:4], ("f",)), P("f"))
        server = jax.sharding.Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
        target = {k: NamedSharding(server, P(*s)) for k, s in SPECS.items()}
        g = globals_()
        x = {n: jax.device_put(a, fsdp) for n, a in g.items()}
        tree = {"w": x["w"], "c": views.astype(x["c"], "bfloat16"), **build(views, x)}
        bufs = CupyBuffers(cupy=cp, timeout_s=10.0)
        cp.cuda.standin.log.clear()
        out = transfer_cluster(
            tree,
            target,
            topology=Topology.uniform(range(8), domain_size=4),
            options=Options(chunk_bytes=32, staging_bytes=128, max_group_ops=2),
            transport=CupyLocalComm([d.id for d in devs], bufs),
            buffers=bufs,
        )
        refs = references(g)
        checked = 0
        for name, ref in refs.items():
            assert out[name].dtype == ref.dtype and out[name].sharding == target[name], name
            for s in out[name].addressable_shards:
                np.testing.assert_array_equal(bits(np.asarray(s.data)), bits(ref[s.index]), err_msg=name)
                checked += 1
        assert checked == 6 * 4
        assert "jreshard_cast" in [e[2] for e in cp.cuda.standin.log if e[0] == "launch"]
        bufs.release()
    finally:
        uninstall()
    assert cp.cuda.standin.order.races == []
