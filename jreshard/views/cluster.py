"""``transfer`` of views in a multi-controller jax cluster: every process calls it with the same views.

The views name global arrays whose shards live in several processes (a
``jax.distributed`` cluster over MPI, as for :func:`jreshard.routes.transfer_multiprocess`).
Every process checks the call and lowers the views the same way (no communication),
schedules the lowering as the engine's rounds (:func:`jreshard.schedule.viewsched.view_schedule`)
and runs its own ranks of them through the one round loop
(:func:`jreshard.engine.viewrun.run_view_schedule`) over the transport: chunks of at most
``Options.chunk_bytes`` in the wire dtype, cast while packing and unpacking, within
``staging_bytes``, groups of at most ``max_group_ops``, each network byte once. Each process
gets the global result arrays with its own target shards filled (none: an array with no
addressable shards), exactly as ``transfer_multiprocess`` returns them.
"""

from __future__ import annotations

from typing import Any

from jreshard._cache import register_clear
from jreshard.engine.buffers import Buffers, CpuBuffers
from jreshard.engine.comm import Communicator
from jreshard.engine.driver import assemble
from jreshard.engine.viewrun import run_view_schedule
from jreshard.mpi.cluster import cluster_comm
from jreshard.mpi.comm import import_mpi
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder, ReportPhase
from jreshard.schedule.viewsched import ViewSchedule, view_schedule
from jreshard.sharding.dtypes import storage_bytes
from jreshard.sharding.topology import Topology
from jreshard.views.execute import _front, lower_views
from jreshard.views.quant import _Quant

__all__ = ["transfer_cluster"]


_SCHEDULES: dict[tuple, ViewSchedule] = {}  # by the lowering's key and the chunking options
register_clear(_SCHEDULES.clear)


def _schedule(
    key: tuple, lowerings: Any, layouts: Any, dsts: Any, topology: Any, options: Options, quant: Any
) -> ViewSchedule:
    got = _SCHEDULES.get(key)
    if got is None:
        if len(_SCHEDULES) > 64:
            _SCHEDULES.clear()
        got = _SCHEDULES[key] = view_schedule(lowerings, layouts, dsts, topology, options, quant)
    return got


def transfer_cluster(
    x: Any,
    target: Any,
    *,
    topology: Topology | None = None,
    options: Options | None = None,
    transport: Communicator | None = None,
    buffers: Buffers | None = None,
    report: ReportBuilder | None = None,
) -> Any:
    """Materialise a pytree of views across the processes of the cluster (every process calls this).

    Args:
      x: views (and arrays) over global arrays.
      target: shardings or ``ShapeDtypeStruct`` s, as for :func:`jreshard.views.transfer`.
      topology: the fast-link domains (default: one per process).
      options: ``chunk_bytes``, ``staging_bytes`` and ``max_group_ops`` bound what each rank posts and holds;
        ``timeout_s`` bounds every wait on a peer.
      transport: the communicator between device ranks (default MPI over ``MPI.COMM_WORLD``; any
        transport the engine runs over: ``NcclComm`` with ``buffers=CupyBuffers``, ``LocalComm`` in one process).
      buffers: the buffer operations (default numpy on CPU).
      report: where the phases, bytes this process sent and messages go.

    Returns:
      The global result arrays; this process's target shards are filled.

    Raises:
      TransferTimeoutError: a peer did not answer within ``options.timeout_s``.
      LayoutMismatchError, LayoutError: as for :func:`jreshard.views.transfer`, on every process.
    """
    options = options or Options()
    builder = report or ReportBuilder(Backend.MPI)
    backend = buffers or CpuBuffers()
    with builder.timed(ReportPhase.PLAN):
        treedef, views, shardings, srcs, layouts, dsts = _front(x, target, "transfer")
        key, lowerings, topo = lower_views(views, srcs, layouts, dsts, topology)
        quant = tuple((v.part, v.block, v.x.dtype) if isinstance(v, _Quant) else None for v in views)
        sched_opts = (options.chunk_bytes, options.staging_bytes)
        vs = _schedule((key, sched_opts), lowerings, tuple(layouts), tuple(dsts), topo, options, quant)
    if transport is None:
        transport = cluster_comm(import_mpi().COMM_WORLD)
    mine = set(transport.local_ranks)
    with builder.timed(ReportPhase.BUFFERS):
        src = {}
        devices: dict[int, Any] = {}
        for i, leaf in enumerate(srcs):
            for s in leaf.source.addressable_shards:
                r = s.device.id
                if r in mine and r in layouts[i].ranks:
                    src[(i, r)] = backend.export_source(s.data)
                    devices[r] = s.device
        dst = {}
        for t, (d, sh) in enumerate(zip(dsts, shardings, strict=True)):
            for dev in sh.device_set:
                if dev.id in mine:
                    nbytes = storage_bytes(d.np_dtype, d.box_of(dev.id).volume)
                    (dst[(t, dev.id)],) = backend.allocate([nbytes], dev)
                    devices[dev.id] = dev
    run_view_schedule(
        vs,
        views,
        layouts,
        dsts,
        transport,
        src,
        dst,
        options=options,
        buffers=backend,
        devices=devices,
        report=builder,
    )
    with builder.timed(ReportPhase.BUFFERS):
        out = []
        for t, (d, sh) in enumerate(zip(dsts, shardings, strict=True)):
            here = {
                dev: backend.import_shard(dst[(t, dev.id)], d.box_of(dev.id).shape, d.np_dtype, dev)
                for dev in sh.device_set
                if dev.id in mine
            }
            out.append(assemble(d.shape, d.np_dtype, sh, here))
    return treedef.unflatten(out)
