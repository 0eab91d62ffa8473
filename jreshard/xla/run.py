"""``transfer`` and ``transfer_into`` with ``Options(backend="xla")``: the runner of the XLA computation.

One call (its leaves and targets flattened once by the front door, ``jreshard.api``): check every dtype and
shape (before any byte moves), plan all moved leaves together (one plan: every pair of devices
exchanges one message per stage whatever the number of leaves), look up or compile the computation
(:mod:`jreshard.xla.compiled`, cached by the layouts, topology, options, which destinations are
donated and the devices), stack the shards into its inputs, run it, and cut its outputs back into
arrays of the target shardings.

In one process every device is addressable; across the processes of a ``jax.distributed``
cluster every process calls with the same pytree and targets, builds the same plan and the same
computation, and passes the blocks of its own devices. Not run on GPU or TPU.
"""

from __future__ import annotations

import math
from typing import Any, cast

import jax
import jax.numpy as jnp

from jreshard.engine.arrays import assembled, empty_array, zeros_on
from jreshard.engine.ownership import claim, shard_pointer, source_addresses
from jreshard.engine.prepared import Mode
from jreshard.errors import LayoutError, LayoutMismatchError
from jreshard.options import Options
from jreshard.report import NotInPlace, ReportBuilder, ReportPhase
from jreshard.sharding.caches import cache
from jreshard.sharding.jax import addressable_order
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Link, Topology
from jreshard.types import DType, Sharding
from jreshard.xla.compiled import Compiled, compile_plan, stacked_shape
from jreshard.xla.lanes import check_dtype
from jreshard.xla.xlaplan import XlaPlan, xla_plan

__all__ = ["compiled_for", "run_xla"]


@cache(max_size=4096)
def _layout(sharding: Sharding, shape: tuple[int, ...], dtype: DType) -> Layout:
    return Layout.from_sharding(sharding, shape, dtype)


@cache(max_size=64)
def _topology(ranks: tuple[int, ...]) -> Topology:
    devices = {d.id: d for d in jax.devices()}
    return Topology.from_devices([devices[r] for r in ranks])


@cache(max_size=64)
def _static(pairs: tuple[tuple[Layout, Layout], ...], topology: Topology, options: Options) -> XlaPlan:
    return xla_plan(plan_layouts(list(pairs), topology, options))


@cache(max_size=64)
def _compiled(
    pairs: tuple[tuple[Layout, Layout], ...], topology: Topology, options: Options, donate: tuple[bool, ...]
) -> Compiled:
    plan = _static(pairs, topology, options)
    devices = {d.id: d for d in jax.devices()}
    return compile_plan(plan, [devices[r] for r in plan.ranks], [s.np_dtype for s, _ in pairs], donate)


def compiled_for(
    pairs: Any, topology: Topology | None = None, options: Options | None = None, donate: Any = None
) -> tuple[Compiled, bool]:
    """The compiled computation of ``pairs`` (a sequence of ``(source Layout, destination Layout)``), and
    whether it was compiled by this call (``False``: found in the cache).

    Args:
      pairs: the tensors' layout pairs (ranks are ``device.id``).
      topology: default ``Topology.from_devices`` over the devices taking part.
      options: default ``Options()``.
      donate: per tensor, whether the call donates its destination blocks (default: none).
    """
    pairs = tuple((s, d) for s, d in pairs)
    ranks = tuple(sorted({r for s, d in pairs for r in (*s.ranks, *d.ranks)}))
    topology = topology or _topology(ranks)
    options = options or Options()
    donate = tuple(bool(x) for x in donate) if donate is not None else (False,) * len(pairs)
    info = cast(Any, _compiled).cache_info
    before = info().misses
    got = _compiled(pairs, topology, options, donate)
    return got, info().misses > before


