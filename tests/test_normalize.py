"""transfer takes what jax.device_put takes: array targets (casting when their dtype differs), numpy and
scalar sources, host memory kinds in one process; its messages show shapes, dtypes and shardings, not data.
Every result is checked against jax.device_put's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _device_put_oracle import assert_same_as_device_put
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard

DEVS = np.array(jax.devices())
TRAIN = NamedSharding(Mesh(DEVS[:4], ("fsdp",)), P("fsdp"))
INFER = NamedSharding(Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
INFER_1D = NamedSharding(INFER.mesh, P("tp"))


def _params():
    return {
        "w": jax.device_put(jnp.arange(64.0).reshape(8, 8), TRAIN),
        "b": jax.device_put(jnp.arange(8, dtype=jnp.int32), TRAIN),
    }


def test_array_targets_mean_their_sharding():
    x = _params()
    rollout = {"w": jax.device_put(jnp.zeros((8, 8)), INFER), "b": jax.device_put(jnp.zeros(8, jnp.int32), INFER_1D)}
    out = jreshard.transfer(x, rollout)
    assert_same_as_device_put(out, jax.device_put(x, {k: v.sharding for k, v in rollout.items()}))
    rollout["w"].delete()  # a deleted array still names its sharding
    assert_same_as_device_put(jreshard.transfer(x["w"], rollout["w"]), jax.device_put(x["w"], INFER))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int8])
def test_array_and_shape_dtype_struct_targets_of_another_dtype_cast(dtype):
    x = _params()
    want = jax.device_put(x["w"].astype(dtype), INFER)
    out = jreshard.transfer(x, {"w": jax.device_put(jnp.zeros((8, 8), dtype), INFER), "b": INFER_1D})
    assert_same_as_device_put(out["w"], want)
    assert_same_as_device_put(out["b"], jax.device_put(x["b"], INFER_1D))
    sds = jreshard.transfer(x["w"], jax.ShapeDtypeStruct((8, 8), dtype, sharding=INFER))
    assert_same_as_device_put(sds, want)


@pytest.mark.parametrize(
    ("src", "dst", "wire"),
    [(jnp.float32, jnp.bfloat16, 2), (jnp.bfloat16, jnp.float32, 2), (jnp.int8, jnp.float32, 1)],
    ids=["narrowing", "widening", "int8-to-float32"],
)
def test_a_cast_target_crosses_the_links_in_the_narrower_dtype(src, dst, wire):
    x = jax.device_put((jnp.arange(64.0).reshape(8, 8) - 20.5).astype(src), TRAIN)
    target = jax.ShapeDtypeStruct((8, 8), dst, sharding=INFER)
    out, rep = jreshard.transfer(x, target, report=True)
    assert_same_as_device_put(out, jax.device_put(x.astype(dst), INFER))
    plain = jreshard.transfer(x.astype(dst), INFER, report=True)[1]
    moved = rep.network_bytes + rep.fast_bytes + rep.same_device_bytes
    plain_moved = plain.network_bytes + plain.fast_bytes + plain.same_device_bytes
    assert moved > 0 and moved * np.dtype(dst).itemsize == wire * plain_moved


def test_many_cast_targets_over_several_device_sets_match_device_put(monkeypatch):
    """Narrowing and widening casts of many leaves, on two device sets, with a zero-size and a weakly typed leaf:
    cast in one jitted call per device set (before the move, or after it), bit for bit ``astype`` then
    ``jax.device_put``."""
    from jreshard.call import normalize

    calls = []
    real = normalize._cast_jitted
    monkeypatch.setattr(normalize, "_cast_jitted", lambda xs, ds: calls.append(len(xs)) or real(xs, ds))
    other = NamedSharding(Mesh(DEVS[4:6], ("x",)), P("x"))
    rng = np.random.default_rng(7)
    x, target, want = {}, {}, {}
    cases = [
        (jnp.float32, jnp.bfloat16, TRAIN, INFER),
        (jnp.float32, jnp.float16, TRAIN, INFER_1D),
        (jnp.bfloat16, jnp.float32, other, INFER),  # widening: cast on the target devices after the move
        (jnp.float32, jnp.int8, other, INFER),
        (jnp.int32, jnp.float32, TRAIN, INFER),
    ]
    for i in range(12):
        src, dst, s_from, s_to = cases[i % len(cases)]
        shape = (8,) if s_to is INFER_1D else (8, 4)
        x[f"l{i}"] = jax.device_put((rng.standard_normal(shape) * 50).astype(src), s_from)
        target[f"l{i}"] = jax.ShapeDtypeStruct(shape, dst, sharding=s_to)
        want[f"l{i}"] = jax.device_put(x[f"l{i}"].astype(dst), s_to)
    x["empty"] = jax.device_put(jnp.zeros((0, 4), jnp.float32), TRAIN)
    target["empty"] = jax.ShapeDtypeStruct((0, 4), jnp.bfloat16, sharding=INFER)
    want["empty"] = jax.device_put(x["empty"].astype(jnp.bfloat16), INFER)
    x["weak"] = jax.device_put(jnp.asarray(1.5), NamedSharding(TRAIN.mesh, P()))  # weakly typed
    target["weak"] = jax.ShapeDtypeStruct((), jnp.bfloat16, sharding=NamedSharding(INFER.mesh, P()))
    want["weak"] = jax.device_put(x["weak"].astype(jnp.bfloat16), target["weak"].sharding)
    out = jreshard.transfer(x, target)
    assert calls and max(calls) > 1  # batched, not one dispatch per leaf
    for k in x:
        assert_same_as_device_put(out[k], want[k])
        np.testing.assert_array_equal(
            np.asarray(out[k]).reshape(-1).view(np.uint8), np.asarray(want[k]).reshape(-1).view(np.uint8), err_msg=k
        )


def test_a_target_of_another_shape_is_refused_with_shapes_not_data():
    x = _params()
    big = jax.device_put(jnp.zeros((64, 64)), INFER)
    with pytest.raises(jreshard.LayoutMismatchError, match=r"leaf \['w'\] is float32\[8, 8\].*float32\[64, 64\]") as e:
        jreshard.transfer(x, {"w": big, "b": INFER_1D})
    assert e.value.what == "shape" and "0." not in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize(
    "value",
    [np.arange(16, dtype=np.float32).reshape(4, 4), np.arange(4, dtype=np.int64), np.float32(2.5), 3.0, 7, True],
    ids=["ndarray", "int64", "np_scalar", "float", "int", "bool"],
)
def test_numpy_and_python_scalar_sources_are_placed_as_device_put_places_them(value):
    sharding = INFER if np.ndim(value) == 2 else NamedSharding(INFER.mesh, P())
    out = jreshard.transfer({"v": value, "w": _params()["w"]}, {"v": sharding, "w": INFER})
    assert_same_as_device_put(out["v"], jax.device_put(value, sharding))


def test_a_host_source_with_a_none_target_lands_as_device_put_without_a_device():
    value = np.ones(3)
    out = jreshard.transfer({"v": value, "w": _params()["w"]}, {"v": None, "w": INFER})
    assert_same_as_device_put(out["v"], jax.device_put(value))
    assert not out["v"].committed


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_host_memory_kinds_move_in_one_process(kind):
    x = _params()
    to_host = jreshard.transfer(x, {"w": INFER.with_memory_kind(kind), "b": INFER_1D.with_memory_kind(kind)})
    assert_same_as_device_put(
        to_host, jax.device_put(x, {"w": INFER.with_memory_kind(kind), "b": INFER_1D.with_memory_kind(kind)})
    )
    assert {v.sharding.memory_kind for v in jax.tree.leaves(to_host)} == {kind}
    back = jreshard.transfer(to_host, TRAIN)  # (rank-agnostic: P("fsdp") shards the first axis)
    assert_same_as_device_put(back, jax.device_put(to_host, TRAIN))
    mixed = jreshard.transfer(x, {"w": INFER.with_memory_kind(kind), "b": INFER_1D})
    assert mixed["w"].sharding.memory_kind == kind and mixed["b"].sharding.memory_kind == "device"
    assert_same_as_device_put(mixed["b"], jax.device_put(x["b"], INFER_1D))


def test_messages_show_shapes_and_dtypes_never_the_array():
    x = _params()
    with pytest.raises(jreshard.LayoutError, match=r"\['w'\] is ndarray float64\[64, 64\]; expected a jax Sharding"):
        jreshard.transfer(x, {"w": np.zeros((64, 64)), "b": INFER_1D})
    with pytest.raises(jreshard.LayoutMismatchError, match=r"structure PyTreeDef\(\{'w': \*\}\)") as e:
        jreshard.transfer(x, {"w": x["w"]})
    assert "Array(" not in str(e.value) and "0." not in str(e.value)
