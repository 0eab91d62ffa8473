"""The front door of ``transfer`` and ``transfer_into``: flatten once, check everything once, group by layout pair.

:func:`prepare` turns ``(x, target)`` into a :class:`Prepared`: the leaves, the
tree structure, and a cached :class:`Shape` of the transfer that every backend
consumes. The shape depends only on the cache key (tree structure, and per leaf
its shape, dtype, source sharding and target sharding, plus the mode, topology and
options), so the second call with the same key does no planning and no per-leaf
layout work. Leaves with the same (source layout, destination layout) form one
:class:`Group`: one plan, one copy lowering, whatever the number of leaves.

Every check runs here, before any byte moves, and every error names the leaf by
its key path and shows the values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jreshard.call.describe import describe
from jreshard.engine.prepared import Group, Kind, Mode, Prepared, Shape
from jreshard.errors import IndivisibleError, LayoutError, LayoutMismatchError, TopologyError
from jreshard.options import Options
from jreshard.sharding.caches import cache
from jreshard.sharding.jax import addressable_order
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Topology
from jreshard.types import PyTree, Target, TreeDef, TreeLeaf

__all__ = [
    "Call",
    "Group",
    "Kind",
    "LeafTarget",
    "Mode",
    "Prepared",
    "Shape",
    "flatten",
    "plain_key",
    "prepare",
    "shape_of",
    "target_sharding",
]


def _format_type() -> Any:
    from jax.experimental.layout import Format

    return Format


_FORMAT = _format_type()
_SPACE = jax.memory.Space
# Targets jax.device_put takes besides shardings, turned into one by :func:`_normalized`.
_OTHER_TARGETS = (jax.Device, jax.sharding.PartitionSpec, _FORMAT, _SPACE)


def _is_target_leaf(v: TreeLeaf) -> bool:
    return v is None or isinstance(v, (jax.sharding.Sharding, jax.ShapeDtypeStruct, jax.Array, *_OTHER_TARGETS))


def _normalized(t: Target, leaf: TreeLeaf, where: str) -> Any:
    """A target of the other kinds ``jax.device_put`` takes, as the sharding it means there.

    - a ``Device``: ``SingleDeviceSharding(device)``;
    - a ``PartitionSpec``: ``NamedSharding`` over the mesh set by ``jax.set_mesh``;
    - a ``Format``: its sharding, when its layout is ``None`` or the default (row-major) one;
    - a ``jax.memory.Space``: the leaf's sharding in that memory.

    Raises:
      LayoutError: a PartitionSpec with no mesh set, a Format with another layout.
    """
    if isinstance(t, jax.Device):
        return jax.sharding.SingleDeviceSharding(t)
    if isinstance(t, jax.sharding.PartitionSpec):
        mesh = jax.sharding.get_mesh()
        if mesh.empty:
            raise LayoutError(
                f"{where} is the PartitionSpec {t}, which names no devices and no mesh is set; the fix is "
                f"jax.sharding.NamedSharding(mesh, {t}), or the call under `with jax.set_mesh(mesh):`"
            )
        return jax.sharding.NamedSharding(mesh, t)
    if isinstance(t, _FORMAT):
        lay = t.layout
        ndim = len(getattr(leaf, "shape", ()))
        default = lay is None or (
            getattr(lay, "major_to_minor", None) == tuple(range(ndim))
            and not getattr(lay, "tiling", None)
            and not getattr(lay, "sub_byte_element_size_in_bits", 0)
        )
        if not default:
            raise LayoutError(
                f"{where} is {t}: jreshard writes row-major shards only; the fix is Format(None, sharding) "
                "or the sharding itself, then jax.device_put(result, format) for another layout"
            )
        return t.sharding
    if isinstance(t, _SPACE):
        if t is _SPACE.Any:
            raise LayoutError(f"{where} is {t}, which names no memory; the fix is jax.memory.Space.Device or Host")
        kind = "pinned_host" if t is _SPACE.Host else "device"
        return leaf.sharding.with_memory_kind(kind)
    return t


def flatten(x: PyTree, target: PyTree, what: str = "target") -> tuple[list[Any], Any, list[Any]]:
    """``(leaves, treedef, targets)``: ``x`` flattened once, and ``target`` flattened up to its structure
    (one Sharding or ShapeDtypeStruct: every leaf).

    Raises:
      LayoutMismatchError: ``target`` (named ``what`` in the message) does not match the structure of ``x``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if what == "target" and _is_target_leaf(target) and target is not None:
        if isinstance(target, _OTHER_TARGETS):
            if isinstance(target, _SPACE):  # the leaf's own sharding, in that memory
                return leaves, treedef, [_normalized(target, leaf, "the target") for leaf in leaves]
            target = _normalized(target, leaves[0] if leaves else None, "the target")
        return leaves, treedef, [target] * len(leaves)
    try:
        targets = _up_to(treedef, target)
    except (ValueError, TypeError):
        prefix = _prefix(x, target, treedef) if what == "target" else None
        if prefix is None:
            # (flatten_up_to's own message prints the values: the structures say what differs.)
            theirs = jax.tree_util.tree_structure(target, is_leaf=_is_target_leaf)
            raise LayoutMismatchError(
                f"{what} has structure {theirs}, which does not match the structure of x ({treedef})",
                src=treedef,
                dst=target,
                what="structure",
            ) from None
        targets = prefix
    if what == "target":
        try:
            for i, t in enumerate(targets):
                if isinstance(t, _OTHER_TARGETS):
                    targets[i] = _normalized(t, leaves[i], f"the target of leaf #{i}")
        except LayoutError as err:  # name the leaf by its key path (the error path only)
            raise LayoutError(_renamed(str(err), leaf_names(treedef, x))) from None
    return leaves, treedef, targets


