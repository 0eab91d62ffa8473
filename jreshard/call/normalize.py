"""What ``jax.device_put`` takes, in the terms the front door takes: one pass before a ``transfer``.

``transfer(x, target)`` accepts what ``jax.device_put(x, shardings)`` accepts and gives what it gives:

- **Array targets.** A target leaf that is a ``jax.Array`` means its sharding; of another dtype, it
  also means a cast to that dtype, as a ``jax.ShapeDtypeStruct`` target of another dtype does: the same
  as ``jreshard.views.astype``. The cast is ``jnp.astype`` (bit-exact) where the narrower dtype is:
  on the source devices before the move when the target dtype is narrower (or as wide: the usual
  trainer-float32 to rollout-bfloat16 direction), on the target devices after it when it is wider, so
  the narrower dtype is what crosses the links either way.
- **Host sources.** numpy arrays, numpy scalars and Python scalars are placed by ``jax.device_put``
  itself (one call for all of them; with a ``None`` target, on the default device, uncommitted, as
  ``jax.device_put(value)``): these bytes start on the host, so the transfer guard's host-to-device
  setting applies to them exactly as to ``device_put``.
- **Host memory kinds.** A leaf that lives in, or is sent to, ``pinned_host`` or ``unpinned_host``
  memory is moved by ``jax.device_put`` in this process (jreshard plans device memory only).

Everything else is returned untouched; nothing is flattened again (the front door flattened once).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np

from jreshard.call.describe import describe
from jreshard.call.front import _renamed, leaf_names
from jreshard.engine.arrays import empty_array
from jreshard.errors import LayoutMismatchError, TopologyError
from jreshard.types import DType, PyTree, Sharding, Target, TreeDef, TreeLeaf

__all__ = ["Normalized", "normalize"]


_HOST_SCALARS = (bool, int, float, complex, np.generic)
_DEVICE_KINDS = (None, "device")


def _is_host(leaf: TreeLeaf) -> bool:
    return isinstance(leaf, (np.ndarray, *_HOST_SCALARS)) and not isinstance(leaf, jax.Array)


def _on_device(leaf: TreeLeaf) -> bool:
    """A concrete jax array (a tracer is one too, but the front door refuses it by name)."""
    return isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)


def _memory_kind(sharding: Sharding) -> Any:
    return getattr(sharding, "memory_kind", None)


@dataclasses.dataclass(frozen=True, slots=True)
class _Leaf:
    """What one leaf needs before the front door: a cast to ``dtype`` and a sharding to ask for."""

    sharding: Sharding
    dtype: DType  # None: no cast


def _wanted(i: int, leaf: TreeLeaf, t: Target) -> _Leaf | None:
    """The target of leaf ``i`` when it needs this pass (an array target, a cast), else None.

    Raises:
      LayoutMismatchError: an array or ShapeDtypeStruct target of another shape.
    """
    if _on_device(t):
        sharding, shape, dtype = t.sharding, t.shape, t.dtype
    elif isinstance(t, jax.ShapeDtypeStruct) and t.sharding is not None:
        sharding, shape, dtype = t.sharding, t.shape, t.dtype
    else:
        return None
    here_shape, here_dtype = np.shape(leaf), _dtype_of(leaf)
    if tuple(shape) != tuple(here_shape):
        raise LayoutMismatchError(
            f"leaf #{i} is {here_dtype}{list(here_shape)} but its target is {describe(t)}: a target of "
            "another shape cannot hold it",
            src=(tuple(here_shape), here_dtype),
            dst=(tuple(shape), dtype),
            what="shape",
        )
    if dtype != here_dtype and (_extended(dtype) or _extended(here_dtype)):
        raise LayoutMismatchError(
            f"leaf #{i} is {here_dtype}{list(here_shape)} but its target is {describe(t)}: a typed PRNG key "
            "array is not cast to or from another dtype; the fix is a target of the leaf's own dtype "
            "(jax.random.key_data / wrap_key_data convert keys explicitly)",
            src=(tuple(here_shape), here_dtype),
            dst=(tuple(shape), dtype),
            what="dtype",
        )
    return _Leaf(sharding, None if dtype == here_dtype else dtype)


def _dtype_of(leaf: TreeLeaf) -> DType:
    """The dtype of a leaf as jax types it: numpy's, or an extended dtype (a typed PRNG key's ``key<fry>``),
    which numpy cannot interpret and which is kept as it is."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None:
        return dtype if _extended(dtype) else np.dtype(dtype)
    return jax.dtypes.canonicalize_dtype(np.asarray(leaf).dtype)  # a Python scalar, as device_put types it


