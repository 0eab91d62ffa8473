"""The program of an in-process transfer: which leaves move, and every direct copy.

When every device taking part is addressable in this process, each piece of each
destination shard is copied straight from a source shard that holds it (see
:mod:`jreshard.nccl.local`). Everything that depends only on the pytree
structure, the shapes, dtypes and shardings of its leaves, the topology and the
options is computed here once per cache key: the layouts, the pieces, the
descriptor tables, the bytes per link. ``jreshard.api`` looks it up on every call.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jreshard.errors import LayoutError, LayoutMismatchError, TopologyError
from jreshard.nccl import kernels
from jreshard.nccl.local import DirectProgram, direct_copies
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Link, Topology

__all__ = ["DirectTransfer", "Kind", "assemble", "direct_transfer", "flatten", "local_devices", "prepare"]


class Kind(enum.IntEnum):
    """What happens to one leaf."""

    KEEP = 0  # the leaf stays as it is (a None target, or the very same sharding)
    REWRAP = 1  # same shards on the same devices: a new jax.Array over the same buffers
    MOVE = 2  # bytes move


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DirectTransfer:
    """Everything about one in-process transfer that depends only on its cache key.

    Attributes:
      kinds: per leaf, whether it is kept, re-wrapped over the same buffers, or moved.
      moves: the leaf index of each moved tensor (tensor ``t`` is leaf ``moves[t]``).
      pairs: ``(source layout, destination layout)`` per moved tensor.
      names: leaf names for messages.
      src_keys: ``(tensor, rank)`` of each source buffer the copies read, in buffer-list order.
      dst_keys: ``(tensor, rank)`` of each destination buffer written, in buffer-list order.
      aliases: ``(tensor, rank)`` whose destination shard is the source shard itself.
      direct: the copies, as descriptor tables over those two buffer lists.
    """

    kinds: tuple[Kind, ...]
    moves: tuple[int, ...]  # leaf index of each moved tensor
    pairs: tuple[tuple[Layout, Layout], ...]  # per moved tensor
    names: tuple[str, ...]
    src_keys: tuple[tuple[int, int], ...]  # (moved tensor, rank) of each source buffer
    dst_keys: tuple[tuple[int, int], ...]  # (moved tensor, rank) of each written destination buffer
    aliases: frozenset[tuple[int, int]]  # (moved tensor, rank): the destination shard is the source shard
    direct: DirectProgram
    link_bytes: tuple[tuple[Link, int], ...]  # bytes the direct copies move over each link kind

    def dst_shape(self, t: int, r: int) -> tuple[int, ...]:
        """The element shape of moved tensor ``t``'s destination shard on rank ``r``."""
        return self.pairs[t][1].box_of(r).shape

    def dst_nbytes(self, t: int, r: int) -> int:
        """The bytes of moved tensor ``t``'s destination shard on rank ``r``."""
        return self.pairs[t][1].box_of(r).volume * self.pairs[t][0].itemsize


def _same_boxes(a: Layout, b: Layout) -> bool:
    return a._index() == b._index()


@functools.lru_cache(maxsize=64)
def direct_transfer(key: tuple, mode: str) -> DirectTransfer:
    """The :class:`DirectTransfer` of a cache key (cached: the second call of a key does no planning).

    Args:
      key: ``(treedef, leaves, topology, options)`` where each leaf is
        ``(shape, numpy dtype, source sharding, target sharding or None)``.
      mode: ``"transfer"`` (new buffers; a shard already in place is shared) or
        ``"into"`` (every destination shard is written).

    Raises:
      LayoutError: a sharding cannot hold its leaf (``IndivisibleError``, unknown axes...).
    """
    _treedef, leaves, topology, options = key[0], key[1], key[2], key[3]
    names = tuple(str(i) for i in range(len(leaves)))
    kinds, moves, pairs = [], [], []
    for i, (shape, dtype, src_sh, dst_sh) in enumerate(leaves):
        if dst_sh is None or (mode == "transfer" and dst_sh == src_sh):
            kinds.append(Kind.KEEP)
            continue
        try:
            src, dst = Layout.from_sharding(src_sh, shape, dtype), Layout.from_sharding(dst_sh, shape, dtype)
        except LayoutError as err:  # IndivisibleError, a spec naming unknown axes...
            raise type(err)(f"leaf #{i} of shape {shape}: {err}") from err
        if mode == "transfer" and _same_boxes(src, dst):
            kinds.append(Kind.REWRAP)
            continue
        kinds.append(Kind.MOVE)
        moves.append(i)
        pairs.append((src, dst))
    src_keys: dict[tuple[int, int], int] = {}
    dst_keys: dict[tuple[int, int], int] = {}
    aliases: set[tuple[int, int]] = set()
    rows = []
    links = dict.fromkeys(Link, 0)
    for t, (src, dst) in enumerate(pairs):
        isz = src.itemsize
        sidx, didx = src._index(), dst._index()
        for r, h, box in direct_copies(src, dst):
            if mode == "transfer" and r in sidx and sidx[r] == didx[r]:
                aliases.add((t, r))  # a shard already where it must be: share its buffer
                continue
            sb, db, bb = kernels.byte_box(sidx[h], isz), kernels.byte_box(didx[r], isz), kernels.byte_box(box, isz)
            si = src_keys.setdefault((t, h), len(src_keys))
            di = dst_keys.setdefault((t, r), len(dst_keys))
            rows.append((si, sb.shape, bb.relative_to(sb), di, db.shape, bb.relative_to(db)))
            links[_link(topology, h, r)] += bb.volume
        for r in dst.ranks:  # shards with nothing to copy (zero-size) still need a buffer
            if (t, r) not in aliases:
                dst_keys.setdefault((t, r), len(dst_keys))
    return DirectTransfer(
        kinds=tuple(kinds),
        moves=tuple(moves),
        pairs=tuple(pairs),
        names=names,
        src_keys=tuple(src_keys),
        dst_keys=tuple(dst_keys),
        aliases=frozenset(aliases),
        direct=DirectProgram.build(rows, threads=options.copy_threads if options is not None else None),
        link_bytes=tuple((k, v) for k, v in links.items() if v),
    )


