"""``transfer`` and ``transfer_into`` of pytrees of views: one front door, then the engine.

Front door (flatten, check every leaf and target before a byte moves) -> lowering
(:mod:`jreshard.views.lowering`), cached by the views' composition and layouts -> then:

- **in one process** (:func:`transfer`, :func:`transfer_into`): the copy tasks
  (:func:`jreshard.engine.viewcopy.compile_tasks`, cached with the lowering) ->
  destinations (``transfer``: warm blocks of the buffer pool; ``transfer_into``: the
  ``into`` arrays nothing else can see, donated as ``jax.jit`` donates, else fresh
  blocks) -> the engine's in-process copy executor
  (:func:`jreshard.engine.viewcopy.execute_pieces`: the tasks on the copy
  threads, reading zero-copy DLPack views of the source shards) -> the destination
  arrays, assembled zero-copy;
- **across the processes of a multi-controller cluster** (:func:`transfer_cluster`):
  every process lowers the views the same way (no communication), schedules the lowering
  as the engine's rounds (:func:`jreshard.schedule.viewsched.view_schedule`) and runs its
  own ranks of them through the one round loop (:func:`jreshard.engine.viewrun.run_view_schedule`)
  over the transport: chunks of at most ``Options.chunk_bytes`` in the wire dtype, cast
  while packing and unpacking, within ``staging_bytes``, groups of at most
  ``max_group_ops``, each network byte once. Each process gets the global result arrays
  with its own target shards filled (none: an array with no addressable shards), exactly as
  ``transfer_multiprocess`` returns them.

No global array is built on any device or on the host: a quantised leaf gathers, per
destination shard, only the blocks that shard needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jreshard.call.front import Call, LeafTarget, Mode
from jreshard.call.routes import cluster_transport
from jreshard.engine.arrays import fresh_shards, make_array
from jreshard.engine.buffers import Buffers, CpuBuffers, export_source, writable_view
from jreshard.engine.comm import Communicator
from jreshard.engine.driver import landed_array
from jreshard.engine.ownership import device_shards, remember_all, shard_addresses, take
from jreshard.engine.pool import BufferPool, default_pool
from jreshard.engine.put import batched_put, put_allowed
from jreshard.engine.viewcopy import CopyTasks, compile_tasks, execute_pieces
from jreshard.engine.viewrun import run_view_schedule
from jreshard.errors import BackendUnavailableError, LayoutError, LayoutMismatchError, TransferError
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder, ReportPhase
from jreshard.schedule.viewsched import ViewSchedule, view_schedule
from jreshard.sharding.caches import register_clear
from jreshard.sharding.dtypes import dtype_name, storage_bytes
from jreshard.sharding.jax import addressable_order
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Link, Topology
from jreshard.types import PyTree, Sharding, Target
from jreshard.views.algebra import Leaf, View, as_view
from jreshard.views.lowering import LeafLowering, lower_tree
from jreshard.views.quant import QuantView as _Quant

__all__ = ["lower_views", "run", "run_cluster", "transfer", "transfer_cluster", "transfer_into"]

_CACHE: dict[tuple, tuple[list[LeafLowering], CopyTasks, dict[int, tuple[int, ...]]]] = {}
register_clear(_CACHE.clear)
_LOWERED: dict[tuple, list[LeafLowering]] = {}
register_clear(_LOWERED.clear)


@dataclasses.dataclass(frozen=True, slots=True)
class _Sources:
    """The distinct source arrays a call's views read (each once, whatever the number of views over it),
    their layouts, and per leaf of the call the layout of its result."""

    leaves: list[Leaf]
    layouts: list[Layout]
    dsts: list[Layout]


def _front(call: Call) -> tuple[Call, _Sources]:
    """Check the call's leaves and targets (never flattening again); returns the call with its per-leaf
    :class:`~jreshard.call.front.LeafTarget` (sharding, dtype, the view that computes it) and the sources.

    Raises:
      LayoutError, LayoutMismatchError, TypeError: a bad target, an ``into`` of another dtype, a bad view.
    """
    what = "into" if call.mode is Mode.INTO else "transfer"
    resolved = []
    for i, (leaf, t) in enumerate(zip(call.leaves, call.targets, strict=True)):
        v = as_view(leaf, f"{what}: leaf {i}")
        if what == "into":
            if not isinstance(t, jax.Array):
                raise LayoutError(f"transfer_into: into leaf {i} is {type(t).__name__}, not a jax.Array")
            sh, dtype, shape = t.sharding, t.dtype, t.shape
        elif isinstance(t, jax.ShapeDtypeStruct):
            if t.sharding is None:
                raise LayoutError(f"transfer: target leaf {i} is a ShapeDtypeStruct without a sharding")
            sh, dtype, shape = t.sharding, t.dtype, t.shape
        elif isinstance(t, jax.sharding.Sharding):
            sh, dtype, shape = t, v.dtype, v.shape  # type: ignore[assignment]
        else:
            raise LayoutError(f"transfer: target leaf {i} is {t!r}; expected a jax Sharding or ShapeDtypeStruct")
        if tuple(shape) != v.shape:
            raise LayoutMismatchError(f"{what}: leaf {i} has shape {v.shape} but its target holds {tuple(shape)}")
        if what == "into" and dtype_name(dtype) != dtype_name(v.dtype):
            # An into array holds what it holds: a cast here would be silent, and after a view's own cast
            # a second rounding (float32 -> float16 -> bfloat16). The plain path refuses it the same way.
            have, want = dtype_name(v.dtype), dtype_name(dtype)
            raise LayoutMismatchError(
                f"transfer_into: leaf {i} is {'a view' if isinstance(leaf, View) else 'an array'} of "
                f"{have}{list(v.shape)} but into holds {want}{list(shape)}; transfer_into does not cast: the "
                f"fix is an into of {have}, or views.astype of the source array to {want} (one rounding)",
                src=(v.shape, have),
                dst=(tuple(shape), want),
                what="dtype",
            )
        resolved.append(LeafTarget(sh, dtype, v.astype(dtype)))
    leaves: dict[int, Leaf] = {}
    for r in resolved:
        for leaf in r.view.leaves():
            leaves.setdefault(id(leaf.source), leaf)
    srcs = list(leaves.values())
    for j, leaf in enumerate(srcs):
        a = leaf.source
        if not isinstance(a, jax.Array):
            raise LayoutError(f"{what}: source leaf {j} is {type(a).__name__}; transfer needs live jax.Arrays")
        if a.is_deleted():
            raise LayoutError(f"{what}: source leaf {j} has been deleted or donated; pass a live array")
    _check_cpu([(f"source leaf {j}", leaf.source.sharding) for j, leaf in enumerate(srcs)], what)
    _check_cpu([(f"target leaf {i}", r.sharding) for i, r in enumerate(resolved)], what)
    layouts = [Layout.from_sharding(leaf.source.sharding, leaf.shape, leaf.dtype) for leaf in srcs]
    dsts = [Layout.from_sharding(r.sharding, r.view.shape, r.view.dtype) for r in resolved]
    return call.with_targets(resolved), _Sources(srcs, layouts, dsts)


def _weak_types(call: Call) -> list[bool]:
    """Per leaf, the ``weak_type`` its result takes: a plain array's own where it is not cast (as
    ``jax.device_put`` keeps it); a view's result is strongly typed (as ``astype`` makes it)."""
    return [
        isinstance(leaf, jax.Array) and bool(leaf.weak_type) and dtype_name(r.view.dtype) == dtype_name(leaf.dtype)
        for leaf, r in zip(call.leaves, call.resolved, strict=True)
    ]


