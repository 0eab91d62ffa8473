"""Destination shards from the buffer pool, and global arrays over them: what every in-process path
hands back to jax.

:func:`fresh_shards` cuts a layout's destination shards for many leaves out of one pool block per
device (:mod:`jreshard.engine.pool`); :func:`make_array` makes one global ``jax.Array`` over such
shards, zero-copy: in one call of jax's batched put where ``jax.transfer_guard`` allows host-to-device
transfers (its default), else each shard imported through DLPack as memory its device already holds
and the array assembled from them. The in-process copies of arrays (:mod:`jreshard.engine.inprocess`)
and of views (:mod:`jreshard.call.views`) both end here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jreshard.engine.buffers import Capsule, carrier, dlpack_type, retype_capsule
from jreshard.engine.ownership import with_weak_type
from jreshard.engine.pool import ALIGN, BufferPool
from jreshard.engine.put import batched_put, put_allowed
from jreshard.errors import TransferError
from jreshard.sharding.caches import cache
from jreshard.sharding.dtypes import storage_bytes
from jreshard.sharding.jax import addressable_order
from jreshard.sharding.layout import Layout
from jreshard.types import Array, Device, DType, Sharding

__all__ = [
    "assembled",
    "empty_array",
    "fresh_shards",
    "make_array",
    "zeros_on",
]


# The dtypes numpy itself exports through DLPack (ml_dtypes' bfloat16 and float8 are not among them).
_NUMPY_DLPACK = frozenset(np.dtype(t) for t in "?bhilqBHILQefdFD")


def _capsule(view: np.ndarray, device_id: int | None = None) -> Any:
    """The DLPack capsule of a pool buffer (numpy exports bfloat16 and float8 as unsigned integers of
    their width: the capsule is re-typed), reporting ``device_id`` where given."""
    dtype = view.dtype
    if dtype in _NUMPY_DLPACK and device_id is None:
        return view.__dlpack__()
    code, bits = dlpack_type(dtype)
    return retype_capsule(view.view(carrier(bits)[2]).__dlpack__(), code, bits, device_id)


def _public_import(view: np.ndarray, device: Device) -> Any:
    """``jax.dlpack.from_dlpack`` of a pool buffer onto ``device`` (zero-copy: the capsule names the device)."""
    hw = device.local_hardware_id
    return jax.dlpack.from_dlpack(Capsule(_capsule(view, hw), hw))


def _public_assemble(
    shape: tuple[int, ...], dtype: DType, sharding: Sharding, shards: list[Any], weak: bool = False
) -> Any:
    out = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    return out if not weak else _rewrapped_weak(out)


def _rewrapped_weak(a: Array) -> Any:  # pragma: no cover - other jax versions only
    """``a`` weakly typed, through a jitted no-op (the public path has no constructor for it)."""
    return jax.jit(lambda v: with_weak_type(v, True), out_shardings=a.sharding)(a)


def _dlpack_import() -> Any:
    """jax's zero-copy import of a DLPack capsule onto a given device, as ``jax.dlpack.from_dlpack``
    makes it, without that function's per-call checks and ``jnp.asarray`` (a quarter of its cost)."""
    try:
        from jax._src.lib import _jax, jaxlib_extension_version

        fn = _jax.dlpack_managed_tensor_to_buffer
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions: the public path
        return _public_import
    if jaxlib_extension_version >= 467:
        return lambda view, device: fn(_capsule(view), device, None, None, _KDLCPU)
    return lambda view, device: fn(_capsule(view), device, None, None)  # pragma: no cover - an older jaxlib


def _array_impl() -> Any:
    """jax's constructor of a global array from single-device arrays, without the checks of
    ``jax.make_array_from_single_device_arrays`` (the shards were made to fit the sharding)."""
    try:
        from jax._src import core
        from jax._src.array import ArrayImpl
    except ImportError:  # pragma: no cover - other jax versions: the public path
        return _public_assemble
    aval = cache(max_size=4096)(core.ShapedArray)
    return lambda shape, dtype, sharding, shards, weak=False: ArrayImpl(
        aval(shape, dtype, weak), sharding, shards, committed=True, _skip_checks=True
    )


_KDLCPU = 1  # DLPack's device type of host memory
_IMPORT = _dlpack_import()
_ASSEMBLE = _array_impl()


def make_array(
    shape: tuple[int, ...],
    dtype: DType,
    sharding: Sharding,
    views: Sequence[np.ndarray],
    devices: Any,
    weak_type: bool = False,
    put: bool | None = None,
) -> Any:
    """A global array over pool buffers ``views`` (one per device, in ``devices`` order), zero-copy,
    committed to ``sharding`` and weakly typed where the source was (as ``jax.device_put`` keeps it).

    Where ``jax.transfer_guard`` allows host-to-device transfers (its default), one call of jax's
    batched put makes the array over the buffers (zero-copy on CPU; a few microseconds per shard).
    Under a guard that refuses them, each shard is imported through DLPack as memory its CPU device
    already holds (no host-to-device transfer: every guard setting allows it; about 20 us a shard),
    and the array assembled from them.

    ``put``: whether the batched put may be used (:func:`put_allowed`, asked once for a whole call);
    ``None`` asks here.

    Raises:
      TransferError: jax copied a buffer instead of aliasing it, or a dtype has no DLPack type (sub-byte).
    """
    putter = batched_put(put_allowed() if put is None else put)
    if putter is not None:
        return putter(shape, dtype, sharding, views, devices, weak_type)
    shards = [_IMPORT(v, d) for v, d in zip(views, devices, strict=True)]
    for v, d, a in zip(views, devices, shards, strict=True):
        if v.size and a.unsafe_buffer_pointer() != v.ctypes.data:
            raise TransferError(f"jax copied the {v.dtype}{list(v.shape)} result shard on {d} instead of aliasing it")
    return _ASSEMBLE(shape, dtype, sharding, shards, weak_type)


