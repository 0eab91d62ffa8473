"""The XLA computation of an :class:`~jreshard.xla.xlaplan.XlaPlan`: one jitted ``shard_map`` over the mesh.

The mesh is 1-D (axis :data:`AXIS`) over the devices of the transfer, in rank order. Every array
enters "stacked": tensor ``t``'s source shards are the blocks of one global array of shape
``(n * s0, s1, ...)`` sharded along its first dimension, one block per device (a device that holds
no shard of it gives a zero block of that shape); the destination comes out the same way. So the
computation's inputs are made from the shards themselves (``jax.make_array_from_single_device_arrays``,
zero-copy) and its outputs are cut back into shards without a copy. A rank-0 tensor's blocks have
shape ``(1,)``.

Inside, every device runs the same code on its own blocks; what differs per device (which boxes
it packs and unpacks) is chosen by ``lax.switch`` on ``lax.axis_index``, one branch per device
that has work in that step (devices with none share one branch). Per stage: one switch packs every
send buffer of the stage (static slices of the shards, as ``uint8`` lanes, concatenated and
zero-padded to the permutation's length), one ``lax.ppermute`` per permutation, one switch
unpacks (static ``dynamic_update_slice`` into the destination blocks) and makes the stage's
same-device copies. Nothing depends on values, so the computation is fixed at compile time.

With ``donate`` set for a tensor, its destination blocks are an input donated to the call
(``jax.jit(..., donate_argnums=...)``): XLA writes the result into that memory and the input is
deleted. Otherwise the destination blocks start as zeros inside the computation.

Not run on GPU or TPU: tested on CPU devices (one process, and ``jax.distributed`` CPU clusters
over gloo); the same HLO is what XLA would run there.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jreshard.types import Array, DType, XlaExecutable
from jreshard.xla.lanes import from_bytes, from_lanes, lane_dtype, to_bytes, to_lanes
from jreshard.xla.xlaplan import SRC, BoxCopy, Pack, Received, XlaPlan

__all__ = ["AXIS", "Compiled", "compile_plan", "stacked_shape"]

AXIS = "jreshard"


def stacked_shape(block: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The global shape of ``n`` blocks of shape ``block`` stacked along the first dimension.

    >>> stacked_shape((2, 3), 4), stacked_shape((), 4)
    ((8, 3), (4,))
    """
    if not block:
        return (n,)
    return (n * block[0], *block[1:])


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Compiled:
    """A compiled computation and how to call it.

    Attributes:
      plan: the static computation.
      mesh: the 1-D mesh of its devices.
      donate: per tensor, whether its destination blocks are a donated input.
      dtypes: per tensor, its jax dtype.
      executable: the jitted function, compiled for these inputs:
        ``executable(*sources, *donated destinations) -> destinations``.
      compile_s: seconds spent tracing, lowering and compiling it.
      hlo: the lowered computation's text (StableHLO), for tests that count its collectives.
    """

    plan: XlaPlan
    mesh: Mesh
    donate: tuple[bool, ...]
    dtypes: tuple[Any, ...]
    executable: XlaExecutable
    compile_s: float
    hlo: str

    @property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(AXIS))


def _read(x: jax.Array, lo: tuple[int, ...], hi: tuple[int, ...]) -> jax.Array:
    """Box ``lo..hi`` of a lane block (a complex's trailing pair of lanes whole)."""
    extra = x.shape[len(lo) :]
    return jax.lax.slice(x, (*lo, *(0 for _ in extra)), (*hi, *extra))


def _write(x: jax.Array, value: jax.Array, lo: tuple[int, ...]) -> jax.Array:
    return jax.lax.dynamic_update_slice(x, value, (*lo, *(0 for _ in x.shape[len(lo) :])))


def _wire_widths(stage: Any, lane_sizes: Sequence[int]) -> tuple[int, ...]:
    """Per permutation of ``stage``, the lane width its buffer is sent in: the lanes of its pieces
    when every piece has lanes of one width and every cut falls on a lane, else 1 (bytes). A buffer of
    lanes is packed and unpacked without a byte view (``to_bytes``, elementwise ``uint8`` work)."""
    widths: list[set[int]] = [set() for _ in stage.perms]
    for per in stage.pack:
        for k, parts in enumerate(per):
            for p in parts:
                w = lane_sizes[p.tensor]
                widths[k].add(w if p.start % w == 0 and p.stop % w == 0 else 1)
    out = []
    for k, ws in enumerate(widths):
        w = ws.pop() if len(ws) == 1 else 1
        out.append(w if stage.perms[k].length % w == 0 else 1)
    return tuple(out)


