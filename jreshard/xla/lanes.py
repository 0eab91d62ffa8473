"""Any dtype as raw bytes: the uint8 lanes the XLA computation packs, sends and unpacks.

Collectives do not support every dtype on every platform (float8, int4, bool, complex), so
the computation moves bytes: every shard is held as unsigned integer lanes of its element's width
(:func:`lane_dtype`), and what goes on the wire is their bytes (``uint8``), back again bit for
bit. :func:`lane_bytes` bytes per element, the same count the planner uses
(``Layout.itemsize``), so the computation's wire bytes equal the plan's:

- widths of 8 bits and more: ``lax.bitcast_convert_type`` to the unsigned type of that width;
- ``bool``: one ``uint8`` lane holding 0 or 1 (XLA has no bitcast of ``pred``);
- complex: the real and imaginary parts, each bitcast (both bit-exact extractions);
- sub-byte widths (``int4``, ``uint4``, ``float4_e2m1fn``, ``int2``...): bitcast to the unsigned
  type of that width, then widened to one ``uint8`` lane (the plan counts one byte per element
  for them too, as numpy's ``ml_dtypes`` do). The value is exact whatever the packing of the
  buffers (jax reports ``nbytes == size`` for them while a device may hold two per byte):
  the computation never sees the packed bytes, only values.

Extended dtypes (typed PRNG keys) are refused by :func:`check_dtype`, before any byte moves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jreshard.errors import LayoutError
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.types import DType

__all__ = ["check_dtype", "from_bytes", "from_lanes", "lane_bytes", "lane_dtype", "to_bytes", "to_lanes"]


def _bits(dtype: DType) -> int:
    return int(jax.dtypes.itemsize_bits(dtype))


def lane_bytes(dtype: DType) -> int:
    """The ``uint8`` lanes one element of ``dtype`` travels as.

    Example:
      >>> import jax.numpy as jnp
      >>> [lane_bytes(d) for d in (jnp.bool_, jnp.bfloat16, jnp.complex64, jnp.int4)]
      [1, 2, 8, 1]
    """
    return max(_bits(dtype) // 8, 1)


def check_dtype(dtype: DType, where: str) -> None:
    """Refuse a dtype the computation cannot move bit for bit.

    Raises:
      LayoutError: an extended dtype (a typed PRNG key), or one whose lanes would not match the
        plan's item size (the message names ``where``).
    """
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        raise LayoutError(
            f"{where} has dtype {dtype}, an extended dtype; backend 'xla' moves plain dtypes only: the fix is "
            "jax.random.key_data(x) before the transfer and jax.random.wrap_key_data after, or backend 'local'"
        )
    bits = _bits(dtype)
    planned = numpy_dtype(np.dtype(dtype).name).itemsize
    if bits not in (2, 4) and bits % 8:
        raise LayoutError(f"{where} has dtype {dtype} of {bits} bits; backend 'xla' moves whole bytes, or 2 or 4 bits")
    if lane_bytes(dtype) != planned:
        raise LayoutError(
            f"{where} has dtype {dtype}: {lane_bytes(dtype)} byte lanes per element but the plan counts "
            f"{planned}; backend 'xla' cannot move it bit for bit, the fix is backend 'local'"
        )


def lane_dtype(dtype: DType) -> DType:
    """The unsigned integer type a shard of ``dtype`` is held as inside the computation (its lanes).

    Example:
      >>> import jax.numpy as jnp
      >>> [jnp.dtype(lane_dtype(d)).name for d in (jnp.bool_, jnp.int4, jnp.bfloat16, jnp.complex64)]
      ['uint8', 'uint8', 'uint16', 'uint32']
    """
    dt = jnp.dtype(dtype)
    if dt == jnp.bool_ or _bits(dt) < 8:
        return jnp.uint8
    width = _bits(dt) // 2 if jnp.issubdtype(dt, jnp.complexfloating) else _bits(dt)
    return {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[width]


def to_lanes(x: jax.Array) -> jax.Array:
    """``x`` as unsigned lanes of its own width (:func:`lane_dtype`), the same shape (a complex: a
    trailing dimension of 2, its real and imaginary parts), bit for bit.

    The computation converts whole shards once and slices only lanes: a slice or an update of some
    dtypes (float8 on XLA:CPU) may go through a wider float and change NaN payloads, a lane never;
    lanes as wide as the element keep the copies as fast as the dtype's own.
    """
    dt = x.dtype
    if dt == jnp.bool_:
        return x.astype(jnp.uint8)
    if jnp.issubdtype(dt, jnp.complexfloating):
        parts = jnp.stack([jax.lax.real(x), jax.lax.imag(x)], axis=-1)
        return jax.lax.bitcast_convert_type(parts, lane_dtype(dt))
    if _bits(dt) < 8:
        return jax.lax.bitcast_convert_type(x, _unsigned(_bits(dt))).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, lane_dtype(dt))


def from_lanes(u: jax.Array, dtype: DType) -> jax.Array:
    """The inverse of :func:`to_lanes`."""
    dt = jnp.dtype(dtype)
    if dt == jnp.bool_:
        return u != 0
    if jnp.issubdtype(dt, jnp.complexfloating):
        part = jnp.float32 if dt == jnp.complex64 else jnp.float64
        f = jax.lax.bitcast_convert_type(u, part)
        return jax.lax.complex(f[..., 0], f[..., 1])
    if _bits(dt) < 8:
        return jax.lax.bitcast_convert_type(u.astype(_unsigned(_bits(dt))), dt)
    return jax.lax.bitcast_convert_type(u, dt)


def to_bytes(lanes: jax.Array) -> jax.Array:
    """Flat lanes as flat ``uint8`` bytes (each lane's bytes in memory order)."""
    flat = lanes.reshape(-1)
    if flat.dtype == jnp.uint8:
        return flat
    return jax.lax.bitcast_convert_type(flat, jnp.uint8).reshape(-1)


def from_bytes(data: jax.Array, lane: DType) -> jax.Array:
    """Flat ``uint8`` bytes as flat lanes of type ``lane`` (the inverse of :func:`to_bytes`)."""
    k = jnp.dtype(lane).itemsize
    if k == 1:
        return data
    return jax.lax.bitcast_convert_type(data.reshape(-1, k), lane)


def _unsigned(bits: int) -> DType:
    return {2: jnp.uint2, 4: jnp.uint4}[bits]