@dataclasses.dataclass(frozen=True, slots=True)
class LeafTarget:
    """What one leaf of a call becomes, once its target is checked.

    Attributes:
      sharding: the result's sharding (``None``: the leaf is returned as it is).
      dtype: the result's dtype.
      view: the view that computes the result (a call with views among its leaves), else ``None``.
    """

    sharding: Any
    dtype: Any
    view: Any = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """One ``transfer`` / ``transfer_into`` call, flattened once: every path reads its leaves from here.

    Attributes:
      mode: new arrays, or writes into the caller's ``into`` arrays.
      leaves: ``x``'s leaves (arrays, views, host data).
      treedef: ``x``'s tree structure (results are unflattened with it).
      targets: per leaf, its target leaf as given (``into`` arrays for ``Mode.INTO``), flattened up to
        ``x``'s structure, device and spec targets already turned into shardings.
      resolved: per leaf, its checked :class:`LeafTarget`, once the path that runs the call has
        checked the targets (:meth:`with_targets`); empty before.
      x: the tree itself, read only to name a leaf by its key path in an error message.
    """

    mode: Mode
    leaves: list[Any]
    treedef: Any
    targets: list[Any]
    resolved: tuple[LeafTarget, ...] = ()
    x: PyTree = None

    @classmethod
    def of(cls, x: PyTree, target: PyTree, mode: Mode) -> Call:
        """``x`` and its target (``into`` for ``Mode.INTO``), flattened once (:func:`flatten`).

        Raises:
          LayoutMismatchError: the target does not match the structure of ``x``.
        """
        leaves, treedef, targets = flatten(x, target, "into" if mode is Mode.INTO else "target")
        return cls(mode=mode, leaves=leaves, treedef=treedef, targets=targets, x=x)

    def with_targets(self, resolved: Sequence[LeafTarget]) -> Call:
        """This call with its checked per-leaf targets."""
        if len(resolved) != len(self.leaves):
            raise ValueError(f"Call.with_targets: {len(resolved)} targets for {len(self.leaves)} leaves")
        return dataclasses.replace(self, resolved=tuple(resolved))

    def unflatten(self, out: Sequence[Any]) -> PyTree:
        """The result tree: ``out`` (one per leaf) in ``x``'s structure."""
        return self.treedef.unflatten(list(out))


def _up_to(treedef: TreeDef, target: PyTree) -> list[Any]:
    """``target`` flattened up to ``x``'s structure: the one flattening of a call's target tree."""
    tree: Any = treedef  # (jax's stubs do not declare PyTreeDef.flatten_up_to)
    return list(tree.flatten_up_to(target))


def _prefix(x: PyTree, target: PyTree, treedef: TreeDef) -> list[Any] | None:
    """``target`` as one target per leaf of ``x`` when it is a tree prefix of ``x`` (as ``jax.device_put``
    takes it: each target leaf applies to the whole subtree below it), else ``None``."""
    try:
        full = jax.tree.broadcast(target, x, is_leaf=_is_target_leaf)
        tree: Any = treedef
        return list(tree.flatten_up_to(full))
    except (ValueError, TypeError):
        return None


def leaf_names(treedef: TreeDef, x: PyTree) -> tuple[str, ...]:
    """The key path of every leaf (``"x"`` for a bare array), for messages."""
    paths = jax.tree_util.tree_flatten_with_path(x)[0]
    return tuple(jax.tree_util.keystr(p) or "x" for p, _ in paths)


def target_sharding(t: Target, where: str) -> Any:
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


def _check_leaf(leaf: TreeLeaf, where: str) -> None:
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


# A layout jax reports for an array's shards (a PjRtLayout, hashable) -> whether it is row-major.
_ROW_MAJOR_LAYOUTS: dict[Any, bool] = {}


def _row_major(arr: Any) -> bool:
    """Whether ``arr``'s shards are known to be row-major: jax's layout object looked up in a table of the
    layouts seen (about 0.35 us), where reading its dimension order costs about 1 us. ``False`` when
    unknown (the full checks of :func:`prepare` then decide)."""
    try:
        lay = arr._pjrt_layout
    except Exception:  # another jax, or a backend without layouts
        return False
    known = _ROW_MAJOR_LAYOUTS.get(lay)
    if known is None:
        m2m = _major_to_minor(arr)
        known = m2m is not None and m2m == _ROW_MAJOR[arr.ndim]
        if len(_ROW_MAJOR_LAYOUTS) >= 256:
            _ROW_MAJOR_LAYOUTS.clear()
        _ROW_MAJOR_LAYOUTS[lay] = known
    return known


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


