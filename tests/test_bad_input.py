"""Bad input to transfer / transfer_into: a specific exception naming the argument, the leaf's key path and
the values, raised before any byte moves (sources and destinations intact)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard

DEVS = np.array(jax.devices())
TRAIN = NamedSharding(Mesh(DEVS[:4], ("fsdp",)), P("fsdp"))
INFER = NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))


def _x():
    return {"layer": {"w": jax.device_put(jnp.ones((8, 8)), TRAIN)}}


def test_transfer_under_jit_says_it_runs_outside_jit():
    x = _x()["layer"]["w"]
    with pytest.raises(jreshard.LayoutError, match=r"traced value.*outside jax.jit"):
        jax.jit(lambda a: jreshard.transfer(a, INFER))(x)


def test_partition_spec_target_says_use_named_sharding():
    with pytest.raises(jreshard.LayoutError, match=r"\['layer'\]\['w'\].*PartitionSpec.*NamedSharding\(mesh"):
        jreshard.transfer(_x(), {"layer": {"w": P("tp")}})


def test_shape_dtype_struct_target_is_accepted():
    x = _x()
    out = jreshard.transfer(x, {"layer": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=INFER)}})
    assert out["layer"]["w"].sharding == INFER
    with pytest.raises(jreshard.LayoutMismatchError, match=r"\['layer'\]\['w'\] is float32\[8, 8\].*another shape"):
        jreshard.transfer(x, {"layer": {"w": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=INFER)}})
    with pytest.raises(jreshard.LayoutError, match="no sharding"):
        jreshard.transfer(x, {"layer": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}})


@pytest.mark.parametrize("value", [np.ones((8, 8), np.float32), 3.0])
def test_host_values_are_refused_by_transfer_into_with_the_fix(value):
    into = {"a": jax.device_put(jnp.zeros(np.shape(value)), INFER if np.ndim(value) else INFER.mesh.devices.flat[0])}
    with pytest.raises(
        jreshard.LayoutError, match=r"\['a'\] of x is (ndarray|float).*jax.device_put\(value, sharding\)"
    ):
        jreshard.transfer_into({"a": value}, into)


def test_memory_kind_into_moves_through_device_memory_into_the_into_arrays():
    """transfer moves host memory kinds (jreshard.call.normalize); transfer_into moves them through device memory
    and places the result into the into array, in place (jreshard.call.repack)."""
    pinned = INFER.with_memory_kind("pinned_host")
    x = _x()
    into = {"layer": {"w": jax.device_put(jnp.zeros((8, 8)), pinned)}}
    before = [s.data.unsafe_buffer_pointer() for s in into["layer"]["w"].addressable_shards]
    out = jreshard.transfer_into(x, into)
    w = out["layer"]["w"]
    assert w.sharding == pinned and np.array_equal(np.asarray(w), np.asarray(x["layer"]["w"]))
    assert [s.data.unsafe_buffer_pointer() for s in w.addressable_shards] == before
    assert into["layer"]["w"].is_deleted()


def test_indivisible_error_names_the_key_path():
    x = {"emb": jax.device_put(jnp.ones((6, 4)), NamedSharding(Mesh(DEVS[:2], ("a",)), P("a")))}
    with pytest.raises(jreshard.IndivisibleError, match=r"leaf \['emb'\] of shape \(6, 4\)"):
        jreshard.transfer(x, {"emb": NamedSharding(Mesh(DEVS[4:8], ("t",)), P("t"))})


def test_options_and_topology_of_the_wrong_type():
    x = _x()
    with pytest.raises(TypeError, match=r"options=\{\}"):
        jreshard.transfer(x, INFER, options={})
    with pytest.raises(TypeError, match="topology='abc'"):
        jreshard.transfer(x, INFER, topology="abc")


def test_deleted_source_is_named_and_into_stays_intact():
    x = {"a": jax.device_put(jnp.ones((8, 8)), TRAIN), "b": jax.device_put(jnp.ones((8, 8)), TRAIN)}
    into = {k: jax.device_put(jnp.zeros((8, 8)), INFER) for k in x}
    x["b"].delete()
    with pytest.raises(jreshard.LayoutError, match=r"leaf \['b'\] of x has been deleted"):
        jreshard.transfer_into(x, into)
    assert not any(v.is_deleted() for v in into.values())
    assert float(np.asarray(into["a"]).max()) == 0.0