_WIRE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _pack_branch(
    items: Sequence[Sequence[Pack]], lengths: Sequence[int], widths: Sequence[int]
) -> Callable[..., Array]:
    def branch(src: tuple, dst: tuple) -> tuple:
        out = []
        for parts, length, w in zip(items, lengths, widths, strict=True):
            data = []
            for p in parts:
                block = src[p.tensor] if p.side == SRC else dst[p.tensor]
                lanes = _read(block, p.lo, p.hi).reshape(-1)
                data.append(lanes[p.start // w : p.stop // w] if w > 1 else to_bytes(lanes)[p.start : p.stop])
            used = sum(p.stop - p.start for p in parts)
            if used < length:
                data.append(jnp.zeros((length - used) // w, _WIRE[w]))
            out.append(jnp.concatenate(data) if len(data) > 1 else data[0])
        return tuple(out)

    return branch


def _unpack_branch(
    received: Sequence[Received], copies: Sequence[BoxCopy], widths: Sequence[int]
) -> Callable[..., Array]:
    def branch(src: tuple, dst: tuple, bufs: tuple) -> tuple:
        before = dst
        out = list(dst)
        for c in copies:  # from the shards as they were before this stage: what the plan's stage reads
            block = src[c.tensor] if c.side == SRC else before[c.tensor]
            out[c.tensor] = _write(out[c.tensor], _read(block, c.src_lo, c.src_hi), c.dst_lo)
        for r in received:
            target = out[r.tensor]
            parts = []
            for k, off, nb in r.segments:
                w = widths[k]
                part = bufs[k][off // w : (off + nb) // w]
                parts.append(part if w > 1 else from_bytes(part, target.dtype))
            data = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
            shape = tuple(h - lo for lo, h in zip(r.lo, r.hi, strict=True)) + target.shape[len(r.lo) :]
            out[r.tensor] = _write(target, data.reshape(shape), r.lo)
        return tuple(out)

    return branch


def _switch(index: jax.Array, keys: Sequence[Any], make: Callable[..., Array], *operands: Array) -> Array:
    """``lax.switch`` with one branch per distinct key (devices with equal work share a branch)."""
    distinct: dict[Any, int] = {}
    table = [distinct.setdefault(k, len(distinct)) for k in keys]
    branches = [make(k) for k in distinct]
    if len(branches) == 1:
        return branches[0](*operands)
    return jax.lax.switch(jnp.asarray(table, jnp.int32)[index], branches, *operands)


def _body(plan: XlaPlan, donate: tuple[bool, ...], dtypes: tuple[Any, ...]) -> Callable[..., Array]:
    ntens = len(plan.src)
    lane_sizes = [jnp.dtype(lane_dtype(d)).itemsize for d in dtypes]

    def body(*args: jax.Array) -> tuple:
        # Every shard as unsigned lanes (lanes.to_lanes), once: all slicing and writing is of lanes.
        src = tuple(to_lanes(a.reshape(plan.src_block[t])) for t, a in enumerate(args[:ntens]))
        given = iter(args[ntens:])
        dst = []
        for t in range(ntens):
            shape = plan.dst_block[t]
            if donate[t]:
                dst.append(to_lanes(next(given).reshape(shape)))
            else:
                pair = (2,) if jnp.issubdtype(dtypes[t], jnp.complexfloating) else ()
                dst.append(jnp.zeros((*shape, *pair), lane_dtype(dtypes[t])))
        index = jax.lax.axis_index(AXIS)
        cur = tuple(dst)
        for st in plan.stages:
            lengths = tuple(p.length for p in st.perms)
            widths = _wire_widths(st, lane_sizes)
            bufs: tuple = ()
            if st.perms:
                bufs = _switch(
                    index, st.pack, lambda items, ln=lengths, ws=widths: _pack_branch(items, ln, ws), src, cur
                )
                bufs = tuple(
                    jax.lax.ppermute(b, AXIS, perm=list(pairs)) for b, pairs in zip(bufs, st.pairs, strict=True)
                )
            keys = list(zip(st.received, st.copies, strict=True))
            if any(r or c for r, c in keys):
                cur = _switch(index, keys, lambda key, ws=widths: _unpack_branch(key[0], key[1], ws), src, cur, bufs)
        out = (from_lanes(c, dtypes[t]) for t, c in enumerate(cur))
        return tuple(c.reshape((1,)) if not plan.dst_block[t] else c for t, c in zip(range(ntens), out, strict=True))

    return body


def compile_plan(plan: XlaPlan, devices: Sequence[Any], dtypes: Sequence[Any], donate: Sequence[bool]) -> Compiled:
    """Trace, lower and compile ``plan``'s computation on ``devices`` (``devices[i]`` holds rank ``plan.ranks[i]``).

    Args:
      plan: the static computation.
      devices: the jax devices of the mesh, in rank order.
      dtypes: per tensor, its dtype.
      donate: per tensor, whether the call donates its destination blocks.
    """
    t0 = time.perf_counter()
    mesh = Mesh(np.asarray(devices, dtype=object), (AXIS,))
    dtypes, donate = tuple(jnp.dtype(d) for d in dtypes), tuple(bool(d) for d in donate)
    n = len(devices)
    sharding = NamedSharding(mesh, PartitionSpec(AXIS))

    def spec(block: tuple[int, ...], dtype: DType) -> jax.ShapeDtypeStruct:
        shape = stacked_shape(block, n)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    ins = [spec(b, d) for b, d in zip(plan.src_block, dtypes, strict=True)]
    outs = [spec(b, d) for b, d, dn in zip(plan.dst_block, dtypes, donate, strict=True) if dn]
    nin = len(ins) + len(outs)
    fn = jax.shard_map(
        _body(plan, donate, dtypes),
        mesh=mesh,
        in_specs=(PartitionSpec(AXIS),) * nin,
        out_specs=(PartitionSpec(AXIS),) * len(plan.dst),
        check_vma=False,
    )
    jitted = jax.jit(fn, donate_argnums=tuple(range(len(ins), nin)))
    with jax.set_mesh(mesh):  # the computation's own mesh, whatever mesh the caller has set
        lowered = jitted.lower(*ins, *outs)
    lowered.compile()  # jax keeps the executable: the first call of ``jitted`` compiles nothing
    # The call goes through ``jitted``, not the compiled object: jax's dispatch accepts the arrays' own
    # memory layouts (a sub-byte shard on CPU holds one value per byte, where a compiled computation's
    # default input layout packs two), which the compiled object's strict layout check refuses.
    executable = jitted
    return Compiled(
        plan=plan,
        mesh=mesh,
        donate=donate,
        dtypes=dtypes,
        executable=executable,
        compile_s=time.perf_counter() - t0,
        hlo=lowered.as_text(),
    )
