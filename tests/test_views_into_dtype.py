"""``transfer_into`` of views never casts: a view (or an array beside views) whose dtype differs from its
``into`` leaf's raises ``LayoutMismatchError`` before any byte moves, as on the plain path."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard import views
from jreshard.errors import LayoutMismatchError

DEVS = np.array(jax.devices())
A = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
B = NamedSharding(Mesh(DEVS[4:], ("y",)), P(None, "y"))
CASTS = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn]


def _into(dtype):
    return jax.jit(lambda: jnp.full((8, 4), 7, dtype), out_shardings=B)()


@pytest.mark.parametrize(("view_dtype", "into_dtype"), [p for p in itertools.permutations(CASTS, 2)])
def test_a_view_of_another_dtype_than_into_raises_before_any_byte_moves(view_dtype, into_dtype):
    x = jax.device_put(jnp.full((8, 4), 1.00415, jnp.float32), A)
    into = _into(into_dtype)
    before = np.asarray(into).copy()
    with pytest.raises(LayoutMismatchError, match="transfer_into does not cast") as err:
        jreshard.transfer_into({"w": views.astype(x, view_dtype)}, {"w": into})
    assert err.value.what == "dtype"
    assert not into.is_deleted() and not x.is_deleted()
    np.testing.assert_array_equal(np.asarray(into), before)


def test_an_array_beside_views_of_another_dtype_than_into_raises():
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), A)
    into = {"v": _into(jnp.bfloat16), "a": _into(jnp.bfloat16)}
    with pytest.raises(LayoutMismatchError, match="leaf 0 is an array of float32"):
        jreshard.transfer_into({"v": views.astype(x, jnp.bfloat16), "a": x}, into)  # ("a" sorts first: leaf 0)
    assert not any(a.is_deleted() for a in into.values())


def test_the_reported_double_rounding_is_refused_and_one_cast_gives_device_puts_value():
    """float32 1.00415 -> float16 -> bfloat16 lands on 1.0; the one cast to bfloat16 gives jnp's 1.0078125."""
    x = jax.device_put(jnp.full((8, 4), 1.00415, jnp.float32), A)
    with pytest.raises(LayoutMismatchError):
        jreshard.transfer_into(views.astype(x, jnp.float16), _into(jnp.bfloat16))
    out = jreshard.transfer_into(views.astype(x, jnp.bfloat16), _into(jnp.bfloat16))
    want = jax.device_put(x.astype(jnp.bfloat16), B)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(want).view(np.uint16))
    assert float(out[0, 0]) == float(jnp.bfloat16(1.00415)) != 1.0
