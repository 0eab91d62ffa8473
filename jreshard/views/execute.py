"""transfer() and transfer_into() for pytrees of views, in one process.

Front door (flatten, check every leaf and target before a byte moves) -> lowering
(:mod:`jreshard.views.lowering`) and its program of copies
(:mod:`jreshard.views.program`), both cached by the views' composition and layouts ->
destinations (``transfer``: warm blocks of the buffer pool; ``transfer_into``: the
``into`` arrays nothing else can see, donated as ``jax.jit`` donates, else fresh
blocks) -> :func:`_execute_pieces` (the program's tasks on the copy threads, reading
zero-copy DLPack views of the source shards) -> the destination arrays, assembled
zero-copy. No global array is built on any device or on the host: a quantised leaf
gathers, per destination shard, only the blocks that shard needs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jreshard._cache import register_clear
from jreshard.engine import strided
from jreshard.engine.buffers import writable_view
from jreshard.engine.inprocess import _addresses_of, _arrays, _donate, _fresh, _make_array, _read, _remember
from jreshard.engine.pool import default_pool
from jreshard.errors import BackendUnavailableError, LayoutError, LayoutMismatchError, TransferError
from jreshard.options import Backend
from jreshard.report import ReportBuilder, ReportPhase
from jreshard.sharding.box import Box
from jreshard.sharding.jax import addressable_order
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Link, Topology
from jreshard.views.algebra import Leaf, View, as_view
from jreshard.views.casts import cast_into
from jreshard.views.lowering import LeafLowering, QuantTask, ViewPiece, lower_tree
from jreshard.views.program import Program, compile_program, run_task, task_elements
from jreshard.views.quant import _Quant

__all__ = ["transfer", "transfer_into"]

_CACHE: dict[tuple, tuple[list[LeafLowering], Program]] = {}
register_clear(_CACHE.clear)
_LOWERED: dict[tuple, list[LeafLowering]] = {}
register_clear(_LOWERED.clear)


def _is_view(x: Any) -> bool:
    return isinstance(x, View)


def _targets(views: list, treedef: Any, target: Any) -> list:
    if isinstance(target, (jax.sharding.Sharding, jax.ShapeDtypeStruct)):
        return [target] * len(views)
    try:
        return treedef.flatten_up_to(target)
    except (ValueError, TypeError) as err:
        raise LayoutMismatchError(f"target does not match the structure of the views: {err}") from None


def _front(x: Any, target: Any, what: str) -> tuple:
    """Flatten and check; returns (treedef, views, shardings, leaves, layouts, dst layouts)."""
    flat, treedef = jax.tree_util.tree_flatten(x, is_leaf=_is_view)
    tgts = _targets(flat, treedef, target)
    views, shardings = [], []
    for i, (leaf, t) in enumerate(zip(flat, tgts, strict=True)):
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
        views.append(v.astype(dtype))
        shardings.append(sh)
    leaves: dict[int, Leaf] = {}
    for v in views:
        for leaf in v.leaves():
            leaves.setdefault(id(leaf.source), leaf)
    srcs = list(leaves.values())
    for j, leaf in enumerate(srcs):
        a = leaf.source
        if not isinstance(a, jax.Array):
            raise LayoutError(f"{what}: source leaf {j} is {type(a).__name__}; transfer needs live jax.Arrays")
        if a.is_deleted():
            raise LayoutError(f"{what}: source leaf {j} has been deleted or donated; pass a live array")
    _check_cpu([(f"source leaf {j}", leaf.source.sharding) for j, leaf in enumerate(srcs)], what)
    _check_cpu([(f"target leaf {i}", sh) for i, sh in enumerate(shardings)], what)
    layouts = [Layout.from_sharding(leaf.source.sharding, leaf.shape, leaf.dtype) for leaf in srcs]
    dsts = [Layout.from_sharding(sh, v.shape, v.dtype) for v, sh in zip(views, shardings, strict=True)]
    return treedef, views, shardings, srcs, layouts, dsts


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
) -> tuple[list[LeafLowering], Program]:
    """The lowering of every leaf and the program that runs it in one process, cached as the lowering is."""
    key, lowerings, _ = lower_views(views, srcs, layouts, dsts, topology)
    got = _CACHE.get(key)
    if got is None:
        if len(_CACHE) > 256:
            _CACHE.clear()
        wanted = {(p.leaf, p.src_rank) for low in lowerings for p in low.pieces}
        boxes = {k: layouts[k[0]].box_of(k[1]) for k in wanted}
        shapes = {(t, r): d.box_of(r).shape for t, d in enumerate(dsts) for r in d.ranks}
        got = _CACHE[key] = (lowerings, compile_program(lowerings, boxes, dst_shapes=shapes))
    return got


def _devices(dsts: list) -> set:
    ids = {r for d in dsts for r in d.ranks}
    return {d for d in jax.devices() if d.id in ids}


def _execute_pieces(
    lowerings: Sequence[LeafLowering],
    program: Program,
    views: Sequence[View],
    src: Mapping[tuple[int, int], np.ndarray],
    src_box: Mapping[tuple[int, int], Box],
    dst: Sequence[Mapping[int, np.ndarray]],
    threads: int | None = None,
) -> None:
    """Run ``program`` (the lowerings' pieces) and the quantisation tasks: ``src[(leaf, rank)]`` is a
    typed read-only source shard holding ``src_box[(leaf, rank)]``; ``dst[t][rank]`` the typed
    destination shard of leaf ``t``; on ``threads`` threads (``Options.copy_threads``; ``None``: every core).

    A quantised leaf's pieces fill a tile of whole blocks per destination shard, quantised after.
    """

    def quantised(t: int, task: QuantTask) -> None:
        quant = views[t]
        assert isinstance(quant, _Quant)
        tile = np.empty(task.hull.shape, np.dtype(_np_dtype(quant.x.dtype)))
        for p in task.pieces:
            _copy_piece(p, src, src_box, tile)
        dst[t][task.dst_rank][...] = quant.compute(tile, task.hull, task.box)

    calls: list[tuple[int, Any, tuple]] = [(task_elements(t), run_task, (t, src, dst)) for t in program.tasks]
    calls += [(k.hull.volume, quantised, (t, k)) for t, low in enumerate(lowerings) for k in low.tasks]
    lanes = 1 if program.wire_bytes < _THREADED_BYTES else min(len(calls), strided.threads_for(threads))
    if lanes <= 1:
        for _, fn, args in calls:
            fn(*args)
        return
    # numpy and the compiled casts release the GIL; the tasks write disjoint boxes. Largest first, each
    # thread taking the next task as it finishes, so the threads finish together.
    calls.sort(key=lambda c: -c[0])
    strided.run_shared([functools.partial(fn, *args) for _, fn, args in calls], lanes)


_THREADED_BYTES = 4 << 20


def _np_dtype(name: str) -> np.dtype:
    from jreshard.sharding.dtypes import numpy_dtype

    return numpy_dtype(name)


def _copy_piece(p: ViewPiece, src: Mapping, src_box: Mapping, out: np.ndarray) -> None:
    """Copy piece ``p`` into ``out`` with its casts."""
    s = src[(p.leaf, p.src_rank)]
    o = src_box[(p.leaf, p.src_rank)].lo
    region = s[(*(slice(a - b, c - b) for a, c, b in zip(p.src_box.lo, p.src_box.hi, o, strict=True)), ...)]
    v = region.transpose(p.source_order).reshape(p.dst_box.shape)
    where: Any = (*p.dst_box.slices(), ...)  # "...": 0-d views stay arrays
    cast_into(out[where], v, p.sender_casts + p.receiver_casts)


def _sources(lowerings: list[LeafLowering], srcs: list[Leaf], layouts: list[Layout]) -> tuple[dict, dict]:
    wanted = {(p.leaf, p.src_rank) for low in lowerings for p in low.pieces}
    wanted |= {(p.leaf, p.src_rank) for low in lowerings for t in low.tasks for p in t.pieces}
    arrays, boxes = {}, {}
    for i, leaf in enumerate(srcs):
        ranks = sorted(r for (j, r) in wanted if j == i)
        if not ranks:
            continue
        order = addressable_order(leaf.source.sharding)
        shards = {d.id: a for d, a in zip(order, _arrays(leaf.source), strict=True)}
        for r in ranks:
            if r not in shards:
                raise TransferError(f"source leaf {i}: rank {r}'s shard is not addressable in this process")
            box = layouts[i].box_of(r)
            raw = writable_view(shards[r])  # waits until the shard is ready; the caller holds the source
            raw.flags.writeable = False  # a source is only read
            arrays[(i, r)] = raw.view(layouts[i].np_dtype).reshape(box.shape)
            boxes[(i, r)] = box
    return arrays, boxes


def transfer(
    x: Any,
    target: Any,
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
    builder = report or ReportBuilder(Backend.LOCAL)
    with builder.timed(ReportPhase.PLAN):
        treedef, views, shardings, srcs, layouts, dsts = _front(x, target, "transfer")
        lowerings, program = _lowerings(views, srcs, layouts, dsts, topology)
    pool = default_pool()
    fresh0 = pool.stats().fresh_bytes
    with builder.timed(ReportPhase.BUFFERS):
        arrays, boxes = _sources(lowerings, srcs, layouts)
        bufs = [_fresh(d, 1, pool)[1][0] for d in dsts]
    with builder.timed(ReportPhase.COPY):
        try:
            _execute_pieces(
                lowerings,
                program,
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
        out = [_assemble(d, sh, b) for d, sh, b in zip(dsts, shardings, bufs, strict=True)]
    _count(builder, lowerings)
    builder.add_fresh(pool.stats().fresh_bytes - fresh0)
    return treedef.unflatten(out)


def _assemble(d: Layout, sharding: Any, shards: list[np.ndarray]) -> Any:
    """A global array over host shards (``d.ranks`` order), zero-copy on CPU."""
    slot = {r: k for k, r in enumerate(d.ranks)}
    devs = addressable_order(sharding)
    return _make_array(d.shape, d.np_dtype, sharding, [shards[slot[dev.id]] for dev in devs], list(devs))


def _count(builder: ReportBuilder, lowerings: Sequence[LeafLowering]) -> None:
    for low in lowerings:
        builder.add_bytes(Link.NETWORK, low.network_bytes)
        builder.add_bytes(Link.FAST, low.fast_bytes)
        builder.add_bytes(Link.LOCAL, low.local_bytes)


def transfer_into(
    x: Any,
    into: Any,
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
    builder = report or ReportBuilder(Backend.LOCAL)
    with builder.timed(ReportPhase.PLAN):
        treedef, views, shardings, srcs, layouts, dsts = _front(x, into, "into")
        into_leaves = treedef.flatten_up_to(into)
        lowerings, program = _lowerings(views, srcs, layouts, dsts, topology)
    pool = default_pool()
    fresh0 = pool.stats().fresh_bytes
    with builder.timed(ReportPhase.BUFFERS):
        arrays, boxes = _sources(lowerings, srcs, layouts)
        owned = _claim(into_leaves, {p for leaf in srcs for p in _read(leaf.source)} - {0})
        donated = _donate(
            [into_leaves[t] for t in owned], [c[0] for c in owned.values()], [c[1] for c in owned.values()]
        )
        taken = dict(zip(owned, donated, strict=True))  # leaf -> (the array that owns the memory now, addresses)
        bufs: list[dict[int, np.ndarray]] = []
        fresh: dict[int, list[np.ndarray]] = {}
        for t, d in enumerate(dsts):
            if t in taken:
                shards = {s.device.id: s.data for s in taken[t][0].addressable_shards}
                bufs.append({r: writable_view(shards[r]).view(d.np_dtype).reshape(d.box_of(r).shape) for r in d.ranks})
            else:
                fresh[t] = _fresh(d, 1, pool)[1][0]
                bufs.append(dict(zip(d.ranks, fresh[t], strict=True)))
                builder.add_unowned(sum(b.nbytes for b in fresh[t]))
    with builder.timed(ReportPhase.COPY):
        try:
            _execute_pieces(lowerings, program, views, arrays, boxes, bufs, threads)
        except Exception as err:
            raise TransferError(
                f"transfer_into failed while copying ({type(err).__name__}: {err}); the into arrays were "
                "consumed and the results hold neither the old nor the new values",
                destination_intact=False,
            ) from err
    with builder.timed(ReportPhase.BUFFERS):
        del arrays, bufs
        out = [
            taken[t][0] if t in taken else _assemble(d, sh, fresh[t])
            for t, (d, sh) in enumerate(zip(dsts, shardings, strict=True))
        ]
        for a, addrs in taken.values():
            _remember(a, addrs, by_jax=True)
    _count(builder, lowerings)
    builder.add_fresh(pool.stats().fresh_bytes - fresh0)
    return treedef.unflatten(out)


def _claim(into_leaves: list[Any], src_ptrs: set[int]) -> dict[int, tuple[tuple[int, ...], bool]]:
    """``{leaf: (shard addresses, allocated by jax)}`` of the ``into`` leaves that may be written in place:
    live, sharing no buffer with a source or with an ``into`` leaf claimed before."""
    claimed: set[int] = set()
    own: dict[int, tuple[tuple[int, ...], bool]] = {}
    for t, a in enumerate(into_leaves):
        if a.is_deleted():
            continue
        addrs, by_jax = _addresses_of(a)
        ptrs = set(addrs) - {0}
        if not (ptrs & src_ptrs) and not (ptrs & claimed):
            own[t] = (addrs, by_jax)
            claimed |= ptrs
    return own
