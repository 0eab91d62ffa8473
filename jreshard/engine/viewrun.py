"""Run a views schedule (:mod:`jreshard.schedule.viewsched`) through the one round loop, over any transport.

The schedule is the engine's own (:class:`~jreshard.schedule.steps.Schedule`): this module
gives :func:`jreshard.engine.rounds.execute` the shard buffers it names and runs the two
jobs around the rounds that block FP8 needs, on the host in numpy
(:mod:`jreshard.views.quant`):

- before the rounds, each carrier quantises the blocks it sends (``Encode``) into its
  auxiliary source buffer, which the rounds then move as bytes;
- after them, each receiver quantises the tiles of whole blocks that landed in its auxiliary
  destination buffer (``Tile``) into its shard.

Every cast and permutation runs inside the buffers' pack, unpack and copy of the
descriptor tables: numpy on CPU (the compiled float32 <-> bfloat16 kernels where built),
the CUDA cast kernel on GPUs (:mod:`jreshard.cuda.casts`).

The quantisation jobs are a host round trip through the :class:`~jreshard.engine.buffers.Buffers`
interface, the same on every backend: wait for the buffers (:meth:`~jreshard.engine.buffers.Buffers.synchronize`),
:meth:`~jreshard.engine.buffers.Buffers.download` the bytes a job reads (the span of the source box, or the tile
buffer), quantise in numpy, :meth:`~jreshard.engine.buffers.Buffers.upload` the result (the auxiliary source buffer
itself; a destination shard through one byte copy from the uploaded bytes), and wait again
before the uploaded bytes are read or dropped. On CPU buffers a download is the buffer
itself and an upload is the host array, so the only extra copy is of the tiles' shards. The
bytes on the wire are the same on every backend: the encoded blocks and the tiles' elements.
Not run on GPU; there it is a host round trip, not a kernel: each job's input crosses to the
host and its output back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.engine.buffers import Buffers, CpuBuffers, aligned_empty
from jreshard.engine.comm import Communicator
from jreshard.engine.deltarounds import DeltaRefit
from jreshard.engine.rounds import ExecStats, Shards, execute
from jreshard.options import Options
from jreshard.report import ReportBuilder, ReportPhase
from jreshard.schedule import kernels
from jreshard.schedule.viewsched import ViewSchedule
from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.sharding.layout import Layout
from jreshard.types import ByteBuffer
from jreshard.views.casts import cast_into
from jreshard.views.quant import QuantView

__all__ = ["run_view_schedule"]


def _typed(buf: np.ndarray, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A typed view of ``buf`` from byte ``offset`` (numpy checks it fits the buffer)."""
    return np.ndarray(shape, numpy_dtype(dtype), buffer=buf, offset=offset)


