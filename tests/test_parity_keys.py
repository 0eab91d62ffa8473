"""Typed PRNG keys and GSPMDSharding against ``jax.device_put``, and the ownership rule for every target kind.

- Keys of every impl to every target kind ``transfer`` takes (a Sharding, a ShapeDtypeStruct, a
  jax.Array, a Device, a GSPMDSharding), from committed, uncommitted and resharded key arrays.
- ``GSPMDSharding`` as a ``transfer`` target, as a ``transfer_into`` destination, and as the target of a
  move between equivalent layouts (same devices, same boxes, another sharding class).
- A result shares no buffer with ``x`` unless it *is* ``x`` (the oracle of identity: device_put).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src.sharding_impls import GSPMDSharding
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.errors import LayoutMismatchError
from tests._device_put_oracle import assert_same_as_device_put

DEVS = np.array(jax.devices())
IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


def _gspmd(named: NamedSharding, ndim: int) -> GSPMDSharding:
    return GSPMDSharding(tuple(named.mesh.devices.flat), named._to_xla_hlo_sharding(ndim))


def _pointers(a: jax.Array) -> set[int]:
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return {s.data.unsafe_buffer_pointer() for s in a.addressable_shards if s.data.size}


A = NamedSharding(Mesh(DEVS[:4], ("x",)), P("x"))
B = NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("y", "z")), P("z"))


def _key_sources(impl: str) -> dict[str, Any]:
    split = jax.random.split(jax.random.key(11, impl=impl), 8)  # uncommitted, on the default device
    return {
        "uncommitted": lambda: jax.random.split(jax.random.key(11, impl=impl), 8),
        "named": lambda: jax.device_put(split, A),
        "single": lambda: jax.device_put(split, DEVS[6]),
        "resharded": lambda: jreshard.transfer(jax.device_put(split, A), B),
        "gspmd": lambda: jax.device_put(split, _gspmd(B, 1)),
        "pmap": lambda: jax.pmap(lambda k: k)(split),  # a pmap output's sharding
    }


def _targets(like: jax.Array) -> dict[str, Any]:
    """Every target kind, with the sharding device_put is asked for in the oracle."""
    g = _gspmd(B, 1)
    return {
        "NamedSharding": (B, B),
        "SingleDeviceSharding": (SingleDeviceSharding(DEVS[3]), SingleDeviceSharding(DEVS[3])),
        "Device": (DEVS[2], DEVS[2]),
        "GSPMDSharding": (g, g),
        "GSPMDSharding equivalent to A": (_gspmd(A, 1), _gspmd(A, 1)),
        "ShapeDtypeStruct": (jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=B), B),
        "ShapeDtypeStruct GSPMD": (jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=g), g),
        "jax.Array": (jax.device_put(like, g), g),
    }


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("source", ["uncommitted", "named", "single", "resharded", "gspmd", "pmap"])
def test_typed_keys_to_every_target_kind_equal_device_put(impl, source):
    x = _key_sources(impl)[source]()
    for name, (target, put) in _targets(x).items():
        want = jax.device_put(x, put)
        got = jreshard.transfer(x, target)
        try:
            assert_same_as_device_put(got, want)
        except AssertionError as err:
            raise AssertionError(f"{impl} keys from {source} to {name}: {err}") from None
        assert got is x or not (_pointers(got) & _pointers(x)), f"{name}: a new result shares x's buffers"
        assert (got is x) == (want is x), name
        # usable as keys: the same numbers as the source's
        np.testing.assert_array_equal(jax.vmap(jax.random.bits)(got), jax.vmap(jax.random.bits)(x))


@pytest.mark.parametrize("impl", IMPLS)
def test_typed_keys_into_gspmd_and_back_equal_device_put(impl):
    x = _key_sources(impl)["named"]()
    for dst in (_gspmd(B, 1), _gspmd(A, 1), B):
        want = jax.device_put(x, dst)
        into = jax.device_put(jax.random.split(jax.random.key(0, impl=impl), 8), dst)
        out = jreshard.transfer_into(x, into)
        assert_same_as_device_put(out, want)
        assert into.is_deleted()


def test_typed_keys_refuse_a_cast_before_any_byte_moves():
    x = _key_sources("threefry2x32")["named"]()
    with pytest.raises(LayoutMismatchError, match="typed PRNG key array is not cast"):
        jreshard.transfer(x, jax.ShapeDtypeStruct(x.shape, jnp.uint32, sharding=B))
    with pytest.raises(LayoutMismatchError, match="typed PRNG key array is not cast"):
        jreshard.transfer(jnp.zeros(8, jnp.uint32), jax.ShapeDtypeStruct((8,), x.dtype, sharding=B))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int4, jnp.int8])
def test_gspmd_as_target_into_and_equivalent_layout_equal_device_put(dtype):
    x = jax.device_put(np.arange(64).reshape(8, 8).astype(dtype), A)
    for dst in (_gspmd(B, 2), _gspmd(A, 2), GSPMDSharding.get_replicated(tuple(DEVS[2:6]))):
        want = jax.device_put(np.arange(64).reshape(8, 8).astype(dtype), dst)  # (from the host: see test_subbyte)
        got = jreshard.transfer(x, dst)
        assert_same_as_device_put(got, want)
        assert not (_pointers(got) & _pointers(x))
        into = jax.jit(lambda: jnp.zeros((8, 8), dtype), out_shardings=dst)()  # memory jax allocated
        ptrs = _pointers(into)
        out = jreshard.transfer_into(x, into)
        assert_same_as_device_put(out, want)
        assert into.is_deleted() and _pointers(out) == ptrs


# ------------------------------------------------------------------------------------------ ownership

_KINDS = ["float32", "bfloat16", "int4", "key"]


def _source(kind: str, place: str) -> jax.Array:
    if kind == "key":
        v = jax.random.split(jax.random.key(3), 8)
    elif kind == "int4":  # placed from the host: jax.device_put between devices overruns packed buffers
        v = np.arange(8).astype(jnp.int4)  # (test_subbyte.py), so no int4 array here takes that path
        if place == "uncommitted":
            return jnp.asarray(v)
    else:
        v = jnp.arange(8).astype(jnp.dtype(kind))
    if place == "uncommitted":
        return v
    if place == "single":
        return jax.device_put(v, DEVS[0])
    if place == "named":
        return jax.device_put(v, A)
    return jax.device_put(v, _gspmd(A, 1))


def _ownership_targets(x: jax.Array) -> list[tuple[str, Any, Any]]:
    """(name, target, what device_put is asked for): the leaf's own sharding object, equal and equivalent
    ones, its device, a ShapeDtypeStruct and an array on it, and a move."""
    own = x.sharding
    dev = next(iter(own.device_set))
    out = [
        ("its own sharding object", own, own),
        ("its device", dev, dev),
        ("SingleDeviceSharding of its device", SingleDeviceSharding(dev), SingleDeviceSharding(dev)),
        ("ShapeDtypeStruct on its sharding", jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=own), own),
        ("an array on its sharding", jax.device_put(x, own), own),
        ("a move", B, B),
    ]
    if isinstance(own, NamedSharding):
        renamed = NamedSharding(Mesh(own.mesh.devices, ("w",)), P("w") if own.spec else P())
        out += [("renamed axes", renamed, renamed), ("GSPMD equivalent", _gspmd(own, 1), _gspmd(own, 1))]
    return out


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(_KINDS), st.sampled_from(["uncommitted", "single", "named", "gspmd"]), st.data())
def test_a_result_never_shares_a_buffer_with_x_unless_it_is_x(kind, place, data):
    x = _source(kind, place)
    name, target, put = data.draw(st.sampled_from(_ownership_targets(x)), label="target")
    want = jax.device_put(x, put) if kind != "int4" or put is x.sharding else None
    got = jreshard.transfer(x, target)
    if got is not x:
        assert not (_pointers(got) & _pointers(x)), f"{kind} {place} to {name}: shares a buffer with x"
        assert got.committed
    if want is not None and want is x:
        assert got is x, f"{kind} {place} to {name}: device_put returns x itself"
    if got is x:  # only a committed leaf already on its target; device_put then returns x, or (a Device
        # target) a new handle over x's buffers: jreshard returns x itself (docs/transfer.md)
        assert x.committed and name in (
            "its own sharding object",
            "its device",
            "SingleDeviceSharding of its device",
            "ShapeDtypeStruct on its sharding",
            "an array on its sharding",
        ), name
        assert want is None or want is x or _pointers(want) == _pointers(x)
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(got) if kind == "key" else got.astype(jnp.float32)),
        np.asarray(jax.random.key_data(x) if kind == "key" else x.astype(jnp.float32)),
    )


def test_an_uncommitted_source_to_its_own_device_is_a_committed_copy():
    """Where jreshard differs from device_put on purpose: device_put returns a new committed array over
    ``x``'s own buffer, which a later donation of ``x`` deletes; jreshard returns a committed copy."""
    x = jnp.arange(8.0)
    want = jax.device_put(x, DEVS[0])
    assert _pointers(want) == _pointers(x)  # device_put: the same buffer (what this test guards against)
    got = jreshard.transfer(x, jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(DEVS[0])))
    assert got is not x and got.committed and not (_pointers(got) & _pointers(x))
    jax.jit(lambda v: v + 1, donate_argnums=0)(x)  # a train step donates x
    assert x.is_deleted() and not got.is_deleted()
    np.testing.assert_array_equal(np.asarray(got), np.arange(8.0))


