"""The front door's multi-process path plans and schedules only the ranks a process drives.

Every function that plans the whole cluster (the whole plan, slicing it into rank plans, the
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
from jreshard.call.routes import transfer_multiprocess
from jreshard.engine.loopback import LocalComm
from jreshard.sharding.topology import Topology

sys.path.insert(0, str(BODIES))
from device_like import DeviceLikeBuffers, DeviceOnlyComm, HostMemoryOnTheWire
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
    planned_ranks = guard(monkeypatch.setattr)
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
    assert sorted(set(planned_ranks)) == list(range(8))


@pytest.mark.mpi
@pytest.mark.parametrize(("procs", "devices", "memory"), [(2, 2, "host"), (4, 1, "host"), (2, 2, "device")])
def test_each_process_plans_only_its_own_ranks(tmp_path, procs, devices, memory):
    """``device``: the buffers are device-like and the MPI transport takes only their memory."""
    need_mpi()
    launch([program(procs, "per_process_transfer.py", memory)], tmp_path, devices=devices, timeout_s=150)
    got = results(tmp_path, "perprocess")
    assert sorted(got) == list(range(procs))
    for r in got.values():
        assert "error" not in r, r["error"]
        assert r["planned_ranks"] and set(r["planned_ranks"]) <= set(r["mine"])  # its own devices, never a peer's
    assert sum(r["checked"] for r in got.values()) > 0
    if memory == "device":
        assert all(r["mail_ops"] > 0 and r["chunk_ops"] > 0 for r in got.values())


def test_device_buffers_carry_the_mail_and_no_whole_plan_is_built(monkeypatch):
    """With a backend other than CpuBuffers (NCCL's device buffers) over a transport that, like NCCL,
    takes only that backend's memory, the scheduling mail travels in it too: per-process, bit-exact."""
    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
    dst = NamedSharding(Mesh(devs[2:6].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    x = {"a": jax.device_put(jnp.arange(64.0).reshape(8, 8), src), "b": jax.device_put(jnp.ones((16, 4)), src)}
    planned_ranks = guard(monkeypatch.setattr)
    buffers = DeviceLikeBuffers()
    comm = DeviceOnlyComm(LocalComm(range(8)), buffers)
    out = transfer_multiprocess(
        x,
        {"a": dst, "b": dst},
        topology=Topology.uniform(range(8), domain_size=4),
        options=jreshard.Options(chunk_bytes=64, staging_bytes=4096),
        transport=comm,
        buffers=buffers,
    )
    for k in x:
        for a, b in zip(out[k].addressable_shards, jax.device_put(x[k], dst).addressable_shards, strict=True):
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    assert comm.mail_ops > 0 and comm.chunk_ops > 0
    assert buffers.uploads > 0 and buffers.downloads > 0
    assert sorted(set(planned_ranks)) == list(range(8))


def test_the_device_only_transport_refuses_host_mail():
    """The twin above can fail: mail built in host memory (the host path's mail) is refused by it."""
    from jreshard.engine.mail import comm_mail
    from jreshard.schedule.pairsched import COUNT_OUT

    buffers = DeviceLikeBuffers()
    comm = DeviceOnlyComm(LocalComm(range(2)), buffers)
    payload = {(0, 1, COUNT_OUT): np.array([1, 0], np.int64)}
    with pytest.raises(HostMemoryOnTheWire):
        comm_mail(comm, 5.0)(payload, {(0, 1, COUNT_OUT): 2})
    got = comm_mail(comm, 5.0, buffers=buffers)(payload, {(0, 1, COUNT_OUT): 2})
    assert got[(0, 1, COUNT_OUT)].tolist() == [1, 0] and comm.mail_ops == 2
