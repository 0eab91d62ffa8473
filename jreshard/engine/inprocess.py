"""Run a prepared transfer in one process on CPU devices: the copy lowering of its plans.

Per layout group (:class:`~jreshard.engine.prepared.Group`) the plan of its layout pair is
lowered once (:func:`~jreshard.engine.copies.lower_local`, cached) and applied to
every leaf of the group at once:

1. **Sources.** The arrays are waited on once (``jax.block_until_ready``), then each
   shard's buffer address is read (``unsafe_buffer_pointer``: microseconds, where a
   DLPack export costs tens). The sources are only read, and stay referenced until
   the copies end.
2. **Destinations.** ``transfer``: one warm block per (group, destination device)
   from the buffer pool (:mod:`jreshard.engine.pool`), cut into one aligned shard per
   leaf. ``transfer_into``: the ``into`` arrays, consumed as ``jax.jit`` with
   ``donate_argnums`` consumes them (they are donated to an identity computation,
   whose outputs own the same memory), but only where nothing else can observe that
   memory; otherwise fresh shards, counted in the report.
3. **Copies.** Every stage's copy classes, for the whole group, as batched strided
   copies (:mod:`jreshard.engine.strided`), started on the compiled kernel's own threads,
   which never take the GIL (:class:`~jreshard.engine.strided.Copier`); a later stage (one
   that reads what an earlier one wrote) once the earlier ones have ended.
4. **Results.** Each global array is made over its shards in one call of jax's batched put
   (zero-copy on CPU) where the transfer guard allows it, else each shard is imported through
   DLPack as memory its device already holds (no host-to-device transfer: every
   ``jax.transfer_guard`` setting allows it) and the array assembled from them
   (:mod:`jreshard.engine.arrays`); the pool takes the block back when jax lets it go. ``transfer``
   makes them while the copies run, over the buffers being written (checked on the first result of
   each group: where jax copied instead, the group's results are made once the copies have ended).

The host work of a many-leaf call is mostly per leaf: jax builds a Python object per source
shard when its shards are first read (about 3 us each), and one call makes each result (or,
for ``transfer_into``, one jitted call donates every ``into`` leaf). Making the results is what
runs beside the copies: ``transfer_into`` has none to make for the leaves it writes in place, and
its copies cannot start earlier, since the ownership rule needs every source address before the
first ``into`` leaf is donated. Donating chunk by chunk while the previous chunk was copied, and
(``transfer``) copying each chunk of leaves while the next chunk's sources were read, both measured
slower on two shared cores than one start after all of them; a second try of the first (2026-12-05,
chunks of 100, 256 and 500 leaves, each chunk's copies started once it was donated) measured 1-6% faster
on 1,000 leaves (35.2-36.4 ms against 37.0-37.4 ms, alternated in one process), too little to carry a
second path. Reading the source addresses inside one jitted computation instead (an XLA FFI call per device,
under ``shard_map``, writing its operands' addresses into its output; 2026-12-06, a prototype, not kept) gave the
same addresses but cost 12-19 ms for 1,000 leaves of four shards (its dispatch alone 10-17 ms), where waiting for
the sources and reading their addresses through ``_arrays`` cost 15-22 ms in the same runs: jax's dispatch of a
call takes about as long per argument as building its shards' objects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jreshard.engine import strided
from jreshard.engine.arrays import fresh_shards, make_array
from jreshard.engine.copies import CopyLowering, addresses, lower_local
from jreshard.engine.ownership import (
    remember,
    remember_all,
    shard_arrays,
    shard_pointer,
    take,
)
from jreshard.engine.pool import BufferPool, default_pool
from jreshard.engine.prepared import Group, Kind, Mode, Prepared, sharding_of
from jreshard.engine.put import batched_put, put_allowed
from jreshard.errors import TransferError
from jreshard.options import Options
from jreshard.report import ReportBuilder, ReportPhase
from jreshard.sharding.caches import cache
from jreshard.sharding.dtypes import storage_bytes
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Topology
from jreshard.types import Array, Target, TreeLeaf

__all__ = ["lowering_of", "run_local"]


@cache(max_size=1024)
def lowering_of(src: Any, dst: Any, topology: Topology | None, options: Options) -> CopyLowering:
    """The copies of one layout pair, lowered from its plan (cached)."""
    topo = topology or _host_topology(tuple(sorted(set(src.ranks) | set(dst.ranks))))
    return lower_local(plan_layouts([(src, dst)], topo, options))


@cache(max_size=64)
def _host_topology(ranks: tuple[int, ...]) -> Topology:
    devices = {d.id: d for d in jax.devices()}
    return Topology.from_devices([devices[r] for r in ranks])


def _raw_pointers(shards: Sequence[Any]) -> set[int]:
    """The buffer addresses of non-empty single-device arrays."""
    return {s.unsafe_buffer_pointer() for s in shards}


def _pointers(shards: list[Sequence[Any]], orders: Sequence[Sequence[int]], slots: int, empty: bool) -> np.ndarray:
    """``(len(shards), slots)`` int64 buffer addresses of each leaf's shards, column = slot
    (``empty``: some shards have no bytes)."""
    if not empty and len(set(orders)) == 1:  # the common case: one sharding for the whole group
        flat = [s.unsafe_buffer_pointer() for arrs in shards for s in arrs]
        out = np.empty((len(shards), slots), dtype=np.int64)
        out[:, list(orders[0])] = np.array(flat, dtype=np.int64).reshape(len(shards), -1)
        return out
    out = np.zeros((len(shards), slots), dtype=np.int64)
    for j, arrs in enumerate(shards):
        out[j, list(orders[j])] = [shard_pointer(s) for s in arrs]
    return out


@cache(max_size=1024)
def _has_empty(layout: Any) -> bool:
    return any(b.volume == 0 for b in layout.boxes)


def _kept(leaf: TreeLeaf, target: Target) -> Any:
    """A leaf that moves no byte: itself for a ``None`` target, else what ``jax.device_put`` gives for a
    sharding it already has (the same buffers, committed, carrying the target's sharding object)."""
    sharding = sharding_of(target)
    if sharding is None or (leaf.sharding is sharding and getattr(leaf, "_committed", True)):
        return leaf
    return jax.device_put(leaf, sharding)


def _into_destinations(
    prep: Prepared, src_ptr: list[np.ndarray], pool: BufferPool, builder: ReportBuilder
) -> tuple[list[np.ndarray], list[list[list[np.ndarray]]], dict[int, tuple[Any, tuple[int, ...]]]]:
    """The destination shards of ``transfer_into``, per group: ``(addresses, fresh views, donated)``.

    The ``into`` leaves the ownership rule gives (:func:`~jreshard.engine.ownership.take`) are donated
    (their memory taken over, ``donated[leaf] = (new array, addresses)``); the others get fresh shards
    from the pool, counted as not in place with the rule's reason.
    """
    leaves, shape = prep.leaves, prep.shape
    every_src = set(np.concatenate([p.ravel() for p in src_ptr]).tolist()) - {0}
    for i, kind in enumerate(shape.kinds):  # kept leaves are sources an into leaf may name too
        if kind is Kind.KEEP and leaves[i].size:
            every_src |= _raw_pointers(shard_arrays(leaves[i]))
    moved = [i for g in shape.groups for i in g.leaves]
    weak = [False] * len(leaves)  # the weak_type each result takes: its source leaf's (key arrays have none)
    for i in moved:
        weak[i] = leaves[i].weak_type
    taken = take(prep.targets, moved, every_src, builder, weak)
    donated = taken.donated
    dst_ptr: list[np.ndarray] = []
    views: list[list[list[np.ndarray]]] = []
    for g in shape.groups:
        p = np.zeros((len(g.leaves), len(g.dst.ranks)), dtype=np.int64)
        if g.common_dst is not None and all(i in donated for i in g.leaves):  # the steady state: one call
            p[:, list(g.common_dst)] = np.array([donated[i][1] for i in g.leaves], dtype=np.int64)
            dst_ptr.append(p)
            views.append([[] for _ in g.leaves])
            continue
        v_g: list[list[np.ndarray]] = []
        for j, i in enumerate(g.leaves):
            if i in donated:
                p[j, list(g.dst_order[j])] = donated[i][1]
                v_g.append([])
            else:
                one_p, one_v = fresh_shards(g.dst, 1, pool, g.common_dst)
                p[j] = one_p[0]
                v_g.append(one_v[0])
                taken.count(builder, i, sum(x.nbytes for x in one_v[0]))
        dst_ptr.append(p)
        views.append(v_g)
    return dst_ptr, views, donated


def run_local(
    prep: Prepared, topology: Topology | None, options: Options, builder: ReportBuilder, pool: BufferPool | None = None
) -> list[Any]:
    """The result leaves of a prepared call, run in this process on CPU devices.

    Raises:
      TransferError: a copy failed (for ``transfer_into``, the message says that the
        ``into`` arrays were consumed and the results are incomplete).
    """
    pool = default_pool() if pool is None else pool
    leaves, shape = prep.leaves, prep.shape
    out: list[Any] = [None] * len(leaves)
    for i, kind in enumerate(shape.kinds):
        if kind is Kind.KEEP:
            out[i] = _kept(leaves[i], prep.targets[i] if prep.mode is Mode.TRANSFER else None)
    if not shape.groups:
        return out
    with builder.timed(ReportPhase.PLAN):
        lowerings = [lowering_of(g.src, g.dst, topology, options) for g in shape.groups]
    fresh0 = pool.stats().fresh_bytes
    with builder.timed(ReportPhase.BUFFERS):
        jax.block_until_ready([leaves[i] for g in shape.groups for i in g.leaves])
        # Each group's source shards, read once per leaf (jax builds the single-device arrays on the
        # first read), and their addresses.
        src_shards = [[shard_arrays(leaves[i]) for i in g.leaves] for g in shape.groups]
        src_ptr = [
            _pointers(arrs, g.src_order, len(g.src.ranks), _has_empty(g.src))
            for g, arrs in zip(shape.groups, src_shards, strict=True)
        ]
        donated: dict[int, tuple[Any, tuple[int, ...]]] = {}
        if prep.mode is Mode.TRANSFER:
            fresh = [fresh_shards(g.dst, len(g.leaves), pool, g.common_dst) for g in shape.groups]
            dst_ptr, views = [p for p, _ in fresh], [v for _, v in fresh]
        else:
            dst_ptr, views, donated = _into_destinations(prep, src_ptr, pool, builder)
    bounds = _buffers(prep, src_shards, views, donated) if strided.checking_bounds() else None
    copier = strided.Copier(options.copy_threads)
    made = [False] * len(shape.groups)  # per group: its results were made while the copies ran
    try:
        with builder.timed(ReportPhase.COPY), _copying(prep.mode):
            for low, sp, dp in zip(lowerings, src_ptr, dst_ptr, strict=True):
                if low.stages:  # the first stage reads sources only: every later one, what it wrote
                    copier.start([(rows.cls, *addresses(rows, sp, dp)) for rows in low.stages[0]], bounds)
        if prep.mode is Mode.TRANSFER:  # the results, while the copies run: their shards are the pool's
            with builder.timed(ReportPhase.BUFFERS):
                put = put_allowed()
                made = [
                    _results(prep, g, v_g, dp, donated, put, out, check=True)
                    for g, v_g, dp in zip(shape.groups, views, dst_ptr, strict=True)
                ]
        with builder.timed(ReportPhase.COPY), _copying(prep.mode):
            copier.wait()
            for low, sp, dp in zip(lowerings, src_ptr, dst_ptr, strict=True):
                for stage in low.stages[1:]:
                    work = [(rows.cls, *addresses(rows, sp, dp)) for rows in stage]
                    strided.copy_classes(work, threads=options.copy_threads, bounds=bounds)
    finally:
        copier.wait()  # no copy is left writing, whatever failed
    with builder.timed(ReportPhase.BUFFERS):
        put = put_allowed()
        for g, low, v_g, dp, done in zip(shape.groups, lowerings, views, dst_ptr, made, strict=True):
            for link, nb in low.link_bytes:
                builder.add_bytes(link, nb * len(g.leaves))
            if done:
                continue
            if prep.mode is Mode.TRANSFER or not all(i in donated for i in g.leaves):
                _results(prep, g, v_g, dp, donated, put, out)
            else:  # the steady state of transfer_into: every leaf donated
                remember_all([donated[i][0] for i in g.leaves], [donated[i][1] for i in g.leaves], by_jax=True)
                for i in g.leaves:
                    out[i] = donated[i][0]
        del src_ptr
    builder.add_fresh(pool.stats().fresh_bytes - fresh0)
    return out


@contextlib.contextmanager
def _copying(mode: Mode) -> Iterator[None]:
    """Report a failed copy as :class:`TransferError` (for ``transfer_into``: ``into`` was consumed)."""
    try:
        yield
    except Exception as err:
        if mode is Mode.INTO:
            raise TransferError(
                f"transfer_into failed while copying ({type(err).__name__}: {err}); the into arrays were "
                "consumed and the results hold neither the old nor the new values",
                destination_intact=False,
            ) from err
        raise TransferError(f"transfer failed while copying ({type(err).__name__}: {err})") from err


def _results(
    prep: Prepared,
    g: Group,
    views: Sequence[Sequence[np.ndarray]],
    dst_ptr: np.ndarray,
    donated: dict[int, tuple[Any, tuple[int, ...]]],
    put: bool,
    out: list[Any],
    check: bool = False,
) -> bool:
    """Fill ``out`` with the result leaves of group ``g``: the donated arrays, and arrays made over the fresh
    shards ``views[j]`` (in the order jax assembles them where the group has one order, ``g.common_dst``,
    else in slot order) with addresses ``dst_ptr`` (slot order); each result's addresses are remembered.

    ``check``: the shards are still being written, so each result must be made over them, not over a copy
    of what they hold now. The first result is checked (jax aliases every leaf of a group alike: one
    dtype, one shape, one alignment in the pool); where jax copied it, nothing is filled in and ``False``
    is returned, for the caller to make the group's results once its copies have ended. Returns ``True``
    otherwise.
    """
    leaves, targets, common = prep.leaves, prep.targets, g.common_dst
    batched = batched_put(put)
    avals: dict[bool, Any] = {}  # weak_type -> aval: every leaf of a group has one shape and dtype
    made: list[Any] = []
    rows = (dst_ptr[:, list(common)] if common is not None else dst_ptr).tolist()
    made_rows: list[list[int]] = []
    for j, i in enumerate(g.leaves):
        if i in donated:
            out[i] = donated[i][0]
            remember(out[i], donated[i][1], by_jax=True)
            continue
        leaf, t = leaves[i], targets[i]
        sharding = t if isinstance(t, jax.sharding.Sharding) else sharding_of(t)  # the caller's object
        if common is not None:
            shards, devices, row = views[j], g.devices[0], rows[j]
        else:
            order = g.dst_order[j]
            shards, devices, row = [views[j][k] for k in order], g.devices[j], [rows[j][k] for k in order]
        if batched is not None:
            weak = leaf.weak_type
            aval = avals.get(weak)
            if aval is None:
                aval = avals[weak] = batched.aval(leaf.shape, leaf.dtype, weak)
            a = batched.raw(aval, sharding, shards, devices, True)
        else:
            a = make_array(leaf.shape, leaf.dtype, sharding, shards, devices, leaf.weak_type, put)
        if check and not made and not _over(a, shards):
            return False
        out[i] = a
        made.append(a)
        made_rows.append(row)
    remember_all(made, made_rows, by_jax=False)
    return True


def _over(a: Array, views: Sequence[np.ndarray]) -> bool:
    """Whether the shards of ``a`` (``addressable_data`` order) are the buffers ``views`` themselves."""
    return all(not v.size or shard_pointer(s) == v.ctypes.data for s, v in zip(shard_arrays(a), views, strict=True))


def _buffers(
    prep: Prepared,
    src_shards: list[list[Sequence[Any]]],
    views: Sequence[Sequence[Sequence[np.ndarray]]],
    donated: dict[int, tuple[Any, tuple[int, ...]]],
) -> tuple[strided.AddressRanges, strided.AddressRanges]:
    """The buffers a call's copies may read and write (the ``JRESHARD_CHECK_BOUNDS`` mode), sized from the
    buffers themselves: jax's shards by their dtype's storage (packed sub-byte dtypes counted as packed),
    the pool's by their numpy views."""
    written: list[tuple[int, int]] = []
    for g, v_g in zip(prep.shape.groups, views, strict=True):
        for j, i in enumerate(g.leaves):
            if i in donated:
                for s in shard_arrays(donated[i][0]):
                    written.append((shard_pointer(s), shard_pointer(s) + storage_bytes(np.dtype(s.dtype), s.size)))
            else:
                written.extend((v.ctypes.data, v.ctypes.data + v.nbytes) for v in v_g[j])
    read = [
        (shard_pointer(s), shard_pointer(s) + storage_bytes(np.dtype(s.dtype), s.size))
        for group in src_shards
        for arrs in group
        for s in arrs
    ]
    return strided.AddressRanges.of(read + written), strided.AddressRanges.of(written)