def _check_cpu(named: list[tuple[str, Any]], what: str) -> None:
    """Views run on CPU devices in one process.

    Raises:
      BackendUnavailableError: a sharding names a device of another platform.
    """
    for name, sh in named:
        other = sorted({d.platform for d in sh.device_set} - {"cpu"})
        if other:
            raise BackendUnavailableError(
                f"{what}: {name} is on {other[0]} devices; views run on CPU devices in one process today. "
                "The fix is to build the fused tree with jnp on the trainer's mesh, then jreshard.transfer it"
            )


def lower_views(
    views: list, srcs: list, layouts: list, dsts: list, topology: Topology | None
) -> tuple[tuple, list[LeafLowering], Topology]:
    """``(key, lowerings, topology)``: the lowering of every leaf (cached by ``key``: the views' composition,
    the layouts and the topology; default one fast-link domain per process)."""
    pos = {id(leaf.source): i for i, leaf in enumerate(srcs)}
    if topology is None:
        devices = {d for leaf in srcs for d in leaf.source.sharding.device_set}
        topology = Topology.from_devices(sorted(devices | _devices(dsts), key=lambda d: d.id))  # type: ignore[attr-defined]
    key = (tuple(v.signature(lambda leaf: pos[id(leaf.source)]) for v in views), tuple(layouts), tuple(dsts), topology)
    got = _LOWERED.get(key)
    if got is None:
        if len(_LOWERED) > 256:
            _LOWERED.clear()
        got = _LOWERED[key] = lower_tree(views, srcs, layouts, dsts, topology)
    return key, got, topology


