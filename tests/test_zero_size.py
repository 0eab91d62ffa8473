"""Zero-size leaves (a dimension of 0) come back as arrays jax can use: every shard the shape its sharding gives.

jax 0.10 answers a jitted call with ``out_shardings`` whose result has no element with an array each of whose
shards holds the *global* shape (``(0, 8, 4)`` on every device of a 4-way split, where the sharding says
``(0, 2, 4)``); jax refuses such an array in a later call. The paths that encode a leaf on its devices (packed
sub-byte dtypes, host memory kinds) used to hand such arrays back. Every dtype JAX has, over sharding pairs that
split the zero-size dimension and others, through ``transfer``, ``transfer_into``, backend ``xla``, casts and
host memory kinds; the oracle is the sharding's own ``shard_shape`` (and ``jax.device_put`` from the host).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jreshard
from tests.parity_cases import DTYPES

DEVS = np.array(jax.devices())
PACKED = {"int4", "uint4", "int2", "uint2", "float4_e2m1fn"}
SHAPE = (0, 8, 4)
SRC = NamedSharding(Mesh(DEVS[:4], ("x",)), P(None, "x"))
TARGETS = {
    "split_over_8": NamedSharding(Mesh(DEVS.reshape(2, 2, 2), ("a", "b", "c")), P(None, ("b", "c"))),
    "zero_dim_split": NamedSharding(Mesh(DEVS[4:], ("y",)), P("y")),
    "replicated": NamedSharding(Mesh(DEVS[2:6], ("y",)), P()),
    "one_device": SingleDeviceSharding(DEVS[7]),
}


def _empty(dtype, sharding, memory_kind=None, shape=SHAPE):
    """A zero-size array of ``dtype`` with ``sharding``, put from the host shard by shard (jax's own put)."""
    kind = memory_kind or "device"
    per = sharding.shard_shape(shape)
    arrays = [
        jax.device_put(np.zeros(per, dtype), SingleDeviceSharding(d, memory_kind=kind))
        for d in sharding.addressable_devices_indices_map(shape)
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding.with_memory_kind(kind), arrays)


def _check(out, sharding, dtype, shape=SHAPE):
    assert out.shape == shape and out.dtype == dtype
    assert out.sharding.is_equivalent_to(sharding, len(shape))
    want = sharding.shard_shape(shape)
    got = {s.device.id: s.data.shape for s in out.addressable_shards}
    assert got == {d.id: want for d in sharding.addressable_devices}
    jax.block_until_ready(jax.jit(lambda a: a)(out))  # jax takes it in a computation


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_zero_size_leaf_of_every_dtype_gets_the_shards_of_its_target(dtype, target):
    dst = TARGETS[target]
    x = _empty(jnp.dtype(dtype), SRC)
    _check(jreshard.transfer(x, dst), dst, x.dtype)
    into = _empty(x.dtype, dst)
    _check(jreshard.transfer_into(x, into), dst, x.dtype)
    if dtype not in PACKED:  # the oracle agrees (jax.device_put of a packed array overruns its buffers)
        _check(jax.device_put(x, dst), dst, x.dtype)


@pytest.mark.parametrize("shape", [SHAPE, (16, 0)])
@pytest.mark.parametrize("dtype", ["float32", "bool", "int4", "uint2", "float4_e2m1fn"])
def test_a_zero_size_leaf_through_backend_xla_and_under_a_transfer_guard(dtype, shape):
    src = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
    dst = NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("a", "b")), P("b", "a"))
    x = _empty(jnp.dtype(dtype), src, shape=shape)
    into = _empty(x.dtype, dst, shape=shape)
    xla = jreshard.Options(backend="xla")
    with jax.transfer_guard("disallow"):
        _check(jreshard.transfer(x, dst, options=xla), dst, x.dtype, shape)
        _check(jreshard.transfer(x, dst), dst, x.dtype, shape)
        _check(jreshard.transfer_into(x, into), dst, x.dtype, shape)
        _check(jreshard.transfer_into(x, _empty(x.dtype, dst, shape=shape), options=xla), dst, x.dtype, shape)


@pytest.mark.parametrize(
    "src, to",
    [
        ("float32", "bfloat16"),  # narrower: cast on the source devices, before the move
        ("float32", "int4"),
        ("float32", "float8_e4m3fn"),
        ("int8", "int32"),  # wider: cast on the target devices, after the move
        ("uint4", "int32"),
        ("float8_e3m4", "float32"),
    ],
)
@pytest.mark.parametrize("target", ["split_over_8", "zero_dim_split"])
def test_a_zero_size_leaf_cast_on_the_way(src, to, target):
    dst = TARGETS[target]
    x = _empty(jnp.dtype(src), SRC)
    _check(jreshard.transfer(x, jax.ShapeDtypeStruct(SHAPE, jnp.dtype(to), sharding=dst)), dst, jnp.dtype(to))


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_a_zero_size_leaf_into_host_memory(kind):
    dst = TARGETS["split_over_8"].with_memory_kind(kind)
    x = _empty(jnp.float32, SRC)
    _check(jreshard.transfer(x, dst), dst, x.dtype)
    into = _empty(jnp.float32, TARGETS["split_over_8"], kind)
    out = jreshard.transfer_into(x, into)
    _check(out, dst, x.dtype)
    assert out.sharding.memory_kind == kind


def test_a_weakly_typed_zero_size_leaf_stays_weak_as_device_put_keeps_it():
    dst = TARGETS["split_over_8"]
    x = jax.device_put(jnp.broadcast_to(1.0, SHAPE), SRC)  # a Python float broadcast: weakly typed
    assert x.weak_type and jax.device_put(x, dst).weak_type
    for options in (None, jreshard.Options(backend="xla")):
        out = jreshard.transfer(x, dst, options=options)
        _check(out, dst, x.dtype)
        assert out.weak_type
    host = dst.with_memory_kind("pinned_host")
    out = jreshard.transfer_into(x, jax.device_put(jnp.broadcast_to(1.0, SHAPE), host))
    assert out.weak_type and out.sharding.memory_kind == "pinned_host"
