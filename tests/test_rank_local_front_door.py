"""The front door's multi-process path plans and schedules only the ranks a process drives.

Every function that plans the whole cluster (the whole plan, slicing it into rank programs, the
global schedule) is made to raise; transfers must still deliver every byte, in one process over
a transport that drives every rank, and under mpiexec where each process drives its own devices.
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
from jreshard.multi import transfer_multiprocess
from jreshard.nccl.buffers import BufferBackend, CpuBuffers
from jreshard.nccl.local import LocalComm
from jreshard.sharding.topology import Topology

sys.path.insert(0, str(BODIES))
from no_whole_plan import WholePlanCalled, guard


def test_the_guard_catches_the_whole_plan(monkeypatch):
    guard(monkeypatch.setattr)
    src = jreshard.Layout.from_mesh(np.arange(2), ("x",), ("x",), (8,), "float32")
    dst = jreshard.Layout.replicated(range(2, 4), (8,), "float32")
    with pytest.raises(WholePlanCalled):
        jreshard.plan([src], [dst], jreshard.Topology.uniform(range(4), domain_size=2))


def test_transfer_over_a_transport_builds_no_whole_plan(monkeypatch):
    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
    dst = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    x = {"a": jax.device_put(jnp.arange(32.0).reshape(8, 4), src), "b": jax.device_put(jnp.ones((16, 2)), src)}
    programmed = guard(monkeypatch.setattr)
    out = transfer_multiprocess(
        x,
        {"a": dst, "b": dst},
        topology=Topology.uniform(range(8), domain_size=4),
        options=jreshard.Options(chunk_bytes=64, staging_bytes=4096),
        transport=LocalComm(range(8)),
    )
    for k in x:
        for a, b in zip(out[k].addressable_shards, jax.device_put(x[k], dst).addressable_shards, strict=True):
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    assert sorted(set(programmed)) == list(range(8))


@pytest.mark.mpi
@pytest.mark.parametrize(("procs", "devices"), [(2, 2), (4, 1)])
def test_each_process_plans_only_its_own_ranks(tmp_path, procs, devices):
    need_mpi()
    launch([program(procs, "rank_local_transfer.py")], tmp_path, devices=devices, timeout_s=150)
    got = results(tmp_path, "ranklocal")
    assert sorted(got) == list(range(procs))
    for r in got.values():
        assert "error" not in r, r["error"]
        assert r["programmed"] and set(r["programmed"]) <= set(r["mine"])  # its own devices, never a peer's
    assert sum(r["checked"] for r in got.values()) > 0


class _DeviceLikeBuffers(BufferBackend):
    """Host buffers behind a backend that is not CpuBuffers, as NCCL's device buffers are."""

    def __init__(self):
        self.cpu = CpuBuffers()

    def export_source(self, shard):
        return self.cpu.export_source(shard)

    def writable_view(self, array):
        return self.cpu.writable_view(array)

    def allocate(self, sizes, device):
        return self.cpu.allocate(sizes, device)

    def import_shard(self, buffer, shape, dtype, device):
        return self.cpu.import_shard(buffer, shape, dtype, device)

    def staging(self, nbytes, device=None):
        return self.cpu.staging(nbytes, device)

    def pack(self, table, buffers, staging):
        self.cpu.pack(table, buffers, staging)

    def unpack(self, table, staging, buffers):
        self.cpu.unpack(table, staging, buffers)

    def copy(self, src_table, src, dst_table, dst):
        self.cpu.copy(src_table, src, dst_table, dst)


def test_device_buffers_keep_the_global_schedule(monkeypatch):
    """With buffers other than CpuBuffers (NCCL's) the mail is not built: the whole plan and the
    global schedule run, as the module docstring of jreshard.multi says."""
    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
    dst = NamedSharding(Mesh(devs[4:], ("tp",)), P(None, "tp"))
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), src)
    args = dict(topology=Topology.uniform(range(8), domain_size=4), transport=LocalComm(range(8)))
    out = transfer_multiprocess(x, dst, buffers=_DeviceLikeBuffers(), **args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    guard(monkeypatch.setattr)
    with pytest.raises(WholePlanCalled):
        transfer_multiprocess(x, dst, buffers=_DeviceLikeBuffers(), **args)
    transfer_multiprocess(x, dst, buffers=CpuBuffers(), **args)  # host buffers: rank-local, no whole plan