def _lowerings(
    views: list, srcs: list, layouts: list, dsts: list, topology: Topology | None
) -> tuple[list[LeafLowering], CopyTasks, dict[int, tuple[int, ...]]]:
    """The lowering of every leaf, the copy tasks that run it in one process, and per source leaf the ranks
    whose shards they read, cached as the lowering is."""
    key, lowerings, _ = lower_views(views, srcs, layouts, dsts, topology)
    got = _CACHE.get(key)
    if got is None:
        if len(_CACHE) > 256:
            _CACHE.clear()
        read: dict[int, set[int]] = {}
        for low in lowerings:
            for p in [*low.pieces, *(p for t in low.tasks for p in t.pieces)]:
                read.setdefault(p.leaf, set()).add(p.src_rank)
        boxes = {(i, r): layouts[i].box_of(r) for i, ranks in read.items() for r in ranks}
        shapes = {(t, r): d.box_of(r).shape for t, d in enumerate(dsts) for r in d.ranks}
        wanted = {i: tuple(sorted(ranks)) for i, ranks in sorted(read.items())}
        got = _CACHE[key] = (lowerings, compile_tasks(lowerings, boxes, dst_shapes=shapes), wanted)
    return got


def _devices(dsts: list) -> set:
    ids = {r for d in dsts for r in d.ranks}
    return {d for d in jax.devices() if d.id in ids}


def _sources(wanted: dict[int, tuple[int, ...]], srcs: list[Leaf], layouts: list[Layout]) -> tuple[dict, dict]:
    """``(arrays, boxes)``: per ``(source leaf, rank)`` the pieces read (``wanted``: the ranks of each leaf), a
    read-only typed view of that shard (exported through DLPack, which waits until it is ready and keeps a
    donating computation off it while the view lives) and its box."""
    arrays, boxes = {}, {}
    for i, ranks in wanted.items():
        leaf, layout = srcs[i], layouts[i]
        shards = {d.id: a for d, a in device_shards(leaf.source)}
        dtype = layout.np_dtype
        for r in ranks:
            if r not in shards:
                raise TransferError(f"source leaf {i}: rank {r}'s shard is not addressable in this process")
            box = layout.box_of(r)
            arrays[(i, r)] = export_source(shards[r]).view(dtype).reshape(box.shape)
            boxes[(i, r)] = box
    return arrays, boxes


