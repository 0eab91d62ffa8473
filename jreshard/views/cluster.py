"""``transfer`` of views in a multi-controller jax cluster: every process calls it with the same views.

The views name global arrays whose shards live in several processes (a
``jax.distributed`` cluster over MPI, as for :func:`jreshard.routes.transfer_multiprocess`).
Every process checks the call and lowers the views the same way (no communication),
then runs the pieces that touch its devices (:func:`jreshard.views.remote.run_pieces`):
copies inside the process, messages over MPI between processes, in the wire dtype,
each network byte once. Each process gets the global result arrays with its own
target shards filled (none: an array with no addressable shards), exactly as
``transfer_multiprocess`` returns them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jreshard.engine.buffers import CpuBuffers, export_source
from jreshard.engine.comm import Communicator
from jreshard.engine.driver import assemble
from jreshard.mpi.cluster import cluster_comm
from jreshard.mpi.comm import import_mpi
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder, ReportPhase
from jreshard.sharding.topology import Link, Topology
from jreshard.views.execute import _front, _lowerings, _np_dtype
from jreshard.views.quant import _Quant
from jreshard.views.remote import run_pieces

__all__ = ["transfer_cluster"]


def transfer_cluster(
    x: Any,
    target: Any,
    *,
    topology: Topology | None = None,
    options: Options | None = None,
    transport: Communicator | None = None,
    report: ReportBuilder | None = None,
) -> Any:
    """Materialise a pytree of views across the processes of the cluster (every process calls this).

    Args:
      x: views (and arrays) over global arrays.
      target: shardings or ``ShapeDtypeStruct`` s, as for :func:`jreshard.views.transfer`.
      topology: the fast-link domains (default: one per process).
      options: ``timeout_s`` bounds every wait on a peer.
      transport: the communicator between device ranks (default MPI over ``MPI.COMM_WORLD``).
      report: where the phases, bytes this process sent and messages go.

    Returns:
      The global result arrays; this process's target shards are filled.

    Raises:
      TransferTimeoutError: a peer did not answer within ``options.timeout_s``.
      LayoutMismatchError, LayoutError: as for :func:`jreshard.views.transfer`, on every process.
    """
    options = options or Options()
    builder = report or ReportBuilder(Backend.MPI)
    with builder.timed(ReportPhase.PLAN):
        treedef, views, shardings, srcs, layouts, dsts = _front(x, target, "transfer")
        lowerings, _ = _lowerings(views, srcs, layouts, dsts, topology)
    if transport is None:
        transport = cluster_comm(import_mpi().COMM_WORLD)
    mine = set(transport.local_ranks)
    with builder.timed(ReportPhase.BUFFERS):
        src, boxes = {}, {}
        for i, leaf in enumerate(srcs):
            for s in leaf.source.addressable_shards:
                r = s.device.id
                if r in mine and r in layouts[i].ranks:
                    box = layouts[i].box_of(r)
                    src[(i, r)] = export_source(s.data).view(layouts[i].np_dtype).reshape(box.shape)
                    boxes[(i, r)] = box
        cpu = CpuBuffers()
        outs: dict[tuple[int, int, int], np.ndarray] = {}
        regions: dict[tuple[int, int], Any] = {}  # aligned raw buffers of this process's target shards
        for t, (d, low, sh) in enumerate(zip(dsts, lowerings, shardings, strict=True)):
            for dev in sh.device_set:
                if dev.id in mine:
                    shape = d.box_of(dev.id).shape
                    (regions[(t, dev.id)],) = cpu.allocate([int(np.prod(shape)) * d.np_dtype.itemsize], dev)
                    outs[(t, dev.id, -1)] = regions[(t, dev.id)].view(d.np_dtype).reshape(shape)
            for k, task in enumerate(low.tasks):
                if task.dst_rank in mine and not task.at_sender:
                    quant = views[t]
                    assert isinstance(quant, _Quant)
                    outs[(t, task.dst_rank, k)] = np.empty(task.hull.shape, _np_dtype(quant.x.dtype))
    process_of = {d.id: d.process_index for d in jax.devices()}
    with builder.timed(ReportPhase.NETWORK):
        quants = {t: v for t, v in enumerate(views) if isinstance(v, _Quant)}
        stats = run_pieces(
            lowerings,
            transport,
            process_of,
            src,
            boxes,
            lambda t, r, k: outs[(t, r, k)],
            quants=quants,
            timeout_s=options.timeout_s,
        )
    with builder.timed(ReportPhase.UNPACK):
        for t, low in enumerate(lowerings):
            for k, task in enumerate(low.tasks):
                if task.dst_rank in mine and not task.at_sender:  # at the sender: quantised before sending
                    quant = views[t]
                    assert isinstance(quant, _Quant)
                    outs[(t, task.dst_rank, -1)][...] = quant.compute(outs[(t, task.dst_rank, k)], task.hull, task.box)
    with builder.timed(ReportPhase.BUFFERS):
        out = []
        for t, (d, sh) in enumerate(zip(dsts, shardings, strict=True)):
            here = {
                dev: cpu.import_shard(regions[(t, dev.id)], d.box_of(dev.id).shape, d.np_dtype, dev)
                for dev in sh.device_set
                if dev.id in mine
            }
            out.append(assemble(d.shape, d.np_dtype, sh, here))
    for link in (Link.NETWORK, Link.FAST, Link.LOCAL):
        builder.add_bytes(link, stats.bytes_by_link[link], messages=stats.messages if link is Link.NETWORK else 0)
    return treedef.unflatten(out)