def _targets(leaves: list[Any], targets: list[Any], shardings: list[Any], mode: Mode) -> list[Any]:
    """Each leaf's destination sharding, or ``None`` (returned as it is), after the checks."""
    out: list[Any] = []
    for i, (leaf, t) in enumerate(zip(leaves, targets, strict=True)):
        where = f"leaf #{i} of x"
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
            raise LayoutError(f"{where} is {type(leaf).__name__}, not a concrete jax.Array; the fix is jax.device_put")
        if leaf.is_deleted():
            raise LayoutError(f"{where} has been deleted or donated; the fix is to pass a live array")
        if mode is Mode.INTO:
            if t is None:
                out.append(None)
                continue
            if not isinstance(t, jax.Array):
                raise LayoutError(f"leaf #{i} of into is {type(t).__name__}, not a jax.Array")
            if t.shape != leaf.shape or t.dtype != leaf.dtype:
                raise LayoutMismatchError(
                    f"leaf #{i} is {leaf.dtype}{list(leaf.shape)} but into holds {t.dtype}{list(t.shape)}",
                    src=(leaf.shape, leaf.dtype),
                    dst=(t.shape, t.dtype),
                    what="shape" if t.shape != leaf.shape else "dtype",
                )
            sh = t.sharding
        else:
            sh = shardings[i]
            if isinstance(t, jax.ShapeDtypeStruct) and (t.shape != leaf.shape or t.dtype != leaf.dtype):
                raise LayoutMismatchError(
                    f"leaf #{i} is {leaf.dtype}{list(leaf.shape)} but its target is {t}; casting needs views",
                    src=(leaf.shape, leaf.dtype),
                    dst=(t.shape, t.dtype),
                    what="shape" if t.shape != leaf.shape else "dtype",
                )
            if sh is None or sh == leaf.sharding:
                out.append(None)
                continue
        kind = getattr(sh, "memory_kind", None)
        if kind not in (None, "device"):
            raise LayoutError(f"the target of leaf #{i} has memory_kind={kind!r}; backend 'xla' writes device memory")
        kind = getattr(leaf.sharding, "memory_kind", None)
        if kind not in (None, "device"):
            raise LayoutError(f"{where} is in memory_kind={kind!r}; backend 'xla' reads device memory")
        check_dtype(leaf.dtype, where)
        out.append(sh)
    return out


def _reused(before: tuple[int, ...], blocks: Any) -> bool:
    """Whether the output ``blocks`` lie in the memory of the donated ``into`` shards (addresses ``before``)."""
    return set(before) - {0} <= {shard_pointer(b) for b in blocks}


def _stack(blocks: dict[Any, jax.Array], block: tuple[int, ...], compiled: Compiled, spare: Any) -> Any:
    """The stacked global array of one tensor's blocks on this process's devices of the mesh; devices
    without a block get one from ``spare(device)``."""
    devs = [d for d in compiled.mesh.devices.flat if d.process_index == jax.process_index()]
    arrays = []
    for d in devs:
        a = blocks.get(d)
        if a is None:
            a = spare(d)
        elif not block:
            a = jnp.reshape(a, (1,))
        arrays.append(a)
    n = compiled.mesh.devices.size
    return jax.make_array_from_single_device_arrays(stacked_shape(block, n), compiled.sharding, arrays)


