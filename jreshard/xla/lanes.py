"""Any dtype as raw bytes: the uint8 lanes the XLA program packs, sends and unpacks.

Collectives do not support every dtype on every platform (float8, int4, bool, complex), so
the program moves bytes: every element becomes :func:`lane_bytes` ``uint8`` lanes, and back,
bit for bit. One lane width per element, the same one the planner counts
(``Layout.itemsize``), so the program's wire bytes equal the plan's:

- widths of 8 bits and more: ``lax.bitcast_convert_type`` to ``uint8`` (``k`` lanes for
  ``k`` bytes);
- ``bool``: one lane holding 0 or 1 (XLA has no bitcast of ``pred``);
- complex: the real and imaginary parts, each bitcast (both bit-exact extractions);
- sub-byte widths (``int4``, ``uint4``, ``float4_e2m1fn``, ``int2``...): bitcast to the unsigned
  type of that width, then widened to one ``uint8`` lane (the plan counts one byte per element
  for them too, as numpy's ``ml_dtypes`` do). The value is exact whatever the packing of the
  buffers (jax reports ``nbytes == size`` for them while a device may hold two per byte):
  the program never sees the packed bytes, only values.

Extended dtypes (typed PRNG keys) are refused by :func:`check_dtype`, before any byte moves.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jreshard.errors import LayoutError
from jreshard.sharding.dtypes import numpy_dtype

__all__ = ["check_dtype", "from_lanes", "lane_bytes", "to_lanes"]


def _bits(dtype: Any) -> int:
    return int(jax.dtypes.itemsize_bits(dtype))


def lane_bytes(dtype: Any) -> int:
    """The ``uint8`` lanes one element of ``dtype`` travels as.

    Example:
      >>> import jax.numpy as jnp
      >>> [lane_bytes(d) for d in (jnp.bool_, jnp.bfloat16, jnp.complex64, jnp.int4)]
      [1, 2, 8, 1]
    """
    return max(_bits(dtype) // 8, 1)


def check_dtype(dtype: Any, where: str) -> None:
    """Refuse a dtype the program cannot move bit for bit.

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


def to_lanes(x: jax.Array) -> jax.Array:
    """``x`` as ``uint8`` lanes: shape ``(*x.shape, lane_bytes(x.dtype))``, element ``i``'s bytes in ``[..., :]``.

    The program converts whole shards once and slices only lanes: a slice or an update of some
    dtypes (float8 on XLA:CPU) may go through a wider float and change NaN payloads, a lane never.
    """
    dt = x.dtype
    if dt == jnp.bool_:
        return x.astype(jnp.uint8)[..., None]
    if jnp.issubdtype(dt, jnp.complexfloating):
        parts = jnp.stack([jax.lax.real(x), jax.lax.imag(x)], axis=-1)
        u = jax.lax.bitcast_convert_type(parts, jnp.uint8)
        return u.reshape((*x.shape, lane_bytes(dt)))
    if _bits(dt) < 8:
        return jax.lax.bitcast_convert_type(x, _unsigned(_bits(dt))).astype(jnp.uint8)[..., None]
    u = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return u if _bits(dt) > 8 else u[..., None]


def from_lanes(u: jax.Array, dtype: Any) -> jax.Array:
    """The inverse of :func:`to_lanes`: lanes of shape ``(*shape, lane_bytes(dtype))`` as ``dtype[shape]``."""
    dt = jnp.dtype(dtype)
    k = lane_bytes(dt)
    shape = u.shape[:-1]
    if dt == jnp.bool_:
        return u[..., 0] != 0
    if jnp.issubdtype(dt, jnp.complexfloating):
        part = jnp.float32 if dt == jnp.complex64 else jnp.float64
        f = jax.lax.bitcast_convert_type(u.reshape((*shape, 2, k // 2)), part)
        return jax.lax.complex(f[..., 0], f[..., 1])
    if _bits(dt) < 8:
        return jax.lax.bitcast_convert_type(u[..., 0].astype(_unsigned(_bits(dt))), dt)
    if k == 1:
        return jax.lax.bitcast_convert_type(u[..., 0], dt)
    return jax.lax.bitcast_convert_type(u, dt)


def _unsigned(bits: int) -> Any:
    return {2: jnp.uint2, 4: jnp.uint4}[bits]
