"""Run a views schedule (:mod:`jreshard.schedule.viewsched`) through the one round loop, over any transport.

The schedule is the engine's own (:class:`~jreshard.schedule.steps.Schedule`): this module
gives :func:`jreshard.engine.rounds.execute` the shard buffers it names and runs the two
jobs around the rounds that block FP8 needs, on the host in numpy
(:mod:`jreshard.views.quant`):

- before the rounds, each carrier quantises the blocks it sends (``Encode``) into its
  auxiliary source buffer, which the rounds then move as bytes;
- after them, each receiver quantises the tiles of whole blocks that landed in its auxiliary
  destination buffer (``Tile``) into its shard.

Every cast and permutation runs inside the backend's pack, unpack and copy of the
descriptor tables. The CPU backend casts there (numpy, the compiled float32 <-> bfloat16
kernels); the GPU backend has no cast kernel yet and quantisation needs host buffers, so
a backend whose buffers are not numpy arrays takes views without casts or block FP8
leaves (fused, stacked, sliced and transposed ones: byte rows), and is refused the rest
before any byte moves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.engine.buffers import BufferBackend, CpuBuffers
from jreshard.engine.comm import Communicator
from jreshard.engine.rounds import ExecStats, Shards, execute
from jreshard.errors import BackendUnavailableError
from jreshard.options import Options
from jreshard.report import ReportBuilder, ReportPhase
from jreshard.schedule import kernels
from jreshard.schedule.viewsched import ViewSchedule
from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.sharding.layout import Layout
from jreshard.views.casts import cast_into
from jreshard.views.quant import _Quant

__all__ = ["run_view_schedule"]


def _typed(buf: np.ndarray, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A typed view of ``buf`` from byte ``offset`` (numpy checks it fits the buffer)."""
    return np.ndarray(shape, numpy_dtype(dtype), buffer=buf, offset=offset)


def _casts_on(vs: ViewSchedule, ranks: set[int]) -> bool:
    """Whether a descriptor row of these ranks casts (the ``CAST`` column)."""
    sched = vs.schedule
    for r in ranks:
        tables = [t for step in sched.steps.get(r, {}).values() for t in (step.pack, step.unpack)]
        if r in sched.local:
            tables.append(sched.local[r][1])
        if any(len(t) and np.any(t[:, kernels.CAST]) for t in tables):
            return True
    return False


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
    backend: BufferBackend | None = None,
    devices: Mapping[int, Any] | None = None,
    report: ReportBuilder | None = None,
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
      backend: buffer operations (default numpy on CPU).
      devices: ``{rank: jax device}`` for the staging arenas.
      report: where the engine adds phases, bytes per link, messages and staging.

    Raises:
      BackendUnavailableError: block FP8 leaves, or casts, on a backend without host buffers (GPU).
      TransferError: a buffer the schedule needs is missing (nothing was written).
    """
    backend = backend or CpuBuffers()
    mine = set(comm.local_ranks)
    quant_jobs = any(r in mine for r in (*vs.encode, *vs.tiles))
    if quant_jobs and not isinstance(backend, CpuBuffers):
        raise BackendUnavailableError(
            f"views: block FP8 leaves are quantised in host memory, and backend {type(backend).__name__} keeps "
            "its buffers elsewhere. The fix is to quantise on the trainer's devices (jnp), then transfer"
        )
    if not isinstance(backend, CpuBuffers) and _casts_on(vs, mine):
        raise BackendUnavailableError(
            f"views: this schedule casts while packing and unpacking, and backend {type(backend).__name__} has no "
            "cast kernels yet (casts run in the CPU backend's pack and unpack). The fix is to cast on the trainer's "
            "devices (x.astype) and transfer the cast arrays, or to run the views on CPU devices"
        )
    devices = devices or {}
    src: dict[tuple[int, int], Any] = dict(sources)
    dst: dict[tuple[int, int], Any] = dict(targets)
    for r, n in vs.aux_src.items():
        if r in mine:
            (src[(vs.aux, r)],) = backend.allocate([n], devices.get(r))
    for r, n in vs.aux_dst.items():
        if r in mine:
            (dst[(vs.aux, r)],) = backend.allocate([n], devices.get(r))
    rep = report or ReportBuilder(options.backend)
    with rep.timed(ReportPhase.PACK):
        for r, jobs in vs.encode.items():
            if r not in mine:
                continue
            for e in jobs:
                p = e.piece
                quant = views[e.leaf]
                assert isinstance(quant, _Quant)
                held = layouts[p.leaf].box_of(p.src_rank)
                whole = _typed(src[(p.leaf, p.src_rank)], 0, held.shape, p.src_dtype)
                region = whole[(*p.src_box.relative_to(held).slices(), ...)]  # type: ignore[arg-type]
                tile = np.empty(p.dst_box.shape, numpy_dtype(quant.x.dtype))
                cast_into(
                    tile, region.transpose(p.source_order).reshape(p.dst_box.shape), p.sender_casts + p.receiver_casts
                )
                out = quant.compute(tile, e.hull, e.box)
                _typed(src[(vs.aux, r)], e.offset, out.shape, quant.dtype)[...] = out
    stats = execute(
        vs.schedule, comm, Shards(src=src, dst=dst), options=options, backend=backend, devices=devices, report=report
    )
    with rep.timed(ReportPhase.UNPACK):
        for r, tiles in vs.tiles.items():
            if r not in mine:
                continue
            for k in tiles:
                quant = views[k.leaf]
                assert isinstance(quant, _Quant)
                tile = _typed(dst[(vs.aux, r)], k.offset, k.hull.shape, k.dtype)
                shard: Box = dsts[k.leaf].box_of(r)
                _typed(dst[(k.leaf, r)], 0, shard.shape, dsts[k.leaf].dtype)[...] = quant.compute(tile, k.hull, k.box)
    return stats