def run_xla(
    leaves: list[Any],
    targets: list[Any],
    shardings: list[Any],
    mode: Mode,
    topology: Topology | None,
    options: Options,
    builder: ReportBuilder,
) -> list[Any]:
    """Run one ``transfer`` / ``transfer_into`` call's flat leaves through the XLA computation (module docstring).

    Args:
      leaves, targets: the call's leaves and targets, flattened once by the front door.
      shardings: per leaf, its target's sharding (``None``: a ``None`` target).

    Returns the result leaves (the caller unflattens them).

    Raises:
      LayoutError: a leaf is not a live jax.Array, its dtype cannot move bit for bit
        (:func:`~jreshard.xla.lanes.check_dtype`), or a layout has uneven shards.
      LayoutMismatchError: structure, shape or dtype differ between ``x`` and its target.
    """
    with builder.timed(ReportPhase.PLAN):
        shardings = _targets(leaves, targets, shardings, mode)
        moved = [i for i, sh in enumerate(shardings) if sh is not None]
        empty = [i for i in moved if not math.prod(leaves[i].shape)]  # no byte to move: made, into kept
        moved = [i for i in moved if math.prod(leaves[i].shape)]
        pairs = tuple(
            (
                _layout(leaves[i].sharding, leaves[i].shape, leaves[i].dtype),
                _layout(shardings[i], leaves[i].shape, leaves[i].dtype),
            )
            for i in moved
        )
        claims = claim(targets, moved, source_addresses(leaves)) if mode is Mode.INTO else None
        donate = tuple(claims is not None and i in claims.owned for i in moved)
    result = (
        list(leaves) if mode is Mode.TRANSFER else [leaves[i] if t is None else None for i, t in enumerate(targets)]
    )
    for i in empty:
        result[i] = empty_array(tuple(leaves[i].shape), leaves[i].dtype, shardings[i], leaves[i].weak_type)
    if not moved:
        return result
    mine = {d.id for d in jax.local_devices()}
    if not any(r in mine for s, d in pairs for r in (*s.ranks, *d.ranks)):
        # None of this process's devices takes part (across processes): the computation is not ours to run;
        # every result has no addressable shard here (tests/test_xla_distributed.py, 4 processes).
        for i in moved:
            result[i] = jax.make_array_from_single_device_arrays(
                leaves[i].shape, shardings[i], [], dtype=leaves[i].dtype
            )
        return result
    compiled, fresh = compiled_for(pairs, topology, options, donate)
    if fresh:  # compiled by this call; a computation from the cache adds no compile time
        builder.add_seconds(ReportPhase.COMPILE, compiled.compile_s)
    plan = compiled.plan
    here = {d for d in compiled.mesh.devices.flat if d.process_index == jax.process_index()}
    with builder.timed(ReportPhase.BUFFERS):
        spares: dict[tuple[Any, tuple[int, ...], Any], jax.Array] = {}

        def spare(block: tuple[int, ...], dtype: DType, shared: bool) -> Any:
            def make(d: Any) -> jax.Array:
                shape = block or (1,)
                if not shared:
                    return zeros_on(d, shape, dtype)
                key = (d, shape, jnp.dtype(dtype))
                if key not in spares:
                    spares[key] = zeros_on(d, shape, dtype)
                return spares[key]

            return make

        ins = []
        for t, i in enumerate(moved):
            blocks = {s.device: s.data for s in leaves[i].addressable_shards}
            make = spare(plan.src_block[t], leaves[i].dtype, True)
            ins.append(_stack(blocks, plan.src_block[t], compiled, make))
        for t, i in enumerate(moved):
            if donate[t]:
                blocks = {s.device: s.data for s in targets[i].addressable_shards}
                make = spare(plan.dst_block[t], leaves[i].dtype, False)
                ins.append(_stack(blocks, plan.dst_block[t], compiled, make))
    with builder.timed(ReportPhase.COPY):
        with jax.set_mesh(compiled.mesh):  # the computation's own mesh, whatever mesh the caller has set
            outs = compiled.executable(*ins)
        del ins
        spares.clear()
        jax.block_until_ready(outs)
    with builder.timed(ReportPhase.BUFFERS):
        for t, i in enumerate(moved):
            sh = shardings[i]
            blocks = {s.device: s.data for s in outs[t].addressable_shards}
            order = addressable_order(sh)
            arrays = [blocks[d] if plan.dst_block[t] else jnp.reshape(blocks[d], ()) for d in order]
            result[i] = assembled(leaves[i].shape, leaves[i].dtype, sh, arrays, leaves[i].weak_type)
            nbytes = sum(a.nbytes for a in arrays)
            if claims is not None and not donate[t]:
                builder.add_unowned(nbytes, i, claims.why[i])
            elif claims is not None and not _reused(claims.owned[i][0], blocks.values()):
                builder.add_unowned(nbytes, i, NotInPlace.NOT_HANDED_OVER)  # XLA copied: into's memory unused
            if not (mode is Mode.INTO and donate[t]):
                builder.add_fresh(nbytes)
        del outs
    _count(plan, here, builder)
    builder.add_padding(sum(plan.padded_by.get(r, 0) for r in (d.id for d in here)))
    return result


def _count(plan: XlaPlan, here: set[Any], builder: ReportBuilder) -> None:
    """This process's bytes: what its devices send (and copy), and its messages."""
    for r in (d.id for d in here):
        for link, nb in plan.sent_by.get(r, {}).items():
            builder.add_bytes(Link(link), nb)
        builder.add_bytes(Link.NETWORK, 0, messages=plan.messages_by.get(r, 0))