def zeros_on(device: Device, shape: tuple[int, ...], dtype: DType, memory_kind: str | None = None) -> Array:
    """An array of zeros made on ``device`` (in its ``memory_kind``) by a computation of its own, from no host
    data (``jnp.zeros(..., device=)`` transfers its scalar from the host, which a ``jax.transfer_guard`` that
    forbids host transfers refuses); one compiled computation per shape, dtype, device and memory kind."""
    return _zeros(tuple(shape), np.dtype(dtype), device, memory_kind)()


@cache(max_size=256)
def _zeros(shape: tuple[int, ...], dtype: np.dtype, device: Device, memory_kind: str | None) -> Any:
    import jax.numpy as jnp

    out = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=out)


def empty_array(shape: tuple[int, ...], dtype: DType, sharding: Sharding, weak_type: bool = False) -> Array:
    """An array of ``shape`` with no element (a dimension of 0) and ``sharding``, weakly typed where asked (as
    ``jax.device_put`` keeps a weakly typed source): the result of moving a zero-size leaf, which has no byte to
    move. Each shard is made on its device (:func:`zeros_on`), never by a jitted call with ``out_shardings``: for
    a zero-size result jax (0.10) gives every shard the global shape, an array whose shards contradict its
    sharding, which jax refuses in a later call."""
    per = sharding.shard_shape(shape)
    kind = getattr(sharding, "memory_kind", None)
    dtype = jax.dtypes.canonicalize_dtype(dtype)  # as the shards are made (64-bit types without x64: 32-bit)
    arrays = [zeros_on(d, per, dtype, kind) for d in sharding.addressable_devices_indices_map(shape)]
    return assembled(shape, dtype, sharding, arrays, weak_type)


def assembled(
    shape: tuple[int, ...], dtype: DType, sharding: Sharding, arrays: Sequence[Any], weak_type: bool = False
) -> Array:
    """``jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)``, weakly typed where asked
    (the public function has no such argument; ``jax.device_put`` keeps a source's ``weak_type``). A process that
    holds no device of ``sharding`` gets an array with no addressable shard, made without the public function's
    checks (tens of microseconds; not run across processes weakly typed)."""
    if not arrays and not sharding.addressable_devices:
        return _ASSEMBLE(shape, jax.dtypes.canonicalize_dtype(dtype), sharding, [], weak_type)
    if weak_type:
        # (jax's constructor takes the shards in the sharding's own device order, which need not be the ids')
        by_device = {next(iter(a.devices())): a for a in arrays}
        ordered = [by_device[d] for d in addressable_order(sharding)]
        return _ASSEMBLE(shape, jax.dtypes.canonicalize_dtype(dtype), sharding, ordered, True)
    return jax.make_array_from_single_device_arrays(shape, sharding, list(arrays), dtype=dtype)


def _padded(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def fresh_shards(
    dst: Layout, n: int, pool: BufferPool, order: Sequence[int] | None = None
) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """Destination shards of layout ``dst`` for ``n`` leaves: one pool block per slot, cut per leaf.

    Returns ``(addresses (n, slots), views[leaf])``, each leaf's views in slot order, or in ``order``
    (the slots in the order jax assembles the leaf's shards) where given.
    """
    dtype = dst.np_dtype
    shapes = tuple(dst.box_of(r).shape for r in dst.ranks)
    ptr = np.zeros((n, len(shapes)), dtype=np.int64)
    cols: list[list[np.ndarray]] = []
    for k, shape in enumerate(shapes):
        count = math.prod(shape)
        step = _padded(storage_bytes(dtype, count))
        block = pool.take(step * n)
        ptr[:, k] = block.ctypes.data + np.arange(n, dtype=np.int64) * step
        # One view of the block as (leaf, padded shard), cut to the shard: iterating it yields
        # each leaf's C-contiguous shard view without a Python slice per leaf.
        per_leaf = block.view(dtype).reshape(n, step // dtype.itemsize)[:, :count].reshape(n, *shape)
        # (Iterating a 1-D array yields numpy scalars, copies taken now: rank-0 shards index with `...`.)
        cols.append(list(per_leaf) if shape else [per_leaf[j, ...] for j in range(n)])
    slots = range(len(shapes)) if order is None else order
    return ptr, [list(v) for v in zip(*(cols[k] for k in slots), strict=True)]