@pytest.mark.parametrize("impl", IMPLS)
def test_typed_keys_move_on_the_xla_backend_too(impl):
    """docs/xla.md: key arrays move on backend='xla' as their key data, into transfer_into's keys too."""
    x = _key_sources(impl)["named"]()
    opts = jreshard.Options(backend="xla")
    got, rep = jreshard.transfer(x, B, options=opts, report=True)
    assert rep.backend is jreshard.Backend.XLA
    assert_same_as_device_put(got, jax.device_put(x, B))
    into = jax.device_put(jax.random.split(jax.random.key(0, impl=impl), 8), B)
    assert_same_as_device_put(jreshard.transfer_into(x, into, options=opts), jax.device_put(x, B))
    assert into.is_deleted()


def test_the_documented_differences_from_device_put():
    """docs/transfer.md, "Where jreshard differs from jax.device_put": each row, beside device_put."""
    # A committed x to a Device naming its own device: device_put gives a new handle over x's buffer,
    # jreshard gives x itself.
    x = jax.device_put(jnp.arange(8.0), DEVS[2])
    want = jax.device_put(x, DEVS[2])
    assert want is not x and _pointers(want) == _pointers(x)
    assert jreshard.transfer(x, DEVS[2]) is x
    # An equivalent layout of another sharding object: device_put aliases x, jreshard copies.
    x = jax.device_put(jnp.arange(8.0), A)
    for target in (NamedSharding(Mesh(DEVS[:4], ("w",)), P("w")), _gspmd(A, 1)):
        want = jax.device_put(x, target)
        assert want is not x and _pointers(want) == _pointers(x)
        got = jreshard.transfer(x, target)
        assert_same_as_device_put(got, want)
        assert not (_pointers(got) & _pointers(x))