def _fresh(dsts: Sequence[Layout], pool: BufferPool) -> list[list[np.ndarray]]:
    """Fresh destination shards of every leaf (each leaf's in its layout's rank order): one pool block per
    distinct layout and slot, cut per leaf (:func:`~jreshard.engine.arrays.fresh_shards`)."""
    same: dict[Layout, list[int]] = {}
    for t, d in enumerate(dsts):
        same.setdefault(d, []).append(t)
    out: list[list[np.ndarray]] = [[] for _ in dsts]
    for d, leaves in same.items():
        for t, shards in zip(leaves, fresh_shards(d, len(leaves), pool)[1], strict=True):
            out[t] = shards
    return out


def transfer(
    x: Any,
    target: Target,
    *,
    topology: Topology | None = None,
    report: ReportBuilder | None = None,
    threads: int | None = None,
) -> Any:
    """Materialise a pytree of views (and arrays) in the target shardings, shard to shard.

    Args:
      x: a pytree whose leaves are views (:mod:`jreshard.views`) or ``jax.Array`` s.
      target: a ``jax.sharding.Sharding`` or ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``
        (a cast to ``dtype``), or a pytree of them matching ``x``.
      topology: the fast-link domains (default: one per process); decides which holder each piece reads.
      report: a builder that records the phases and bytes (``jreshard.transfer(..., report=True)``).
      threads: copy threads (``Options.copy_threads``); ``None``: every core.

    Returns:
      New committed ``jax.Array`` s, one per leaf, over fresh memory (never a source's).

    Raises:
      LayoutMismatchError: structure or shapes differ; LayoutError: a bad target or a deleted source;
      TypeError: a cast views do not support.
    """
    return run(Call.of(x, target, Mode.TRANSFER), topology=topology, report=report, threads=threads)


def run(
    call: Call, *, topology: Topology | None = None, report: ReportBuilder | None = None, threads: int | None = None
) -> Any:
    """Run one flattened call of views in this process (:func:`transfer` or :func:`transfer_into` by its mode)."""
    if call.mode is Mode.INTO:
        return _run_into(call, topology, report, threads)
    builder = report or ReportBuilder(Backend.LOCAL)
    with builder.timed(ReportPhase.PLAN):
        call, sources = _front(call)
        srcs, layouts, dsts = sources.leaves, sources.layouts, sources.dsts
        views, shardings = [r.view for r in call.resolved], [r.sharding for r in call.resolved]
        lowerings, copy_tasks, wanted = _lowerings(views, srcs, layouts, dsts, topology)
    pool = default_pool()
    fresh0 = pool.stats().fresh_bytes
    with builder.timed(ReportPhase.BUFFERS):
        arrays, boxes = _sources(wanted, srcs, layouts)
        bufs = _fresh(dsts, pool)
    with builder.timed(ReportPhase.COPY):
        try:
            execute_pieces(
                lowerings,
                copy_tasks,
                views,
                arrays,
                boxes,
                [dict(zip(d.ranks, b, strict=True)) for d, b in zip(dsts, bufs, strict=True)],
                threads,
            )
        except Exception as err:
            raise TransferError(f"transfer failed while copying ({type(err).__name__}: {err})") from err
    with builder.timed(ReportPhase.BUFFERS):
        del arrays
        weak = _weak_types(call)
        out = [_assemble(d, sh, b, w) for d, sh, b, w in zip(dsts, shardings, bufs, weak, strict=True)]
    _count(builder, lowerings)
    builder.add_fresh(pool.stats().fresh_bytes - fresh0)
    return call.unflatten(out)


def _assemble(d: Layout, sharding: Sharding, shards: list[np.ndarray], weak_type: bool = False) -> Any:
    """A global array over host shards (``d.ranks`` order), zero-copy on CPU."""
    slot = {r: k for k, r in enumerate(d.ranks)}
    devs = addressable_order(sharding)
    return make_array(d.shape, d.np_dtype, sharding, [shards[slot[dev.id]] for dev in devs], list(devs), weak_type)