def _extended(dtype: DType) -> bool:
    """A dtype numpy has no counterpart for (typed PRNG keys): never cast, compared as it is."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


@dataclasses.dataclass(frozen=True, slots=True)
class Normalized:
    """A call's leaves and targets in the front door's terms, and the casts left for after the move.

    Attributes:
      leaves, targets: what the front door takes.
      after: ``{leaf index: dtype}``, the widening casts, run on the target devices by :meth:`finish`.
    """

    leaves: list[Any]
    targets: list[Any]
    after: dict[int, Any]

    def finish(self, out: list[Any]) -> list[Any]:
        """The result leaves with the widening casts applied (``jnp.astype`` where each result lives)."""
        if not self.after:
            return out
        out = list(out)
        for i, a in zip(self.after, _cast_all([out[i] for i in self.after], list(self.after.values())), strict=True):
            out[i] = a
        return out


def _cast(a: Any, dtype: DType) -> Any:
    """``a.astype(dtype)`` with ``a``'s sharding; a zero-size ``a`` made shard by shard (jax 0.10's ``astype`` of a
    sharded zero-size array gives a replicated result whose every shard has the global shape)."""
    if not math.prod(a.shape):
        return empty_array(tuple(a.shape), dtype, a.sharding)
    return a.astype(dtype)


_CAST_CHUNK = 64  # leaves of one kind cast by one jitted call (compiling more at once costs more than it saves)


def _cast_all(arrays: list[Any], dtypes: list[DType]) -> list[Any]:
    """``[_cast(a, d) ...]``, with the arrays of each kind (shape, dtype, sharding and the dtype cast to) cast
    :data:`_CAST_CHUNK` at a time by one jitted call: one dispatch per chunk instead of one per leaf, the same
    ``convert_element_type`` per leaf, bit for bit. Chunks of one kind share one compiled computation (and a last,
    shorter one its own), so a tree of many like leaves compiles a few small computations, once. A lone array,
    or a zero-size one, is cast on its own."""
    out = list(arrays)
    kinds: dict[tuple, list[int]] = {}
    for i, a in enumerate(arrays):
        if math.prod(a.shape):
            to = np.dtype(jax.dtypes.canonicalize_dtype(dtypes[i]))
            kinds.setdefault((a.shape, a.dtype, a.sharding, to), []).append(i)
        else:
            out[i] = _cast(a, dtypes[i])
    for (*_, to), picked in kinds.items():
        if len(picked) == 1:
            out[picked[0]] = _cast(arrays[picked[0]], to)
            continue
        for k in range(0, len(picked), _CAST_CHUNK):
            chunk = picked[k : k + _CAST_CHUNK]
            for i, a in zip(chunk, _cast_jitted([arrays[i] for i in chunk], to), strict=True):
                out[i] = a
    return out


@functools.partial(jax.jit, static_argnums=1)
def _cast_jitted(arrays: list[Any], dtype: np.dtype) -> list[Any]:
    return [a.astype(dtype) for a in arrays]


def _bits(dtype: DType) -> int:
    return int(jax.dtypes.itemsize_bits(dtype))


def normalize(leaves: list[Any], treedef: TreeDef, targets: list[Any], x: PyTree, target: PyTree) -> Normalized:
    """A call's flat leaves and targets (the front door's :func:`~jreshard.call.front.flatten` of ``x`` and
    ``target``) with every leaf in the front door's terms (module docstring); nothing is flattened again.

    Host and host-memory leaves come back already placed (``jax.device_put``) with target ``None``;
    a leaf cast to a narrower (or as wide) dtype comes back cast, with its target's sharding; one
    cast to a wider dtype comes back as it is, its cast in ``after``; an array target becomes its
    sharding. ``x`` and ``target`` are read only to name a leaf in an error, and to see a single target.

    Raises:
      LayoutMismatchError: an array or ShapeDtypeStruct target has another shape.
      TopologyError: a host-memory leaf or target on devices this process cannot address.
    """
    if isinstance(target, jax.sharding.Sharding) and _memory_kind(target) in _DEVICE_KINDS:
        if all(_on_device(v) and _memory_kind(v.sharding) in _DEVICE_KINDS for v in leaves):
            return Normalized(leaves, targets, {})  # the common case: device arrays to one device sharding
    new_leaves, new_targets = list(leaves), list(targets)
    put: list[int] = []
    uncommitted: list[int] = []
    casts: dict[int, Any] = {}
    changed = False
    try:
        for i, (leaf, t) in enumerate(zip(leaves, targets, strict=True)):
            want = _wanted(i, leaf, t)
            sharding = want.sharding if want is not None else t
            if want is not None:
                changed = True
                new_targets[i] = sharding
                if want.dtype is not None:
                    casts[i] = want.dtype
            on_host = _is_host(leaf)
            host_memory = _on_device(leaf) and _memory_kind(leaf.sharding) not in _DEVICE_KINDS
            to_host = isinstance(sharding, jax.sharding.Sharding) and _memory_kind(sharding) not in _DEVICE_KINDS
            if on_host and sharding is None:  # as device_put(value): on the default device, uncommitted
                uncommitted.append(i)
                changed = True
            elif (on_host or host_memory or to_host) and isinstance(sharding, jax.sharding.Sharding):
                _check_addressable(i, leaf, sharding)
                put.append(i)
                changed = True  # (any other target, the front door names)
    except LayoutMismatchError as err:
        message = _renamed(str(err), leaf_names(treedef, x))
        raise LayoutMismatchError(message, src=err.src, dst=err.dst, what=err.what) from None
    except TopologyError as err:
        raise TopologyError(_renamed(str(err), leaf_names(treedef, x))) from None
    if not changed:
        return Normalized(leaves, targets, {})
    if put:
        placed = jax.device_put([leaves[i] for i in put], [new_targets[i] for i in put])
        for i, a in zip(put, placed, strict=True):
            new_leaves[i], new_targets[i] = a, None
    if uncommitted:
        for i, a in zip(uncommitted, jax.device_put([leaves[i] for i in uncommitted]), strict=True):
            new_leaves[i] = a
    after: dict[int, Any] = {}
    now: dict[int, Any] = {}
    for i, dtype in casts.items():
        moves = new_targets[i] is not None and _on_device(new_leaves[i])  # else placed at its target already
        if moves and _bits(dtype) > _bits(new_leaves[i].dtype):
            after[i] = dtype  # widening: the narrower source dtype crosses the links
        else:
            now[i] = dtype
    for i, a in zip(now, _cast_all([new_leaves[i] for i in now], list(now.values())), strict=True):
        new_leaves[i] = a
    return Normalized(new_leaves, new_targets, after)


def _check_addressable(i: int, leaf: TreeLeaf, sharding: Sharding) -> None:
    """Raises TopologyError when a leaf moved by ``jax.device_put`` here has devices of another process."""
    devices = set(sharding.device_set)
    if _on_device(leaf):
        devices |= set(leaf.sharding.device_set)
    others = sorted(d.id for d in devices if d.process_index != jax.process_index())
    if others:
        raise TopologyError(
            f"leaf #{i} is {describe(leaf)} with target {sharding}: host memory and host data move in one "
            f"process, and devices {others} belong to other processes; the fix is a target in device memory"
        )