def _download_box(buffers: Buffers, buf: ByteBuffer, held: Box, box: Box, dtype: str) -> np.ndarray:
    """The elements of ``box`` of a C-ordered shard holding ``held``, on the host: the byte span from the
    box's first element to its last, downloaded, typed with the shard's strides."""
    item = numpy_dtype(dtype).itemsize
    rel = box.relative_to(held)
    strides = [item] * len(held.shape)
    for d in range(len(held.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * held.shape[d + 1]
    start = sum(lo * st for lo, st in zip(rel.lo, strides, strict=True))
    end = sum((hi - 1) * st for hi, st in zip(rel.hi, strides, strict=True)) + item
    span = buffers.download(buf[start:end])
    return np.ndarray(rel.shape, numpy_dtype(dtype), buffer=span, strides=tuple(strides))


def run_view_schedule(
    vs: ViewSchedule,
    views: Sequence[Any],
    layouts: Sequence[Layout],
    dsts: Sequence[Layout],
    comm: Communicator,
    sources: Mapping[tuple[int, int], Any],
    targets: Mapping[tuple[int, int], Any],
    *,
    options: Options,
    buffers: Buffers | None = None,
    devices: Mapping[int, Any] | None = None,
    report: ReportBuilder | None = None,
    delta: DeltaRefit | None = None,
) -> ExecStats:
    """Run this process's ranks (``comm.local_ranks``) of ``vs``.

    Args:
      vs: the schedule every process built from the same lowering.
      views: the destination leaves (the block-FP8 ones are quantised by the jobs around the rounds).
      layouts, dsts: the source and destination leaves' layouts.
      comm: the transport.
      sources: ``{(source leaf, rank): 1-D uint8 buffer}`` of this process's source shards.
      targets: ``{(destination leaf, rank): 1-D uint8 buffer}`` this process's destination shards, written.
      options: chunking, staging, ``timeout_s`` and ``max_group_ops``.
      buffers: buffer operations (default numpy on CPU).
      devices: ``{rank: jax device}`` for the staging arenas.
      report: where the engine adds phases, bytes per link, messages and staging.
      delta: send what changed since the receivers' bases (:mod:`jreshard.engine.deltarounds`).

    Raises:
      TransferError: a buffer the schedule needs is missing (nothing was written).
    """
    buffers = buffers or CpuBuffers()
    mine = set(comm.local_ranks)
    devices = devices or {}
    src: dict[tuple[int, int], Any] = dict(sources)
    dst: dict[tuple[int, int], Any] = dict(targets)
    for r, n in vs.aux_dst.items():
        if r in mine:
            (dst[(vs.aux, r)],) = buffers.allocate([n], devices.get(r))
    rep = report or ReportBuilder(options.backend)
    encodes = {r: jobs for r, jobs in vs.encode.items() if r in mine}
    with rep.timed(ReportPhase.PACK):
        if encodes:
            buffers.synchronize()  # the sources are written (on GPUs: their producers ran)
        for r, jobs in encodes.items():
            host = aligned_empty(vs.aux_src[r])
            host[:] = 0
            for e in jobs:
                p = e.piece
                quant = views[e.leaf]
                assert isinstance(quant, QuantView)
                held = layouts[p.leaf].box_of(p.src_rank)
                region = _download_box(buffers, src[(p.leaf, p.src_rank)], held, p.src_box, p.src_dtype)
                tile = np.empty(p.dst_box.shape, numpy_dtype(quant.x.dtype))
                cast_into(
                    tile, region.transpose(p.source_order).reshape(p.dst_box.shape), p.sender_casts + p.receiver_casts
                )
                out = quant.compute(tile, e.hull, e.box)
                _typed(host, e.offset, out.shape, quant.dtype)[...] = out
            src[(vs.aux, r)] = buffers.upload(host, devices.get(r))
        if encodes:
            buffers.synchronize()  # uploaded before the first pack reads them
    stats = execute(
        vs.schedule,
        comm,
        Shards(src=src, dst=dst),
        options=options,
        buffers=buffers,
        devices=devices,
        report=report,
        delta=delta,
    )
    with rep.timed(ReportPhase.UNPACK):
        _tiles(vs, views, dsts, buffers, dst, devices, mine)
    return stats


def _tiles(
    vs: ViewSchedule,
    views: Sequence[Any],
    dsts: Sequence[Layout],
    buffers: Buffers,
    dst: dict[tuple[int, int], Any],
    devices: Mapping[int, Any],
    mine: set[int],
) -> None:
    """Quantise the landed tiles into their shards (after the rounds, which end waiting for the buffers):
    each rank's tile buffer downloaded, each shard uploaded and copied into place as bytes."""
    uploaded = []
    for r, tiles in vs.tiles.items():
        if r not in mine:
            continue
        landed = buffers.download(dst[(vs.aux, r)])
        for k in tiles:
            quant = views[k.leaf]
            assert isinstance(quant, QuantView)
            tile = _typed(landed, k.offset, k.hull.shape, k.dtype)
            shard: Box = dsts[k.leaf].box_of(r)
            host = aligned_empty(shard.volume * numpy_dtype(dsts[k.leaf].dtype).itemsize)
            _typed(host, 0, shard.shape, dsts[k.leaf].dtype)[...] = quant.compute(tile, k.hull, k.box)
            uploaded.append((buffers.upload(host, devices.get(r)), dst[(k.leaf, r)], host.size))
    if not uploaded:
        return
    buffers.synchronize()  # the uploads landed before the copies read them
    for up, target, n in uploaded:
        whole = Box((0,), (n,))
        src_t, dst_t = kernels.build_copy_tables([(0, (n,), whole, 0, (n,), whole)])
        buffers.copy(src_t, [up], dst_t, [target])
    buffers.synchronize()  # copied before the uploaded bytes are dropped
