"""The front door of every transfer: flatten once, check everything once, group by layout pair.

:func:`prepare` turns ``(x, target)`` into a :class:`Prepared`: the leaves, the
tree structure, and a cached :class:`Shape` of the transfer that every backend
consumes. The shape depends only on the cache key (tree structure, and per leaf
its shape, dtype, source sharding and target sharding, plus the mode, topology and
options), so the second call with the same key does no planning and no per-leaf
layout work. Leaves with the same (source layout, destination layout) form one
:class:`Group`: one plan, one lowered copy program, whatever the number of leaves.

Every check runs here, before any byte moves, and every error names the leaf by
its key path and shows the values.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import numpy as np

from jreshard._cache import cache
from jreshard.describe import describe
from jreshard.errors import IndivisibleError, LayoutError, LayoutMismatchError, TopologyError
from jreshard.options import Options
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Topology

__all__ = ["Group", "Kind", "Mode", "Prepared", "Shape", "flatten", "prepare", "target_sharding"]

PyTree = Any


class Mode(enum.Enum):
    """What the call writes: new arrays (``transfer``) or the caller's ``into`` arrays."""

    TRANSFER = "transfer"
    INTO = "into"


class Kind(enum.IntEnum):
    """What happens to one leaf."""

    KEEP = 0  # returned as it is: a None target, or (transfer) the very same sharding
    MOVE = 1  # bytes move into new or donated destination shards


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Group:
    """Moved leaves that share a (source layout, destination layout) pair.

    Attributes:
      src, dst: the layouts.
      leaves: the leaf indices of the group, in tree order.
      src_order: per leaf of the group, for each of its source array's addressable
        shards (in ``addressable_data`` order), the source slot it fills.
      dst_order: per leaf, for each device of its target sharding (in the order jax
        assembles them), the destination slot it holds.
      devices: per leaf, the target sharding's devices in that order.
    """

    src: Layout
    dst: Layout
    leaves: tuple[int, ...]
    src_order: tuple[tuple[int, ...], ...]
    dst_order: tuple[tuple[int, ...], ...]
    devices: tuple[list[Any], ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Shape:
    """Everything about a transfer that depends only on its cache key.

    Attributes:
      kinds: per leaf, kept or moved.
      groups: the moved leaves, grouped by layout pair.
      shardings: per leaf, the target sharding (``None`` for a kept leaf).
    """

    kinds: tuple[Kind, ...]
    groups: tuple[Group, ...]
    shardings: tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Prepared:
    """One call: its leaves, targets, tree structure and cached :class:`Shape`."""

    mode: Mode
    leaves: list[Any]
    targets: list[Any]
    treedef: Any
    shape: Shape


def _is_target_leaf(v: Any) -> bool:
    return v is None or isinstance(
        v, (jax.sharding.Sharding, jax.ShapeDtypeStruct, jax.sharding.PartitionSpec, jax.Array)
    )


def flatten(x: PyTree, target: PyTree, what: str = "target") -> tuple[list[Any], Any, list[Any]]:
    """``(leaves, treedef, targets)``: ``x`` flattened once, and ``target`` flattened up to its structure
    (one Sharding or ShapeDtypeStruct: every leaf).

    Raises:
      LayoutMismatchError: ``target`` (named ``what`` in the message) does not match the structure of ``x``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if what == "target" and _is_target_leaf(target) and target is not None:
        return leaves, treedef, [target] * len(leaves)
    tree: Any = treedef  # (jax's stubs do not declare PyTreeDef.flatten_up_to)
    try:
        targets = tree.flatten_up_to(target)
    except (ValueError, TypeError):
        # (flatten_up_to's own message prints the values: the structures say what differs.)
        theirs = jax.tree_util.tree_structure(target, is_leaf=_is_target_leaf)
        raise LayoutMismatchError(
            f"{what} has structure {theirs}, which does not match the structure of x ({treedef})",
            src=treedef,
            dst=target,
            what="structure",
        ) from None
    return leaves, treedef, targets


def leaf_names(treedef: Any, x: PyTree) -> tuple[str, ...]:
    """The key path of every leaf (``"x"`` for a bare array), for messages."""
    paths = jax.tree_util.tree_flatten_with_path(x)[0]
    return tuple(jax.tree_util.keystr(p) or "x" for p, _ in paths)


def target_sharding(t: Any, where: str) -> Any:
    """The sharding a target leaf asks for (a Sharding, or a ShapeDtypeStruct's or jax.Array's), or ``None``.

    Raises:
      LayoutError: a PartitionSpec (no mesh), a ShapeDtypeStruct without a sharding, or
        anything else that is not a sharding.
    """
    if t is None or isinstance(t, jax.sharding.Sharding):
        return t
    if isinstance(t, jax.Array) and not isinstance(t, jax.core.Tracer):
        return t.sharding
    if isinstance(t, jax.sharding.PartitionSpec):
        raise LayoutError(
            f"{where} is the PartitionSpec {t}, which names no devices; the fix is "
            f"jax.sharding.NamedSharding(mesh, {t})"
        )
    if isinstance(t, jax.ShapeDtypeStruct):
        if t.sharding is None:
            raise LayoutError(f"{where} is {t} with no sharding; the fix is jax.ShapeDtypeStruct(..., sharding=...)")
        return t.sharding
    raise LayoutError(
        f"{where} is {describe(t)}; expected a jax Sharding, a ShapeDtypeStruct, a jax.Array (its sharding) or None"
    )


def _check_leaf(leaf: Any, where: str) -> None:
    if isinstance(leaf, jax.core.Tracer):
        raise LayoutError(
            f"{where} is a traced value ({type(leaf).__name__}): jreshard moves concrete arrays and runs "
            "outside jax.jit / jax.grad / vmap; the fix is to call it from Python, not from a traced function"
        )
    if not isinstance(leaf, jax.Array):
        raise LayoutError(
            f"{where} is {type(leaf).__name__} {np.shape(leaf)}, not a jax.Array; transfer takes jax arrays, numpy "
            "arrays and scalars, transfer_into jax arrays: the fix is jax.device_put(value, sharding) for host data"
        )
    if leaf.is_deleted():
        raise LayoutError(f"{where} has been deleted or donated; the fix is to pass a live array")


_ROW_MAJOR = tuple(tuple(range(n)) for n in range(64))


def _array_type() -> Any:
    """The concrete class of every ``jax.Array`` (a type check is cheaper than ``isinstance``); where it is
    not found, ``jax.Array`` itself, which no value has as its exact type: every leaf takes the full check."""
    try:
        from jax._src.array import ArrayImpl

        return ArrayImpl
    except ImportError:  # pragma: no cover - another jax
        return jax.Array


_ARRAY = _array_type()


def _major_to_minor(arr: Any) -> tuple[int, ...] | None:
    """The memory layout of an array's shards, major dimension first (``None``: unknown)."""
    try:  # the fast path: the runtime's own layout object (``arr.format`` builds Python objects around it)
        return tuple(arr._pjrt_layout._xla_layout().minor_to_major())[::-1]
    except Exception:
        pass
    try:
        lay = getattr(arr.format, "layout", None)
    except Exception:  # pragma: no cover - a backend without layouts
        return None
    m2m = getattr(lay, "major_to_minor", None)
    return None if m2m is None else tuple(m2m)


def _check_default_layout(arr: Any, where: str) -> None:
    """Refuse arrays whose memory layout is not row-major: jreshard reads and writes shards as C-order bytes."""
    m2m = _major_to_minor(arr)
    if m2m is not None and m2m != tuple(range(arr.ndim)):
        raise LayoutError(
            f"{where} has memory layout major_to_minor={m2m}; jreshard reads and writes row-major shards "
            f"only (major_to_minor={tuple(range(arr.ndim))}): the fix is an array in the default layout"
        )


def _check_sharding(sh: Any, where: str) -> None:
    try:
        devices = sh.device_set
    except Exception as err:  # an abstract mesh has no devices
        raise TopologyError(f"{where} has target {sh} with no concrete devices: {err}") from err
    kind = getattr(sh, "memory_kind", None)
    if kind not in (None, "device"):
        raise LayoutError(
            f"{where} has target memory_kind={kind!r}; jreshard writes device memory only: the fix is "
            "jax.device_put(result, sharding.with_memory_kind(...)) after the transfer"
        )
    known = _local_devices()
    missing = sorted(d.id for d in devices if d not in known)
    if missing:
        raise TopologyError(f"{where} has target on devices {missing} that this process cannot address")


@cache(max_size=1)
def _local_devices() -> frozenset:
    return frozenset(jax.local_devices())


def prepare(x: PyTree, target: PyTree, mode: Mode, topology: Topology | None, options: Options) -> Prepared:
    """Flatten, check and look up the cached :class:`Shape` of one call.

    Raises:
      LayoutMismatchError: structure, shape or dtype differ between ``x`` and its target.
      LayoutError, IndivisibleError, TopologyError: a leaf or a target is unusable (the message
        names the leaf's key path and the values).
    """
    leaves, treedef, targets = flatten(x, target, mode.value if mode is Mode.INTO else "target")
    try:
        specs = []
        for i, (leaf, t) in enumerate(zip(leaves, targets, strict=True)):
            # The common case costs a few attribute reads; messages are built only on the error path.
            if type(leaf) is not _ARRAY or leaf.is_deleted():
                _check_leaf(leaf, f"leaf #{i} of x")
            dims, dtype = leaf.shape, leaf.dtype
            if len(dims) > 1 and _major_to_minor(leaf) not in (None, _ROW_MAJOR[len(dims)]):
                _check_default_layout(leaf, f"leaf #{i} of x")
            if mode is Mode.INTO and t is not None:
                if type(t) is not _ARRAY:
                    _check_leaf(t, f"leaf #{i} of into")
                if t.shape != dims or t.dtype != dtype:
                    raise LayoutMismatchError(
                        f"leaf #{i} is {dtype}{list(dims)} but into holds {t.dtype}{list(t.shape)}",
                        src=(dims, dtype),
                        dst=(t.shape, t.dtype),
                        what="shape" if t.shape != dims else "dtype",
                    )
                if len(dims) > 1 and not t.is_deleted() and _major_to_minor(t) not in (None, _ROW_MAJOR[len(dims)]):
                    _check_default_layout(t, f"leaf #{i} of into")
                sh = t.sharding
            elif t is None or type(t) is jax.sharding.NamedSharding:
                sh = t
            else:
                sh = target_sharding(t, f"the target of leaf #{i}")
                if isinstance(t, (jax.ShapeDtypeStruct, jax.Array)) and (t.shape != dims or t.dtype != dtype):
                    raise LayoutMismatchError(
                        f"leaf #{i} is {dtype}{list(dims)} but its target is {t}; casting needs jreshard.views.astype",
                        src=(dims, dtype),
                        dst=(t.shape, t.dtype),
                        what="shape" if t.shape != dims else "dtype",
                    )
            specs.append((dims, dtype, leaf.sharding, sh))
        key = (treedef, tuple(specs), mode, topology, options)
        cached = _shape(key)
    except (LayoutError, TopologyError, LayoutMismatchError) as err:
        if not leaves:
            raise
        # Name leaves by key path: computed only on the error path (it costs a second flatten).
        names = leaf_names(treedef, x)
        message = _renamed(str(err), names)
        if isinstance(err, LayoutMismatchError):
            raise LayoutMismatchError(message, src=err.src, dst=err.dst, what=err.what) from None
        raise type(err)(message) from err.__cause__
    return Prepared(mode, leaves, targets, treedef, cached)


def _renamed(message: str, names: tuple[str, ...]) -> str:
    import re

    return re.sub(r"leaf #(\d+)", lambda m: f"leaf {names[int(m.group(1))]}", message, count=1)


@cache(max_size=256)
def _shape(key: tuple) -> Shape:
    _treedef, specs, mode, _topology, _options = key
    kinds: list[Kind] = []
    shardings: list[Any] = []
    by_pair: dict[tuple[Layout, Layout], list[int]] = {}
    for i, (shape, dtype, src_sh, dst_sh) in enumerate(specs):
        where = f"leaf #{i}"
        if dst_sh is None or (mode is Mode.TRANSFER and dst_sh == src_sh):
            kinds.append(Kind.KEEP)
            shardings.append(None)
            continue
        kind = getattr(src_sh, "memory_kind", None)
        if kind not in (None, "device"):
            raise LayoutError(f"{where} of x lives in memory_kind={kind!r}; jreshard reads device memory only")
        _check_sharding(src_sh, f"{where} of x")
        _check_sharding(dst_sh, where)
        try:
            src = Layout.from_sharding(src_sh, shape, dtype)
            dst = Layout.from_sharding(dst_sh, shape, dtype)
        except IndivisibleError as err:
            raise IndivisibleError(f"{where} of shape {tuple(shape)}: {err}") from err
        except LayoutError as err:  # a spec naming unknown axes...
            raise type(err)(f"{where} of shape {tuple(shape)}: {err}") from err
        kinds.append(Kind.MOVE)
        shardings.append(dst_sh)
        by_pair.setdefault((src, dst), []).append(i)
    groups = []
    for (src, dst), idx in by_pair.items():
        s_slot = {r: k for k, r in enumerate(src.ranks)}
        d_slot = {r: k for k, r in enumerate(dst.ranks)}
        src_order, dst_order, devices = [], [], []
        for i in idx:
            src_sh, dst_sh = specs[i][2], specs[i][3]
            src_order.append(tuple(s_slot[d.id] for d in _addressable_order(src_sh)))
            devs = _addressable_order(dst_sh)
            dst_order.append(tuple(d_slot[d.id] for d in devs))
            devices.append(list(devs))
        groups.append(Group(src, dst, tuple(idx), tuple(src_order), tuple(dst_order), tuple(devices)))
    return Shape(kinds=tuple(kinds), groups=tuple(groups), shardings=tuple(shardings))


def _addressable_order(sharding: Any) -> tuple[Any, ...]:
    """The devices of a sharding in the order jax lists an array's shards (``addressable_data``)."""
    try:
        return tuple(sharding._internal_device_list.addressable_device_list)
    except AttributeError:  # pragma: no cover - another jax: the same order under its older name
        return tuple(sharding._addressable_device_assignment)