def _link(topology: Topology | None, src: int, dst: int) -> Link:
    """The link of a direct copy: the topology's, or by default (one domain per host) local or fast."""
    if topology is not None:
        return topology.link(src, dst)
    return Link.LOCAL if src == dst else Link.FAST


def _leaf_error(i: int, names: Sequence[str], what: str) -> str:
    return f"leaf {names[i]} (#{i}) {what}"


def _check_source(leaf: Any, i: int, names: Sequence[str], which: str = "source") -> None:
    if not isinstance(leaf, jax.Array):
        raise LayoutError(_leaf_error(i, names, f"of the {which} is {type(leaf).__name__}, not a jax.Array"))
    if leaf.is_deleted():
        raise LayoutError(
            _leaf_error(i, names, f"of the {which} has been deleted or donated; the fix is to pass a live array")
        )
    if not leaf.is_fully_addressable:
        raise TopologyError(
            _leaf_error(i, names, f"of the {which} spans other processes; transfer() runs in one process")
        )


def _check_target(sharding: Any, i: int, names: Sequence[str]) -> None:
    if not isinstance(sharding, jax.sharding.Sharding):
        raise LayoutError(_leaf_error(i, names, f"has target {sharding!r}; expected a jax Sharding or None"))
    try:
        devices = sharding.device_set
    except Exception as err:  # an abstract mesh has no devices
        raise TopologyError(_leaf_error(i, names, f"has target {sharding} with no concrete devices: {err}")) from err
    known = local_devices()
    missing = [d for d in devices if d not in known]
    if missing:
        raise TopologyError(
            _leaf_error(i, names, f"has target on devices {missing} that this process cannot address (local {known})")
        )


@functools.cache
def local_devices() -> frozenset:
    """This process's jax devices."""
    return frozenset(jax.local_devices())


def flatten(x: Any, target: Any, what: str) -> tuple[list, Any, list, list[str]]:
    """``(leaves, treedef, targets, names)`` of ``x`` and its target tree (one Sharding: every leaf).

    Raises:
      LayoutMismatchError: ``target`` does not match the structure of ``x``.
    """
    leaves_p, treedef = jax.tree_util.tree_flatten_with_path(x)
    names = [jax.tree_util.keystr(p) or "x" for p, _ in leaves_p]
    leaves = [v for _, v in leaves_p]
    if what == "target" and isinstance(target, jax.sharding.Sharding):
        return leaves, treedef, [target] * len(leaves), names
    try:
        targets = treedef.flatten_up_to(target)
    except (ValueError, TypeError) as err:
        raise LayoutMismatchError(
            f"{what} does not match the structure of x ({treedef}): {err}", src=treedef, dst=target, what="structure"
        ) from None
    return leaves, treedef, targets, names


def prepare(
    leaves: list, treedef: Any, targets: list, names: Sequence[str], what: str, topology: Topology | None, options: Any
) -> DirectTransfer:
    """Check every leaf and target (before any byte moves) and look up the cached program.

    Args:
      leaves, treedef, targets, names: from :func:`flatten`.
      what: ``"target"`` (targets are shardings or None) or ``"into"`` (destination arrays or None).
      topology, options: part of the cache key.

    Raises:
      LayoutError, LayoutMismatchError, IndivisibleError, TopologyError: see ``jreshard.transfer``.
    """
    specs = []
    for i, (leaf, tgt) in enumerate(zip(leaves, targets, strict=True)):
        _check_source(leaf, i, names)
        if what == "into" and tgt is not None:
            _check_source(tgt, i, names, "destination (into)")
            if tgt.shape != leaf.shape or tgt.dtype != leaf.dtype:
                have = f"is {leaf.dtype}{list(leaf.shape)} but into holds {tgt.dtype}{list(tgt.shape)}"
                raise LayoutMismatchError(
                    _leaf_error(i, names, have),
                    src=(leaf.shape, leaf.dtype),
                    dst=(tgt.shape, tgt.dtype),
                    what="shape" if tgt.shape != leaf.shape else "dtype",
                )
            sh = tgt.sharding
        else:
            sh = tgt
        if sh is not None:
            _check_target(sh, i, names)
        specs.append((tuple(leaf.shape), np.dtype(leaf.dtype), leaf.sharding, sh))
    key = (treedef, tuple(specs), topology, options)
    return direct_transfer(key, "into" if what == "into" else "transfer")


def assemble(prog: DirectTransfer, leaves: list, targets: list, parts: dict, what: str) -> list:
    """The result leaves: kept, re-wrapped, or assembled from ``parts[t]`` (shards of moved tensor ``t``)."""
    out = []
    t = 0
    for i, kind in enumerate(prog.kinds):
        leaf, tgt = leaves[i], targets[i]
        sh = tgt.sharding if what == "into" and tgt is not None else tgt
        if kind == Kind.KEEP:
            out.append(leaf if what != "into" or tgt is None else tgt)
        elif kind == Kind.REWRAP:
            same = [s.data for s in leaf.addressable_shards]
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, sh, same))
        else:
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, sh, parts[t]))
            t += 1
    return out