def _count(builder: ReportBuilder, lowerings: Sequence[LeafLowering]) -> None:
    for low in lowerings:
        builder.add_bytes(Link.NETWORK, low.network_bytes)
        builder.add_bytes(Link.FAST, low.fast_bytes)
        builder.add_bytes(Link.SAME_DEVICE, low.same_device_bytes)


def transfer_into(
    x: Any,
    into: PyTree,
    *,
    topology: Topology | None = None,
    report: ReportBuilder | None = None,
    threads: int | None = None,
) -> Any:
    """Write a pytree of views into ``into`` (same structure, shapes and dtypes), consuming it.

    ``into`` is consumed as ``jax.jit(..., donate_argnums=...)`` consumes its arguments:
    an ``into`` leaf that nothing else can observe (not a source's memory, not another
    ``into`` leaf's) is donated and written in place; the others are left as they are and
    the result gets fresh memory (counted in ``TransferReport.not_in_place_bytes``). Use
    the returned arrays afterwards. Every check runs before a byte is written.

    Raises:
      LayoutMismatchError: structure or shapes differ.
      LayoutError: a bad ``into`` leaf or a deleted source.
      TransferError: a copy failed; the donated ``into`` arrays are consumed and the
        results were not returned (``destination_intact=False``).
    """
    return run(Call.of(x, into, Mode.INTO), topology=topology, report=report, threads=threads)


def _run_into(call: Call, topology: Topology | None, report: ReportBuilder | None, threads: int | None) -> Any:
    builder = report or ReportBuilder(Backend.LOCAL)
    with builder.timed(ReportPhase.PLAN):
        call, sources = _front(call)
        srcs, layouts, dsts = sources.leaves, sources.layouts, sources.dsts
        views, shardings = [r.view for r in call.resolved], [r.sharding for r in call.resolved]
        into_leaves = call.targets
        lowerings, copy_tasks, wanted = _lowerings(views, srcs, layouts, dsts, topology)
    pool = default_pool()
    fresh0 = pool.stats().fresh_bytes
    with builder.timed(ReportPhase.BUFFERS):
        arrays, boxes = _sources(wanted, srcs, layouts)
        src_ptrs = {p for leaf in srcs for p in shard_addresses(leaf.source)} - {0}
        weak = _weak_types(call)
        taken = take(into_leaves, range(len(into_leaves)), src_ptrs, builder, weak)
        bufs: list[dict[int, np.ndarray]] = []
        fresh: dict[int, list[np.ndarray]] = {}
        for t, d in enumerate(dsts):
            if t in taken.donated:
                a = taken.donated[t][0]
                shards = {dev.id: s for dev, s in device_shards(a)}
                dtype = d.np_dtype
                bufs.append({r: writable_view(shards[r]).view(dtype).reshape(d.box_of(r).shape) for r in d.ranks})
            else:
                fresh[t] = fresh_shards(d, 1, pool)[1][0]
                bufs.append(dict(zip(d.ranks, fresh[t], strict=True)))
                taken.count(builder, t, sum(b.nbytes for b in fresh[t]))
    with builder.timed(ReportPhase.COPY):
        try:
            execute_pieces(lowerings, copy_tasks, views, arrays, boxes, bufs, threads)
        except Exception as err:
            raise TransferError(
                f"transfer_into failed while copying ({type(err).__name__}: {err}); the into arrays were "
                "consumed and the results hold neither the old nor the new values",
                destination_intact=False,
            ) from err
    with builder.timed(ReportPhase.BUFFERS):
        del arrays, bufs
        out = [
            taken.donated[t][0] if t in taken.donated else _assemble(d, sh, fresh[t], weak[t])
            for t, (d, sh) in enumerate(zip(dsts, shardings, strict=True))
        ]
        remember_all([a for a, _ in taken.donated.values()], [p for _, p in taken.donated.values()], by_jax=True)
    _count(builder, lowerings)
    builder.add_fresh(pool.stats().fresh_bytes - fresh0)
    return call.unflatten(out)


