"""Leaves the byte engine cannot address as they are, repacked on their devices before they move.

The engine moves shards as byte ranges: element ``i`` of a shard starts at byte
``i * itemsize``. Two kinds of jax arrays break that:

- **Packed sub-byte dtypes** (``int4``, ``uint4``, ``int2``, ``uint2``,
  ``float4_e2m1fn``): the device buffer holds two (or four) values a byte, while
  numpy and jax report ``itemsize == 1`` and ``nbytes == size``. A box of a shard
  can start or end in the middle of a byte, so byte copies are wrong, and a copy
  sized by ``nbytes`` runs past the buffer's end.
- **Extended dtypes** (typed PRNG key arrays, ``jax.random.key``): their elements
  are opaque; the bytes are their key data, a ``uint32`` array with trailing
  dimensions of the impl's key shape.

Such a leaf is *encoded* on its own devices by a jitted computation that keeps its
sharding (sub-byte: bitcast to the unsigned type of the same width, then widen to
``uint8``, one value a byte; keys: ``jax.random.key_data``), the encoded array
moves like any other, and the result is *decoded* on the destination devices by a
jitted computation with the target sharding (narrow and bitcast back; keys:
``jax.random.wrap_key_data`` with the same impl). Every value comes back bit for
bit; nothing crosses to the host, so transfer guards that allow ``device_put``
between devices allow it. ``transfer_into`` donates the ``into`` leaf to the decode,
so XLA writes the result over its memory.

The cost is the encode and decode on each side and, for sub-byte dtypes, twice the
packed bytes on the wire (one value a byte).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jreshard.engine.arrays import empty_array
from jreshard.sharding.caches import cache
from jreshard.sharding.dtypes import packed_bits
from jreshard.types import Array, DType, PyTree, Sharding, TreeLeaf

__all__ = [
    "Encoding",
    "LeafPlan",
    "decode",
    "encode",
    "encoding_of",
    "encodings",
    "exclusive_into",
    "plan_leaves",
    "storage_of",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Encoding:
    """How one dtype is repacked to move.

    Attributes:
      dtype: the leaf's dtype.
      kind: ``"packed"`` (sub-byte), ``"key"`` (a typed PRNG key array) or ``"memory"`` (an array in,
        or written into, host memory: moved through device memory).
      trailing: the extra trailing dimensions of the encoded array (a key's data shape).
    """

    dtype: Any
    kind: str
    trailing: tuple[int, ...] = ()


def encoding_of(dtype: DType) -> Encoding | None:
    """The encoding a leaf of ``dtype`` needs, or ``None`` when the engine moves it as it is.

    >>> import jax.numpy as jnp
    >>> encoding_of(jnp.int4).kind, encoding_of(jnp.float32)
    ('packed', None)
    """
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return _key_encoding(dtype)
    if packed_bits(np.dtype(dtype)) is not None:
        return Encoding(np.dtype(dtype), "packed")
    return None


@cache(max_size=64)
def _key_encoding(dtype: DType) -> Encoding:
    impl = jax.random.key_impl(jax.random.key(0, impl=_impl_name(dtype)))
    data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return Encoding(dtype, "key", tuple(data.shape))


def _impl_name(dtype: DType) -> Any:
    return dtype._impl  # the PRNGImpl of a key dtype (jax has no public accessor for it)


def _unsigned(bits: int) -> Any:
    return {4: jnp.uint4, 2: jnp.uint2}[bits]


def encoded_sharding(enc: Encoding, sharding: Sharding, shape: tuple[int, ...]) -> Any:
    """The sharding of the encoded array for a leaf of ``shape`` with ``sharding``.

    A packed leaf keeps its sharding. A key array's data has trailing dimensions, unsplit; the
    sharding jax gives ``key_data`` of a key array with this sharding is read from a traced call.
    """
    if enc.kind == "key":
        return _key_data_sharding(enc, sharding, shape)
    if enc.kind == "memory":
        return sharding.with_memory_kind("device")
    return sharding


@cache(max_size=1024)
def _key_data_sharding(enc: Encoding, sharding: Sharding, shape: tuple[int, ...]) -> Any:
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = (*sharding.spec, *(None,) * (len(shape) - len(sharding.spec) + len(enc.trailing)))
        return jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=sharding.memory_kind
        )
    # Any other kind: the sharding jax itself gives the key data (compiled, not run).
    keys = jax.ShapeDtypeStruct(shape, enc.dtype, sharding=sharding)
    return jax.jit(jax.random.key_data).lower(keys).compile().output_shardings


@cache(max_size=1024)
def _encoder(enc: Encoding, sharding: Sharding, shape: tuple[int, ...]) -> Any:
    out = encoded_sharding(enc, sharding, shape)
    bits = packed_bits(np.dtype(enc.dtype))
    assert bits is not None
    u = _unsigned(bits)
    return jax.jit(lambda a: jax.lax.bitcast_convert_type(a, u).astype(jnp.uint8), out_shardings=out)


@cache(max_size=1024)
def _decoder(enc: Encoding, sharding: Sharding, donate: bool) -> Any:
    if enc.kind == "memory":

        def dec(d: Any, *_: Any) -> Any:
            return jax.device_put(d, sharding)

    elif enc.kind == "key":
        impl = _impl_name(enc.dtype)

        def dec(d: Any, *_: Any) -> Any:
            return jax.random.wrap_key_data(d, impl=impl)

    else:
        bits = packed_bits(np.dtype(enc.dtype))
        assert bits is not None
        u, dt = _unsigned(bits), enc.dtype

        def dec(d: Any, *_: Any) -> Any:
            return jax.lax.bitcast_convert_type(d.astype(u), dt)

    if donate:  # the into leaf is an unused argument XLA may alias the result to
        return jax.jit(dec, out_shardings=sharding, donate_argnums=(1,), keep_unused=True)
    return jax.jit(dec, out_shardings=sharding)


def encode(leaf: TreeLeaf, enc: Encoding) -> Any:
    """``leaf`` as an array the engine moves byte for byte, on the same devices.

    A key array's encoding is its key data as jax holds it (``jax.random.key_data`` outside ``jit``: the
    same buffers, no computation), which the engine only reads.
    """
    if enc.kind == "memory":
        kind = getattr(leaf.sharding, "memory_kind", None)
        return leaf if kind in (None, "device") else jax.device_put(leaf, leaf.sharding.with_memory_kind("device"))
    if enc.kind == "key":
        return jax.random.key_data(leaf)
    shape = tuple(leaf.shape)
    if not math.prod(shape):  # nothing to encode (and no jitted call: arrays.empty_array)
        return empty_array(shape, np.uint8, encoded_sharding(enc, leaf.sharding, shape))
    return _encoder(enc, leaf.sharding, shape)(leaf)


def decode(moved: Any, enc: Encoding, sharding: Sharding, into: PyTree = None) -> Any:
    """The leaf back from its moved encoding, with ``sharding``; over ``into``'s memory when given
    (``into`` is donated: XLA writes the result where it was).

    A key array without ``into`` is its moved key data wrapped outside ``jit``
    (``jax.random.wrap_key_data``: the same buffers), whose sharding jax derives from the data's as it
    does for ``jax.device_put``'s result; a jitted wrap with a ``GSPMDSharding`` output would give the
    key array a sharding of the key data's rank, which jax refuses to read.
    """
    from jreshard.engine.ownership import rewrapped

    if enc.kind == "key" and into is None:
        return jax.random.wrap_key_data(moved, impl=_impl_name(enc.dtype))
    if enc.kind != "key" and not math.prod(moved.shape):  # no byte to write: a fresh empty array, into kept
        return empty_array(tuple(moved.shape), enc.dtype, sharding, getattr(moved, "weak_type", False))
    out = _decoder(enc, sharding, False)(moved) if into is None else _decoder(enc, sharding, True)(moved, into)
    return rewrapped(out, sharding)  # (the cached decoder was made for an equal sharding object)


@cache(max_size=256)
def _encoding_of_dtype(dtype: DType) -> Encoding | None:
    return encoding_of(dtype)


def _host_memory(a: Array) -> bool:
    return isinstance(a, jax.Array) and getattr(a.sharding, "memory_kind", None) not in (None, "device")


def encodings(leaves: Sequence[Any], into: Sequence[Any] | None = None) -> list[Encoding | None] | None:
    """Per leaf its :class:`Encoding` (``None``: moved as it is); ``None`` when no leaf needs one.

    With ``into`` (``transfer_into``'s arrays), a leaf read from or written into host memory
    (``pinned_host``, ``unpinned_host``) moves through device memory and is placed into its ``into``
    array by a jitted ``device_put`` that takes the ``into`` memory over (``transfer`` leaves of
    host memory are ``jax.device_put``'s: :mod:`jreshard.call.normalize`).
    """
    encs = [_encoding_of_dtype(leaf.dtype) if isinstance(leaf, jax.Array) else None for leaf in leaves]
    for i, t in enumerate(into or ()):
        if encs[i] is None and isinstance(leaves[i], jax.Array) and (_host_memory(t) or _host_memory(leaves[i])):
            encs[i] = Encoding(leaves[i].dtype, "memory")
    return encs if any(e is not None for e in encs) else None


@dataclasses.dataclass(frozen=True, slots=True)
class LeafPlan:
    """Where a repacked leaf goes: its target sharding, and its encoding's."""

    sharding: Any
    encoded_sharding: Any


def plan_leaves(
    leaves: Sequence[Any], targets: Sequence[Any], encs: Sequence[Encoding | None], mode: Any
) -> list[LeafPlan | None]:
    """Check the repacked leaves' targets and say where each goes (``None``: kept as it is).

    Raises:
      LayoutError, LayoutMismatchError: as the front door does for other leaves.
    """
    from jreshard.call.front import _check_leaf, target_sharding
    from jreshard.engine.prepared import Mode
    from jreshard.errors import LayoutMismatchError

    out: list[LeafPlan | None] = [None] * len(leaves)
    for i, (leaf, t, enc) in enumerate(zip(leaves, targets, encs, strict=True)):
        if enc is None or t is None:
            continue
        _check_leaf(leaf, f"leaf #{i} of x")
        shape = tuple(leaf.shape)
        if mode is Mode.INTO:
            _check_leaf(t, f"leaf #{i} of into")
            if tuple(t.shape) != shape or t.dtype != leaf.dtype:
                raise LayoutMismatchError(
                    f"leaf #{i} is {leaf.dtype}{list(shape)} but into holds {t.dtype}{list(t.shape)}",
                    src=(shape, leaf.dtype),
                    dst=(t.shape, t.dtype),
                    what="shape" if tuple(t.shape) != shape else "dtype",
                )
            sh = t.sharding
        else:
            if isinstance(t, jax.ShapeDtypeStruct) and (tuple(t.shape) != shape or t.dtype != leaf.dtype):
                raise LayoutMismatchError(
                    f"leaf #{i} is {leaf.dtype}{list(shape)} but its target is {t}; jreshard does not cast "
                    f"{leaf.dtype} leaves",
                    src=(shape, leaf.dtype),
                    dst=(t.shape, t.dtype),
                    what="shape" if tuple(t.shape) != shape else "dtype",
                )
            sh = t.sharding if isinstance(t, jax.Array) else target_sharding(t, f"the target of leaf #{i}")
            if sh == leaf.sharding and getattr(leaf, "_committed", True):
                continue  # device_put returns it as it is (an uncommitted leaf is copied: frontdoor._shape)
        out[i] = LeafPlan(sh, encoded_sharding(enc, sh, shape))
    return out


def exclusive_into(leaves: Sequence[Any], targets: Sequence[Any], moved: Sequence[int]) -> dict[int, Any]:
    """For the moved leaves whose ``into`` array may not be donated, why (a
    :class:`~jreshard.report.NotInPlace`, by the ownership rule :func:`jreshard.engine.ownership.claim`).
    The others are donated to their decode."""
    from jreshard.engine.ownership import claim, source_addresses

    return claim(targets, moved, source_addresses(leaves)).why


def held_addresses(a: Array) -> frozenset[int]:
    """The buffer addresses of ``a``'s non-empty addressable shards (a key array's: its key data's)."""
    from jreshard.engine.ownership import shard_addresses

    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return frozenset(shard_addresses(a)) - {0}


def storage_of(a: Array) -> int:
    """Bytes of ``a``'s addressable shards as its devices hold them (packed for sub-byte dtypes)."""
    from jreshard.sharding.dtypes import storage_bytes

    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        return sum(int(s.data.size) for s in a.addressable_shards) * 4 * math.prod(_key_encoding(a.dtype).trailing)
    return sum(storage_bytes(np.dtype(a.dtype), int(s.data.size)) for s in a.addressable_shards)
