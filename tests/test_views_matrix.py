"""The views acceptance matrix: {plain arrays, float32 -> bfloat16 cast, fused qkv with GQA repeats, stacked
experts, block FP8 weights and scales} x {in process, ``transfer`` in a multi-controller cluster over MPI,
``RefitGroup`` between two programs (MPMD under mpiexec), NCCL through the engine's device-memory twin}.

Every destination shard is compared bit for bit with numpy (``jnp.astype`` for bfloat16) on the global
arrays, and the network bytes with the brute-force bound in the wire dtype, counted element by element
(``tests/mpi_bodies/views_cases.py``). The device-memory twin (``tests/mpi_bodies/device_like.py``) runs
every case the way the GPU buffers do, on CPU: casts through the CUDA cast kernel's launch tables and its
numpy index math, block FP8 through the host round trip of ``Buffers.download``/``upload``, and NCCL's rule
that only device memory goes on the wire; it is not a GPU run. The elastic column (a replica joining with
a recipe, another catching up from it as a peer, the same cases and checks) is ``tests/test_views_elastic.py``.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mpi_launch import BODIES, launch, need_mpi, program, results

import jreshard
from jreshard import Layout, Options, Topology, views
from jreshard.call.views import transfer_cluster
from jreshard.engine.recording import RecordingComm
from jreshard.sharding.topology import Link

sys.path.insert(0, str(BODIES))
from views_cases import SPECS, bits, build, globals_, network_bound, references

TOPO = Topology.uniform(range(8), domain_size=4)  # the trainer's 4 devices, the server's 4


def _meshes():
    devs = np.array(jax.devices())
    fsdp = NamedSharding(Mesh(devs[:4], ("f",)), P("f"))
    server = Mesh(devs[4:].reshape(2, 2), ("dp", "tp"))
    return fsdp, {k: NamedSharding(server, P(*s)) for k, s in SPECS.items()}


def _sources(fsdp):
    g = globals_()
    return g, {n: jax.device_put(a, fsdp) for n, a in g.items()}


def _layout(leaf):
    return Layout.from_sharding(leaf.source.sharding, leaf.shape, leaf.dtype)


def _check(out: dict, refs: dict, shardings: dict) -> int:
    n = 0
    for name, ref in refs.items():
        leaf = out[name]
        assert leaf.sharding == shardings[name] and leaf.dtype == ref.dtype and leaf.shape == ref.shape, name
        for s in leaf.addressable_shards:
            np.testing.assert_array_equal(bits(np.asarray(s.data)), bits(ref[s.index]), err_msg=name)
            n += 1
    return n


def test_in_process():
    fsdp, shardings = _meshes()
    g, x = _sources(fsdp)
    tree = {"w": x["w"], "c": x["c"], **build(views, x)}
    target = dict(shardings, c=jax.ShapeDtypeStruct(g["c"].shape, jnp.bfloat16, sharding=shardings["c"]))
    out, rep = jreshard.transfer(tree, target, topology=TOPO, report=True)
    assert _check(out, references(g), shardings) == 6 * 4
    tree["c"] = views.astype(x["c"], "bfloat16")
    dsts = {k: Layout.from_sharding(shardings[k], v.shape, v.dtype) for k, v in tree.items()}
    assert rep.network_bytes == network_bound(tree, _layout, dsts, TOPO) > 0
    # a ShapeDtypeStruct of another dtype on a plain array is device_put(x.astype(dtype)), bit for bit
    sds = jax.ShapeDtypeStruct(g["c"].shape, jnp.bfloat16, sharding=shardings["c"])
    got, want = jreshard.transfer(x["c"], sds), jax.device_put(x["c"].astype(jnp.bfloat16), shardings["c"])
    for a, b in zip(got.addressable_shards, want.addressable_shards, strict=True):
        np.testing.assert_array_equal(bits(np.asarray(a.data)), bits(np.asarray(b.data)))


@pytest.mark.mpi
def test_transfer_in_a_multicontroller_cluster(tmp_path):
    need_mpi()
    launch([program(2, "views_matrix.py", "cluster")], tmp_path, devices=2, timeout_s=120)
    got = results(tmp_path, "matrix-cluster")
    assert sorted(got) == [0, 1]
    for r in got.values():
        assert "error" not in r, r["error"]
        assert r["backend"] == "mpi" and 0 < r["peak_staging"] <= 2 * 256
    assert sum(r["checked"] for r in got.values()) == 6 * 4  # every target shard, once
    (bound,) = {r["bound"] for r in got.values()}
    assert sum(r["sent"] for r in got.values()) == bound > 0


@pytest.mark.mpi
def test_refit_group_between_two_programs(tmp_path):
    """A float32 FSDP trainer; a server declaring bfloat16 / FP8 leaves and a recipe of views over
    ``views.param``: two versions land bit-exact, the bytes sent equal the bound; a wrong server declaration
    is refused on every process of both sides, every problem listed."""
    need_mpi()
    launch(
        [program(2, "views_matrix.py", "refit", "source"), program(2, "views_matrix.py", "refit", "destination")],
        tmp_path,
        devices=2,
        timeout_s=120,
    )
    src, dst = results(tmp_path, "matrix-refit-source"), results(tmp_path, "matrix-refit-destination")
    assert len(src) == 2 and len(dst) == 2
    for r in (*src.values(), *dst.values()):
        assert "error" not in r, r["error"]
    (msg,) = {r["rejected"] for r in (*src.values(), *dst.values())}
    assert msg is not None and "no weights moved" in msg and "4 problems" in msg
    assert "parameter ['c']: source dtype float32 cannot be cast to destination dtype int32" in msg
    assert "recipe leaf ['qkv']: it reads source parameter ['q'] as shape (16, 12), but the source declares" in msg
    assert "recipe leaf ['qkv']: it reads ['kk'], which the source side does not declare" in msg
    assert "parameter ['k'] is declared by the source side only" in msg
    assert sum(r["checked"] for r in dst.values()) == 2 * 6 * 4  # two versions, every target shard
    (bound,) = {r["bound"] for r in dst.values()}
    (lowered,) = {r["lowered"] for r in dst.values()}
    assert sum(r["sent"] for r in (*src.values(), *dst.values())) == bound == lowered > 0


def test_nccl_through_the_device_memory_twin():
    """Every case of the matrix, and the bfloat16 qkv transposed, through the GPU path's logic on CPU: casts
    by the cast kernel's launch tables and index math, block FP8 by the host round trip through the buffers'
    download and upload, only device memory on the wire."""
    from device_like import DeviceLikeBuffers, DeviceOnlyComm

    fsdp, shardings = _meshes()
    g, x = _sources(fsdp)
    tree = {"w": x["w"], "c": views.astype(x["c"], "bfloat16"), **build(views, x)}
    tree["transposed"] = views.transpose(tree["qkv"])
    target = dict(shardings, transposed=NamedSharding(shardings["w"].mesh, P("tp", None)))
    options = Options(chunk_bytes=32, staging_bytes=128, max_group_ops=2)
    rec = RecordingComm(range(8), TOPO)
    buffers = DeviceLikeBuffers()
    out = transfer_cluster(
        tree, target, topology=TOPO, options=options, transport=DeviceOnlyComm(rec, buffers), buffers=buffers
    )
    refs = references(g)
    refs["transposed"] = refs["qkv"].T
    assert _check(out, refs, target) == 7 * 4
    dsts = {k: Layout.from_sharding(target[k], refs[k].shape, refs[k].dtype) for k in tree}
    assert rec.bytes_by_link()[Link.NETWORK] == network_bound(tree, _layout, dsts, TOPO) > 0
    assert 0 < rec.most_ops_in_a_group() <= 2
    assert buffers.staged and None not in buffers.staged  # every arena on its rank's device
    assert 0 < max(buffers.staged.values()) <= options.staging_bytes  # the staging bound, per rank
    assert buffers.cast_launches > 0 and buffers.cast_elements >= 3 * 16 * 8  # c, qkv and its transpose cast
    assert buffers.downloads > 0  # block FP8: quantised on the host, from downloaded bytes