_SCHEDULES: dict[tuple, ViewSchedule] = {}  # by the lowering's key and the chunking options
register_clear(_SCHEDULES.clear)


def _schedule(
    key: tuple, lowerings: Any, layouts: Any, dsts: Any, topology: Any, options: Options, quant: Any, pipelined: bool
) -> ViewSchedule:
    key = (key, pipelined)
    got = _SCHEDULES.get(key)
    if got is None:
        if len(_SCHEDULES) > 64:
            _SCHEDULES.clear()
        got = _SCHEDULES[key] = view_schedule(lowerings, layouts, dsts, topology, options, quant, pipelined=pipelined)
    return got


def transfer_cluster(
    x: Any,
    target: Target,
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
    call = Call.of(x, target, Mode.TRANSFER)
    return run_cluster(call, topology=topology, options=options, transport=transport, buffers=buffers, report=report)


def run_cluster(
    call: Call,
    *,
    topology: Topology | None = None,
    options: Options | None = None,
    transport: Communicator | None = None,
    buffers: Buffers | None = None,
    report: ReportBuilder | None = None,
) -> Any:
    """:func:`transfer_cluster` of one flattened call."""
    options = options or Options()
    builder = report or ReportBuilder(Backend.MPI)
    backend = buffers or CpuBuffers()
    with builder.timed(ReportPhase.PLAN):
        call, sources = _front(call)
        srcs, layouts, dsts = sources.leaves, sources.layouts, sources.dsts
        views, shardings = [r.view for r in call.resolved], [r.sharding for r in call.resolved]
        key, lowerings, topo = lower_views(views, srcs, layouts, dsts, topology)
        quant = tuple((v.part, v.block, v.x.dtype) if isinstance(v, _Quant) else None for v in views)
        if transport is None:
            transport = cluster_transport("mpi", options.timeout_s)
        sched_opts = (options.chunk_bytes, options.staging_bytes)
        vs = _schedule(
            (key, sched_opts), lowerings, tuple(layouts), tuple(dsts), topo, options, quant, transport.pipelines_packs
        )
    mine = set(transport.local_ranks)
    with builder.timed(ReportPhase.BUFFERS):
        src = {}
        devices: dict[int, Any] = {}
        for i, leaf in enumerate(srcs):
            ranks = layouts[i].ranks
            for dev, a in device_shards(leaf.source):
                if dev.id in mine and dev.id in ranks:
                    src[(i, dev.id)] = backend.export_source(a)
                    devices[dev.id] = dev
        made: dict[Any, list[int]] = {}  # device -> the leaves with a shard on it
        for t, sh in enumerate(shardings):
            for dev in addressable_order(sh):
                if dev.id in mine:
                    made.setdefault(dev, []).append(t)
                    devices[dev.id] = dev
        dst, landed = {}, {}
        for dev, leaves in made.items():  # one block per device for all its destination shards
            boxes = [dsts[t].box_of(dev.id) for t in leaves]
            sizes = [storage_bytes(dsts[t].np_dtype, b.volume) for t, b in zip(leaves, boxes, strict=True)]
            for t, box, buf in zip(leaves, boxes, backend.allocate(sizes, dev), strict=True):
                dst[(t, dev.id)] = buf
                landed[(t, dev.id)] = (buf, box.shape, dsts[t].np_dtype, dev)
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
        put = batched_put(put_allowed()) if isinstance(backend, CpuBuffers) else None  # (host buffers alone)
        weak = _weak_types(call)
        out = [
            landed_array(t, d.shape, d.np_dtype, sh, landed, backend, put, weak[t])
            for t, (d, sh) in enumerate(zip(dsts, shardings, strict=True))
        ]
    return call.unflatten(out)