def prepare(
    leaves: list[Any],
    treedef: TreeDef,
    targets: list[Any],
    mode: Mode,
    topology: Topology | None,
    options: Options,
    x: PyTree = None,
) -> Prepared:
    """Check one call's flat leaves and targets (from :func:`flatten`) and look up its cached :class:`Shape`.

    ``x`` (the unflattened tree) is read only on the error path, to name the leaf by its key path.

    Raises:
      LayoutMismatchError: structure, shape or dtype differ between ``x`` and its target.
      LayoutError, IndivisibleError, TopologyError: a leaf or a target is unusable (the message
        names the leaf's key path and the values).
    """
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
            specs.append((dims, dtype, leaf.sharding, sh, getattr(leaf, "_committed", True)))
        key = (treedef, tuple(specs), mode, topology, options)
        cached = _shape(key)
    except (LayoutError, TopologyError, LayoutMismatchError) as err:
        if not leaves or x is None:
            raise
        # Name leaves by key path: computed only on the error path (it costs a second flatten).
        names = leaf_names(treedef, x)
        message = _renamed(str(err), names)
        if isinstance(err, LayoutMismatchError):
            raise LayoutMismatchError(message, src=err.src, dst=err.dst, what=err.what) from None
        raise type(err)(message) from err.__cause__
    return Prepared(mode, leaves, targets, treedef, cached)


# The target types a plain call's targets are (a type check is cheaper than ``isinstance``).
_PLAIN_TARGETS = frozenset({jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding})


def plain_key(
    leaves: list[Any], treedef: TreeDef, targets: list[Any], mode: Mode, topology: Topology | None, options: Options
) -> tuple | None:
    """The cache key :func:`prepare` computes for a plain call, read in one pass over its leaves; ``None``
    for any other call, which takes the full checks.

    Plain: every leaf is a live ``jax.Array`` whose shards are row-major; for ``transfer_into`` every
    ``into`` leaf is one too (or ``None``), of its leaf's shape and dtype; for ``transfer`` every target
    is a ``NamedSharding`` or ``SingleDeviceSharding`` (or ``None``). This pass makes every check
    :func:`prepare` makes leaf by leaf; the others depend on the key alone (:func:`_shape`, cached per key).
    """
    array, shardings, into = _ARRAY, _PLAIN_TARGETS, mode is Mode.INTO
    specs = []
    for leaf, t in zip(leaves, targets, strict=True):
        if type(leaf) is not array or leaf.is_deleted():
            return None
        aval = leaf.aval
        dims, dtype = aval.shape, aval.dtype
        if len(dims) > 1 and not _row_major(leaf):
            return None
        if into and t is not None:
            if type(t) is not array or t.is_deleted():
                return None
            theirs = t.aval
            if theirs.shape != dims or theirs.dtype != dtype or (len(dims) > 1 and not _row_major(t)):
                return None
            sh = t.sharding
        elif t is None or type(t) in shardings:
            sh = t
        else:
            return None
        specs.append((dims, dtype, leaf.sharding, sh, leaf._committed))
    return (treedef, tuple(specs), mode, topology, options)


def shape_of(key: tuple) -> Shape:
    """The :class:`Shape` of a call with this key (:func:`plain_key`), cached per key as :func:`prepare` caches it.

    Raises:
      LayoutError, IndivisibleError, TopologyError: as :func:`prepare`, naming the leaf by its number only.
    """
    return _shape(key)


def _renamed(message: str, names: tuple[str, ...]) -> str:
    import re

    return re.sub(r"leaf #(\d+)", lambda m: f"leaf {names[int(m.group(1))]}", message, count=1)


@cache(max_size=256)
def _shape(key: tuple) -> Shape:
    _treedef, specs, mode, _topology, _options = key
    kinds: list[Kind] = []
    shardings: list[Any] = []
    by_pair: dict[tuple[Layout, Layout], list[int]] = {}
    for i, (shape, dtype, src_sh, dst_sh, committed) in enumerate(specs):
        where = f"leaf #{i}"
        # A committed leaf already on its target is returned as it is (device_put returns it too). An
        # uncommitted one is copied: device_put would return a new, committed array over its buffers,
        # which a later donation of the leaf deletes (docs/transfer.md, "Where jreshard differs").
        if dst_sh is None or (mode is Mode.TRANSFER and dst_sh == src_sh and committed):
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
            src_order.append(tuple(s_slot[d.id] for d in addressable_order(src_sh)))
            devs = addressable_order(dst_sh)
            dst_order.append(tuple(d_slot[d.id] for d in devs))
            devices.append(list(devs))
        groups.append(Group(src, dst, tuple(idx), tuple(src_order), tuple(dst_order), tuple(devices)))
    return Shape(kinds=tuple(kinds), groups=tuple(groups), shardings=tuple(shardings))
