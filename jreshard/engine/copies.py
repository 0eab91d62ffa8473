"""Lower a one-tensor :class:`~jreshard.Plan` to in-process copies between shard buffers.

In one process every rank's shards are addressable, so each move of the plan
(``box`` of the tensor from ``src`` to ``dst`` at ``stage``) becomes one strided
copy: from the sender's source shard when its source box holds the move, else
from the sender's destination shard (a fan-out or relay of bytes that landed at an
earlier stage), into the receiver's destination shard. Stages run in order. The
result is a :class:`CopyLowering`: per stage, copy classes
(:class:`~jreshard.engine.strided.CopyClass`) with the slots and byte offsets of each
piece, independent of where the buffers are. A call then turns slots into
addresses for a whole batch of leaves with one numpy expression per class.

The lowering depends only on the layout pair, the topology and the planning
options, so leaves that share a layout pair share it, and it is cached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jreshard.engine.strided import CopyClass
from jreshard.sharding.dtypes import storage_bytes
from jreshard.sharding.plan import Plan
from jreshard.sharding.topology import Link

__all__ = ["FROM_DST", "FROM_SRC", "ClassRows", "CopyLowering", "addresses", "geometry", "lower_local"]

FROM_SRC, FROM_DST = 0, 1  # where a move reads: the sender's source shard, or its destination shard


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ClassRows:
    """The pieces of one copy class at one stage, for one leaf (int64 arrays, one entry per piece).

    Attributes:
      cls: the geometry.
      reads: ``FROM_DST`` when the pieces read the senders' destination shards, else ``FROM_SRC``.
      src_slot: the sender's slot (index into the ranks of the layout it reads).
      src_off: byte offset of the piece in that shard.
      dst_slot: the receiver's slot in the destination layout's ranks.
      dst_off: byte offset of the piece in the receiver's destination shard.
    """

    cls: CopyClass
    reads: int
    src_slot: np.ndarray
    src_off: np.ndarray
    dst_slot: np.ndarray
    dst_off: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CopyLowering:
    """Every copy of one layout pair, stage by stage.

    Attributes:
      stages: per stage, its :class:`ClassRows`.
      link_bytes: bytes per link kind for one leaf (from the plan).
      moves: plan moves (pieces before merging) for one leaf.
    """

    stages: tuple[tuple[ClassRows, ...], ...]
    link_bytes: tuple[tuple[Link, int], ...]
    moves: int


def _c_strides(shape: Sequence[int], itemsize: int) -> list[int]:
    out = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * int(shape[d + 1])
    return out


def geometry(extent: Sequence[int], itemsize: int, src_strides: Sequence[int], dst_strides: Sequence[int]) -> CopyClass:
    """The copy class of a box of ``extent`` elements read and written with these byte strides.

    Extent-1 dimensions are dropped and a dimension is merged into the run below it
    where both sides are contiguous across it.

    >>> geometry((4, 3), 4, (48, 4), (12, 4))    # full rows on the destination, not the source
    CopyClass(run=12, outer=(4,), src_strides=(48,), dst_strides=(12,))
    >>> geometry((2, 3), 4, (12, 4), (12, 4))
    CopyClass(run=24, outer=(), src_strides=(), dst_strides=())
    """
    run = itemsize
    dims = [(int(n), int(s), int(d)) for n, s, d in zip(extent, src_strides, dst_strides, strict=True) if int(n) != 1]
    outer: list[tuple[int, int, int]] = []
    merging = True
    for n, s, d in reversed(dims):
        if merging and s == run and d == run:
            run *= n
            continue
        merging = False
        outer.append((n, s, d))
    outer.reverse()
    return CopyClass(
        run=run,
        outer=tuple(n for n, _, _ in outer),
        src_strides=tuple(s for _, s, _ in outer),
        dst_strides=tuple(d for _, _, d in outer),
    )


def lower_local(plan: Plan) -> CopyLowering:
    """The in-process copies of a plan of one tensor (see the module docstring).

    Raises:
      ValueError: the plan has other than one tensor, or a move reads bytes its sender
        holds in neither of its shards (a planner bug, never silently copied).
    """
    if len(plan.tensors) != 1:
        raise ValueError(f"lower_local: expected a plan of one tensor, got {len(plan.tensors)}")
    spec = plan.tensors[0]
    src, dst = spec.src, spec.dst
    tp = plan.tensor_plans[0]
    isz = src.itemsize
    s_slot = {r: i for i, r in enumerate(src.ranks)}
    d_slot = {r: i for i, r in enumerate(dst.ranks)}
    s_box, d_box = src._index(), dst._index()
    s_str = {r: _c_strides(b.shape, isz) for r, b in s_box.items()}
    d_str = {r: _c_strides(b.shape, isz) for r, b in d_box.items()}
    groups: dict[tuple[int, int, CopyClass], list[tuple[int, int, int, int]]] = {}
    links: dict[Link, int] = {}
    for i in range(len(tp)):
        lo, hi = tp.lo[i].tolist(), tp.hi[i].tolist()
        extent = [b - a for a, b in zip(lo, hi, strict=True)]
        if 0 in extent:
            continue
        sender, receiver, stage = int(tp.src[i]), int(tp.dst[i]), int(tp.stage[i])
        links[Link(int(tp.link[i]))] = links.get(Link(int(tp.link[i])), 0) + int(tp.nbytes[i])
        held = s_box.get(sender)
        if held is not None and all(h0 <= a and b <= h1 for a, b, h0, h1 in zip(lo, hi, held.lo, held.hi, strict=True)):
            kind, slot, box, strides = FROM_SRC, s_slot[sender], held, s_str[sender]
        elif sender in d_box:
            kind, slot, box, strides = FROM_DST, d_slot[sender], d_box[sender], d_str[sender]
        else:
            raise ValueError(f"lower_local: move {i} of {spec.name} reads rank {sender}, which holds neither shard")
        rbox = d_box[receiver]
        soff = sum((a - b0) * st for a, b0, st in zip(lo, box.lo, strides, strict=True))
        doff = sum((a - b0) * st for a, b0, st in zip(lo, rbox.lo, d_str[receiver], strict=True))
        cls = geometry(extent, isz, strides, d_str[receiver])
        # Every piece inside the shard it reads and the one it writes, in the buffers' own bytes.
        if soff + cls.extent(cls.src_strides) > storage_bytes(src.np_dtype, box.volume) or doff + cls.extent(
            cls.dst_strides
        ) > storage_bytes(dst.np_dtype, rbox.volume):
            raise ValueError(f"lower_local: move {i} of {spec.name} ({lo}..{hi}) runs past the end of a shard")
        groups.setdefault((stage, kind, cls), []).append((slot, soff, d_slot[receiver], doff))
    by_stage: dict[int, list[ClassRows]] = {}
    for (stage, kind, cls), rows in sorted(groups.items(), key=lambda kv: kv[0][:2]):
        a = np.array(rows, dtype=np.int64).reshape(-1, 4)
        cols = [np.ascontiguousarray(a[:, k]) for k in range(4)]
        for col in cols:
            col.setflags(write=False)
        by_stage.setdefault(stage, []).append(ClassRows(cls, kind, *cols))
    return CopyLowering(
        stages=tuple(tuple(by_stage[s]) for s in sorted(by_stage)),
        link_bytes=tuple(sorted(links.items())),
        moves=len(tp),
    )


def addresses(rows: ClassRows, src_ptr: np.ndarray, dst_ptr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Absolute ``(src, dst)`` addresses of the pieces of ``rows`` for a batch of leaves (leaf-major).

    Args:
      src_ptr: ``(leaves, source slots)`` int64 base addresses of the source shards.
      dst_ptr: ``(leaves, destination slots)`` int64 base addresses of the destination shards.
    """
    base = dst_ptr if rows.reads == FROM_DST else src_ptr
    s = (base[:, rows.src_slot] + rows.src_off).ravel()
    d = (dst_ptr[:, rows.dst_slot] + rows.dst_off).ravel()
    return s, d