@pytest.mark.parametrize("kind", ["float32", "cast", "int4", "key"])
def test_under_a_context_mesh_of_other_devices_as_device_put(kind):
    """Under ``jax.set_mesh(mesh)``, leaves on other devices move as ``jax.device_put`` moves them there:
    jreshard's own device computations (casts, repacking, donation) do not run under the caller's mesh."""
    c = NamedSharding(Mesh(DEVS[:2], ("z",)), P("z"))
    if kind == "key":
        x = _key_sources("threefry2x32")["named"]()
        into = jax.device_put(jax.random.split(jax.random.key(1), 8), c)
    elif kind == "int4":
        x = jax.device_put(np.arange(8).astype(jnp.int4), A)
        into = jax.device_put(np.zeros(8, jnp.int4), c)
    else:
        x = jax.device_put(jnp.arange(8.0), A)
        into = jax.jit(lambda: jnp.zeros(8), out_shardings=c)()
    target = jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=c) if kind == "cast" else c
    want = jax.device_put(np.asarray(x) if kind == "int4" else x, c)  # (packed: from the host)
    if kind == "cast":
        want = want.astype(jnp.bfloat16)
    with jax.set_mesh(Mesh(DEVS[4:], ("y",))):
        got = jreshard.transfer(x, target)
        out = None if kind == "cast" else jreshard.transfer_into(x, into)
        with_spec = jreshard.transfer(x, P("y")) if kind != "cast" else None
    assert_same_as_device_put(got, want)
    if out is not None:
        assert_same_as_device_put(out, want)
    if with_spec is not None:  # a PartitionSpec target still means the context mesh
        assert with_spec.sharding == NamedSharding(Mesh(DEVS[4:], ("y",)), P("y"))
        if kind == "key":
            np.testing.assert_array_equal(jax.random.key_data(with_spec), jax.random.key_data(x))
        else:
            np.testing.assert_array_equal(np.asarray(with_spec).view(np.uint8), np.asarray(x).view(np.uint8))


def test_shape_dtype_struct_targets_with_a_partition_spec_mean_the_context_mesh():
    """A ShapeDtypeStruct given a PartitionSpec names the mesh of ``jax.set_mesh``, for arrays and views."""
    from jreshard import views

    mesh = Mesh(DEVS[4:], ("y",))
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), A)
    sds = jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=P("y"))
    with jax.set_mesh(mesh):
        got = jreshard.transfer({"a": x, "v": views.astype(x, jnp.bfloat16)}, {"a": sds, "v": sds})
    want = jax.device_put(x, NamedSharding(mesh, P("y"))).astype(jnp.bfloat16)
    for leaf in got.values():
        assert leaf.sharding == NamedSharding(mesh, P("y"))
        np.testing.assert_array_equal(np.asarray(leaf).view(np.uint16), np.asarray(want).view(np.uint16))
