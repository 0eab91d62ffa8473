"""Parity with ``jax.device_put``: ``jreshard.transfer(x, t)`` gives what ``jax.device_put(x, t)`` gives, and
``jreshard.transfer_into(x, into)`` what ``jax.device_put(x, into.sharding)`` gives, over ``into``'s buffers
where the test holds the only reference to them.

The cases re-express the device_put cases of JAX's own tests (jax-v0.10.2 tests/array_test.py,
pjit_test.py, api_test.py, layout_test.py, memories_test.py; each case table names its test). Every
comparison collects each property that differs (value bits of every addressable shard, dtype, weak_type,
committedness, sharding, identity) and fails with all of them at once. What device_put refuses, jreshard
must refuse with an exception.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from tests.parity_cases import (
    DTYPE_PAIRS,
    DTYPES,
    KEY_IMPLS,
    PAIRS,
    SHAPE,
    WIDE,
    X64,
    devs,
    host_values,
    keys,
    sharding,
)

# ----------------------------------------------------------------------------------------------- comparison


def _is_key(a: Any) -> bool:
    return jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)


def bits(a: Any) -> np.ndarray:
    """The raw bits of ``a`` (a key array: its key data), flat, one unsigned integer per element or word."""
    if _is_key(a):
        a = jax.random.key_data(a)
    host = np.ascontiguousarray(np.asarray(a)).reshape(-1)
    return host.view(np.dtype(f"u{min(host.dtype.itemsize, 8)}"))


def _shards(a: jax.Array) -> dict[int, tuple[Any, np.ndarray]]:
    out = {}
    for s in a.addressable_shards:
        index = tuple((sl.start, sl.stop, sl.step) for sl in s.index)
        out[s.device.id] = (index, bits(s.data))
    return out


def _weak(a: Any) -> bool:
    return a.weak_type if hasattr(a, "weak_type") else a.aval.weak_type


def _read_bits(a: jax.Array, what: str, diff: list[str]) -> Any:
    try:
        return bits(a), _shards(a)
    except Exception as err:
        diff.append(f"{what}'s values cannot be read: {type(err).__name__}: {str(err)[:120]}")
        return None


def differences(res: Any, ref: jax.Array, x: Any = None, identity: bool = True, target: Any = None) -> list[str]:
    """Every property in which ``res`` differs from device_put's ``ref`` (``x``: the source, for identity;
    ``target``: the leaf's target, whose sharding object device_put returns as it is)."""
    if not isinstance(res, jax.Array):
        return [f"result is {type(res).__name__}, not a jax.Array"]
    diff = []
    if res.dtype != ref.dtype:
        diff.append(f"dtype {res.dtype} != {ref.dtype}")
    if res.shape != ref.shape:
        diff.append(f"shape {res.shape} != {ref.shape}")
    if _weak(res) != _weak(ref):
        diff.append(f"weak_type {_weak(res)} != {_weak(ref)}")
    if res._committed != ref._committed:
        diff.append(f"committed {res._committed} != {ref._committed}")
    if type(res.sharding) is not type(ref.sharding) or res.sharding != ref.sharding:
        diff.append(f"sharding {res.sharding} != {ref.sharding}")
    elif isinstance(target, jax.sharding.Sharding) and ref.sharding is target and res.sharding is not target:
        diff.append("sharding object: device_put returns the target's, the result carries another (equal) one")
    got_all = _read_bits(res, "the result", diff)
    want_all = _read_bits(ref, "device_put's result", diff)
    if not diff and got_all is not None and want_all is not None:
        if not np.array_equal(got_all[0], want_all[0]):
            diff.append("value bits differ")
        got, want = got_all[1], want_all[1]
        if got.keys() != want.keys():
            diff.append(f"shard devices {sorted(got)} != {sorted(want)}")
        else:
            for d in sorted(want):
                if got[d][0] != want[d][0] or not np.array_equal(got[d][1], want[d][1]):
                    diff.append(f"shard value bits differ on device {d}")
                    break
    if identity and x is not None and (res is x) != (ref is x):
        diff.append(f"identity: result is x {res is x}, device_put's is x {ref is x}")
    return diff


def assert_parity(res: Any, ref: Any, x: Any = None, identity: bool = True, target: Any = None) -> None:
    """``res`` against device_put's ``ref``, leaf by leaf (``target``: one target for every leaf, or a list of
    one per leaf)."""
    ref_leaves, ref_tree = jax.tree_util.tree_flatten(ref)
    res_leaves, res_tree = jax.tree_util.tree_flatten(res)
    assert res_tree == ref_tree, f"structure {res_tree} != {ref_tree}"
    x_leaves = jax.tree_util.tree_leaves(x) if x is not None else [None] * len(ref_leaves)
    targets = target if isinstance(target, list) else [target] * len(ref_leaves)
    problems = []
    for i, (r, e, s, t) in enumerate(zip(res_leaves, ref_leaves, x_leaves, targets, strict=True)):
        problems += [f"leaf {i}: {d}" for d in differences(r, e, s, identity, t)]
    assert not problems, "; ".join(problems)


def oracle_input(x: Any) -> Any:
    """What ``jax.device_put`` is given as the oracle's source: ``x``, with packed sub-byte leaves read back to
    the host. On XLA's CPU client a device-to-device ``device_put`` of a packed array between device
    assignments writes past its buffers (tests/test_subbyte_props.py); from the host it places the same bits."""
    from jreshard.sharding.dtypes import packed_bits

    def host(a: Any) -> Any:
        packed = isinstance(a, jax.Array) and not _is_key(a) and packed_bits(np.dtype(a.dtype)) is not None
        return np.asarray(a) if packed else a

    return jax.tree_util.tree_map(host, x)


def pointers(a: jax.Array) -> dict[int, int]:
    return {s.device.id: s.data.unsafe_buffer_pointer() for s in a.addressable_shards}


def check_into(x: Any, into_leaves: list[jax.Array], treedef: Any) -> None:
    """``transfer_into(x, into)`` against ``device_put(x, into.sharding)``, and in place: ``into_leaves`` is the
    list holding the only reference to each ``into`` leaf (it is emptied before the call)."""
    shardings = [a.sharding for a in into_leaves]
    before = [pointers(a) for a in into_leaves]
    ref = jax.device_put(oracle_input(x), treedef.unflatten(shardings))
    into = treedef.unflatten(into_leaves)
    into_leaves.clear()
    res = jreshard.transfer_into(x, into)
    del into
    assert_parity(res, ref, identity=False, target=shardings)
    leaves = jax.tree_util.tree_leaves(res)
    after = [pointers(a) for a in leaves]
    # (a zero-size leaf holds no byte: where its empty buffer lies means nothing)
    moved = [i for i, (b, a, r) in enumerate(zip(before, after, leaves, strict=True)) if b != a and r.size]
    assert not moved, f"in-place: leaves {moved} are not over into's buffers"


def source(name: str, dtype: str = "int32", seed: int = 0, shape: tuple[int, ...] = SHAPE) -> jax.Array:
    """A committed source on ``sharding(name)`` with the bits of ``host_values``."""
    return jax.device_put(host_values(dtype, shape, seed), sharding(name))


def fresh(name: str, dtype: str = "int32", seed: int = 1, shape: tuple[int, ...] = SHAPE) -> jax.Array:
    """An ``into`` leaf on ``sharding(name)`` over memory jax allocated (a copy: device_put from numpy may keep
    host memory it does not own)."""
    s = sharding(name)
    host = host_values(dtype, shape, seed)
    try:
        first = jax.device_put(host, s)
    except NotImplementedError:  # unreduced: device_put reaches it from a committed array only
        first = jax.device_put(jax.device_put(host, NamedSharding(s.mesh, P())), s)
    return jax.device_put(first, s, may_alias=False)


def _id(case: Any) -> str:
    return case if isinstance(case, str) else "-".join(map(str, case))


# ------------------------------------------------------------------------------- sharding to sharding pairs


@pytest.mark.parametrize("src,dst,origin", PAIRS, ids=[f"{s}->{d}" for s, d, _ in PAIRS])
def test_transfer_pair(src: str, dst: str, origin: str) -> None:
    x = source(src)
    ref = jax.device_put(x, sharding(dst))
    # device_put returns the target's own object unless its caches hold an equal one from an earlier
    # call (another test in this process): then the result must match what device_put gave.
    assert ref.sharding == sharding(dst)
    assert_parity(jreshard.transfer(x, sharding(dst)), ref, x, target=sharding(dst))


@pytest.mark.parametrize("src,dst,origin", PAIRS, ids=[f"{s}->{d}" for s, d, _ in PAIRS])
def test_transfer_into_pair(src: str, dst: str, origin: str) -> None:
    x = source(src)
    into = [fresh(dst)]
    check_into(x, into, jax.tree_util.tree_structure(0))


def test_unreduced_target_is_refused_with_the_reason() -> None:
    """pjit_test ShardingInTypesTest.test_sharded_unreduced_roundtrip (P('x') -> unreduced): device_put keeps
    on each device the part of the array it held and zeros elsewhere (partial sums that add up to the array;
    which ones depends on the source's layout), an array whose values jax itself cannot index
    (``devices_indices_map`` refuses unreduced shardings). jreshard refuses such a target before any byte
    moves, and says why (docs/transfer.md)."""
    x = source("ns_explicit_x")
    with pytest.raises(jreshard.LayoutError, match="unreduced axes"):
        jreshard.transfer(x, sharding("ns_unreduced_x"))
    into = jax.device_put(x, sharding("ns_unreduced_x"))
    with pytest.raises(jreshard.LayoutError, match="unreduced axes"):
        jreshard.transfer_into(x, into)
    assert not into.is_deleted()


def test_a_manual_mesh_target_is_refused_with_the_reason() -> None:
    """A target on a mesh of Manual axes (which exist inside shard_map only): jax.device_put fails on it with an
    AssertionError from its own internals; jreshard refuses it before any byte moves, naming the axes and the
    fix (it raised the same AssertionError, from the results it made)."""
    from jax.sharding import AxisType

    x = source("ns_explicit_x")
    mesh = jax.make_mesh((2,), ("m",), axis_types=(AxisType.Manual,), devices=jax.devices()[2:4])
    with pytest.raises(jreshard.LayoutError, match=r"axes \['m'\] are Manual.*Auto or Explicit"):
        jreshard.transfer(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("m")))


# ------------------------------------------------------------------------------------------------- dtypes

DTYPE_CASES = [(d, s, t) for d in DTYPES for s, t in DTYPE_PAIRS]


@pytest.mark.parametrize("dtype,src,dst", DTYPE_CASES, ids=[_id(c) for c in DTYPE_CASES])
def test_transfer_dtype(dtype: str, src: str, dst: str) -> None:
    """api_test APITest.test_device_put_literals and pjit_test ArrayPjitTest.test_cpu_bfloat16_to_tpu, over
    every dtype (without x64, 64-bit host values arrive as what device_put makes of them)."""
    x = source(src, dtype)
    ref = jax.device_put(oracle_input(x), sharding(dst))
    assert_parity(jreshard.transfer(x, sharding(dst)), ref, x, target=sharding(dst))


INTO_DTYPE_CASES = [(d, *DTYPE_PAIRS[0]) for d in DTYPES]


@pytest.mark.parametrize("dtype,src,dst", INTO_DTYPE_CASES, ids=[_id(c) for c in INTO_DTYPE_CASES])
def test_transfer_into_dtype(dtype: str, src: str, dst: str) -> None:
    x = source(src, dtype)
    into = [fresh(dst, dtype)]
    check_into(x, into, jax.tree_util.tree_structure(0))


X64_CASES = [(d, s, t) for d in WIDE for s, t in DTYPE_PAIRS]


@pytest.mark.parametrize("dtype,src,dst", X64_CASES, ids=[_id(c) for c in X64_CASES])
def test_transfer_dtype_x64(dtype: str, src: str, dst: str) -> None:
    """The 64-bit dtypes as 64-bit values, under ``jax.enable_x64(True)`` (the suite runs with x64 off)."""
    with jax.enable_x64(True):
        x = source(src, dtype)
        assert np.dtype(x.dtype).itemsize == np.dtype(dtype).itemsize
        ref = jax.device_put(x, sharding(dst))
        assert_parity(jreshard.transfer(x, sharding(dst)), ref, x, target=sharding(dst))


@pytest.mark.parametrize("dtype", WIDE)
def test_transfer_into_dtype_x64(dtype: str) -> None:
    with jax.enable_x64(True):
        x = source(DTYPE_PAIRS[0][0], dtype)
        into = [fresh(DTYPE_PAIRS[0][1], dtype)]
        check_into(x, into, jax.tree_util.tree_structure(0))


def test_x64_setting_as_device_put_has_it() -> None:
    """Without x64, device_put narrows 64-bit host values to 32 bits: the dtype cases above compare that."""
    x = source("single0", "int64")
    assert X64 or x.dtype == np.int32


KEY_CASES = [(impl, s, t) for impl in KEY_IMPLS for s, t in [("ns1d_x", "single1"), ("ns_first4", "gspmd_last4")]]


def _key_source(impl: str, name: str, seed: int = 0) -> jax.Array:
    return jax.device_put(keys(impl, SHAPE, seed), sharding(name))


@pytest.mark.parametrize("impl,src,dst", KEY_CASES, ids=[_id(c) for c in KEY_CASES])
def test_transfer_keys(impl: str, src: str, dst: str) -> None:
    """pjit_test ArrayPjitTest.test_device_put_sharding_prng: typed keys to Named, single-device and GSPMD."""
    x = _key_source(impl, src)
    ref = jax.device_put(x, sharding(dst))
    assert _is_key(ref)
    assert_parity(jreshard.transfer(x, sharding(dst)), ref, x, target=sharding(dst))


@pytest.mark.parametrize("impl,src,dst", KEY_CASES, ids=[_id(c) for c in KEY_CASES])
def test_transfer_into_keys(impl: str, src: str, dst: str) -> None:
    x = _key_source(impl, src)
    into = [_key_source(impl, dst, seed=1)]
    check_into(x, into, jax.tree_util.tree_structure(0))


def test_transfer_keys_uncommitted_to_pmap_sharding() -> None:
    """pjit_test ArrayPjitTest.test_device_put_sharding_prng: split keys (uncommitted) to a pmap output's sharding."""
    x = keys("threefry2x32", SHAPE, 3)
    ref = jax.device_put(x, sharding("pmap_out"))
    assert_parity(jreshard.transfer(x, sharding("pmap_out")), ref, x)


# ------------------------------------------------------------------------------------ sources of every kind


def _src_uncommitted() -> jax.Array:
    return jnp.arange(8, dtype=jnp.int32)


SOURCE_CASES: dict[str, tuple[Any, Any, str]] = {
    # name: (build x, build target, the JAX test)
    "uncommitted->ns1d_x": (_src_uncommitted, lambda: sharding("ns1d_x"), "api_test test_device_put_sharding"),
    "uncommitted->single0": (_src_uncommitted, lambda: sharding("single0"), "array_test test_array_shards_committed"),
    "uncommitted->single1": (_src_uncommitted, lambda: sharding("single1"), "array_test test_array_shards_committed"),
    "uncommitted->device1": (_src_uncommitted, lambda: devs()[1], "array_test test_array_shards_committed"),
    "uncommitted->device0": (_src_uncommitted, lambda: devs()[0], "array_test JaxArrayTest.test_device_put"),
    "uncommitted_2d->ns2d_xy": (
        lambda: jnp.arange(32, dtype=jnp.float32).reshape(SHAPE),
        lambda: sharding("ns2d_xy"),
        "pjit_test test_device_put_under_set_mesh",
    ),
    "weak_float->single1": (lambda: jnp.asarray(3.0), lambda: sharding("single1"), "api_test test_device_put_literals"),
    "weak_float->ns1d_rep": (
        lambda: jnp.asarray(2.0),
        lambda: sharding("ns1d_rep"),
        "pjit_test test_device_put_sharding_nondivisible_sharding_error (2. to P())",
    ),
    "weak_int->gspmd_rep4": (
        lambda: jnp.asarray(7),
        lambda: sharding("gspmd_rep4"),
        "api_test test_device_put_literals",
    ),
    "weak_bool->single5": (lambda: jnp.asarray(True), lambda: sharding("single5"), "api_test test_device_put_literals"),
    "weak_committed->ns_first2_rep": (
        lambda: jax.device_put(jnp.asarray(1.5), devs()[3]),
        lambda: sharding("ns_first2_rep"),
        "memories_test test_device_put_python_scalar",
    ),
    "weak_vector->ns1d_x": (
        lambda: jnp.asarray(2.0) * jnp.ones(8, dtype=jnp.float32) + 0.5,
        lambda: sharding("ns1d_x"),
        "array_test test_sds_like (weak_type)",
    ),
    "weak_sum->ns1d_rep": (
        lambda: jnp.asarray(1.0) + jnp.asarray(2.0),
        lambda: sharding("ns1d_rep"),
        "array_test test_sds_like (weak scalar)",
    ),
    "zero_d_strong->single1": (
        lambda: jax.device_put(np.float32(8), devs()[0]),
        lambda: sharding("single1"),
        "memories_test test_device_put_numpy_scalar",
    ),
    "zero_d->ns_reduced_x": (
        lambda: jax.device_put(np.int32(5), devs()[0]),
        lambda: sharding("ns_reduced_scalar"),
        "pjit_test test_reshard_on_scalar_reduced",
    ),
    "empty_1d->ns1d_x": (
        lambda: jnp.zeros((0,), jnp.float32),
        lambda: sharding("ns1d_x"),
        "api_test test_device_put_across_devices ((2, 0))",
    ),
    "empty_cols->ns_mid4_cols": (
        lambda: jax.device_put(np.zeros((0, 4), np.float32), sharding("single0")),
        lambda: sharding("ns_mid4_cols"),
        "memories_test test_zero_size_parameter",
    ),
    "empty_rows->single5": (
        lambda: jax.device_put(np.zeros((8, 0), np.int8), sharding("ns2d_x_partial")),
        lambda: sharding("single5"),
        "api_test test_device_put_across_devices ((2, 0))",
    ),
    "pmap_out->ns_last4": (
        lambda: jax.pmap(lambda v: v + 1)(jnp.arange(32, dtype=jnp.int32).reshape(SHAPE)),
        lambda: sharding("ns_last4"),
        "pjit_test test_device_put_sharding_prng (out_p.sharding)",
    ),
    "jnp_bf16->ns2d_rep": (
        lambda: jnp.zeros(SHAPE, dtype=jnp.bfloat16) + 1,
        lambda: sharding("ns2d_rep"),
        "pjit_test test_cpu_bfloat16_to_tpu",
    ),
}


@pytest.mark.parametrize("case", list(SOURCE_CASES))
def test_transfer_source(case: str) -> None:
    build_x, build_t, _origin = SOURCE_CASES[case]
    x, t = build_x(), build_t()
    ref = jax.device_put(x, t)
    assert_parity(jreshard.transfer(x, t), ref, x, target=t)


INTO_SOURCE_CASES = [c for c in SOURCE_CASES if "->device" not in c]


@pytest.mark.parametrize("case", INTO_SOURCE_CASES)
def test_transfer_into_source(case: str) -> None:
    build_x, build_t, _origin = SOURCE_CASES[case]
    x = build_x()
    host = np.asarray(x)
    into = [jax.device_put(jax.device_put(np.ones_like(host), build_t()), build_t(), may_alias=False)]
    check_into(x, into, jax.tree_util.tree_structure(0))


def test_transfer_into_uncommitted_into() -> None:
    """An uncommitted ``into`` (``jnp.zeros``): device_put(x, into.sharding) commits the result."""
    x = source("ns1d_x", "float32")
    into = [jnp.zeros(SHAPE, jnp.float32) + 1]
    assert not into[0]._committed
    check_into(x, into, jax.tree_util.tree_structure(0))


def test_transfer_into_weak_into() -> None:
    """A weak-typed ``into`` scalar: the result has x's weak_type, as device_put(x, into.sharding) does."""
    x = jax.device_put(np.float32(3), devs()[2])
    into = [jax.device_put(jnp.asarray(0.0), devs()[6])]
    assert into[0].weak_type and not x.weak_type
    check_into(x, into, jax.tree_util.tree_structure(0))


HOST_CASES: dict[str, tuple[Any, Any, str]] = {
    "numpy_array->ns2d_xy": (
        lambda: host_values("int32", SHAPE, 0),
        lambda: sharding("ns2d_xy"),
        "memories_test DevicePutTest.test_device_put_numpy_array",
    ),
    "numpy_scalar->single1": (lambda: np.float32(8), lambda: sharding("single1"), "memories_test numpy_scalar"),
    "python_float->single1": (lambda: 3.0, lambda: sharding("single1"), "memories_test test_device_put_python_scalar"),
    "python_int->ns1d_rep": (lambda: 8, lambda: sharding("ns1d_rep"), "memories_test test_device_put_python_int"),
    "list_of_numpy->device": (
        lambda: [host_values("float32", SHAPE, 1), (host_values("float32", SHAPE, 2),)],
        lambda: devs()[2],
        "api_test APITest.test_device_put_and_get",
    ),
}


@pytest.mark.parametrize("case", list(HOST_CASES))
def test_transfer_host_value(case: str) -> None:
    """Host values (numpy arrays, numpy and Python scalars), which device_put places: the same result."""
    build_x, build_t, _origin = HOST_CASES[case]
    x, t = build_x(), build_t()
    ref = jax.device_put(x, t)
    assert_parity(jreshard.transfer(x, t), ref, target=t)


# ----------------------------------------------------------------------------------------- target kinds


def _x2d() -> jax.Array:
    return source("ns_first4", "float32")


def _sds(sh: str) -> Any:
    return jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding(sh))


def _array_target(sh: str) -> jax.Array:
    return jax.device_put(np.zeros(SHAPE, np.float32), sharding(sh))


# name: (build x, jreshard's target, device_put's target, context, the JAX test)
TARGET_CASES: dict[str, tuple[Any, Any, Any, Any, str]] = {
    "device": (_x2d, lambda: devs()[5], lambda: devs()[5], None, "api_test test_device_put_across_devices"),
    "device_of_source": (
        lambda: source("single0", "float32"),
        lambda: devs()[0],
        lambda: devs()[0],
        None,
        "api_test JitTest.test_device_put_aliasing",
    ),
    "pspec_set_mesh": (
        _x2d,
        lambda: P("x"),
        lambda: P("x"),
        lambda: jax.set_mesh(sharding("ns2d_xy").mesh),
        "pjit_test ShardingInTypesTest.test_device_put_set_mesh",
    ),
    "pspec_set_mesh_explicit": (
        lambda: jnp.arange(8, dtype=jnp.int32),
        lambda: P("x"),
        lambda: P("x"),
        lambda: jax.set_mesh(sharding("ns_explicit_x").mesh),
        "pjit_test ShardingInTypesTest.test_device_put_set_mesh (explicit axes)",
    ),
    "pspec_set_mesh_2d": (
        lambda: source("ns_complex_model", "float32"),
        lambda: P("x", "y"),
        lambda: P("x", "y"),
        lambda: jax.set_mesh(sharding("ns2d_xy").mesh),
        "pjit_test ShardingInTypesTest.test_device_put_different_dst_mesh",
    ),
    "sharding_under_set_mesh": (
        _x2d,
        lambda: sharding("ns2d_x_partial"),
        lambda: sharding("ns2d_x_partial"),
        lambda: jax.set_mesh(sharding("ns2d_xy").mesh),
        "pjit_test ShardingInTypesTest.test_device_put_under_set_mesh",
    ),
    "shape_dtype_struct": (
        _x2d,
        lambda: _sds("ns2d_yx"),
        lambda: sharding("ns2d_yx"),
        None,
        "array_test test_sds_like / layout_test test_layout_on_sds (device_put itself refuses a SDS)",
    ),
    "shape_dtype_struct_pspec_set_mesh": (
        lambda: source("ns_last4", "float32"),
        lambda: jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=P("x")),
        lambda: P("x"),
        lambda: jax.set_mesh(sharding("ns2d_xy").mesh),
        "pjit_test ArrayPjitTest.test_sds_pspec_input",
    ),
    "shape_dtype_struct_gspmd": (
        _x2d,
        lambda: _sds("gspmd_last4"),
        lambda: sharding("gspmd_last4"),
        None,
        "array_test test_sds_like",
    ),
    "array_as_target": (
        _x2d,
        lambda: _array_target("ns2d_permuted"),
        lambda: sharding("ns2d_permuted"),
        None,
        "array_test test_sds_like (an array's sharding; device_put itself refuses an Array)",
    ),
    "format_none_layout": (
        lambda: source("ns1d_rep", "float32"),
        lambda: Format(None, sharding("ns2d_xy")),
        lambda: Format(None, sharding("ns2d_xy")),
        None,
        "layout_test LayoutTest.test_device_put_non_concrete_layout_error (l3)",
    ),
    "format_none_layout_single": (
        lambda: jnp.arange(16, dtype=jnp.int32).reshape(8, 2),
        lambda: Format(None, sharding("single0")),
        lambda: Format(None, sharding("single0")),
        None,
        "layout_test LayoutTest.test_device_put_non_concrete_layout_error (committed)",
    ),
    "format_default_layout": (
        _x2d,
        lambda: Format(Layout(major_to_minor=(0, 1)), sharding("ns2d_4dev_xy")),
        lambda: Format(Layout(major_to_minor=(0, 1)), sharding("ns2d_4dev_xy")),
        None,
        "layout_test LayoutTest.test_device_put_user_concrete_layout_multi_device",
    ),
    "format_default_layout_other_devices": (
        _x2d,
        lambda: Format(Layout(major_to_minor=(0, 1)), sharding("ns_last4")),
        lambda: sharding("ns_last4"),  # device_put itself fails here (a jit over the source's devices)
        None,
        "layout_test LayoutTest.test_device_put_user_concrete_layout_multi_device (another device set)",
    ),
    "format_default_layout_under_set_mesh": (
        lambda: source("ns2d_xy", "float32"),
        lambda: Format(Layout(major_to_minor=(0, 1)), sharding("ns2d_x_partial")),
        lambda: Format(Layout(major_to_minor=(0, 1)), sharding("ns2d_x_partial")),
        lambda: jax.set_mesh(sharding("ns2d_xy").mesh),
        "layout_test LayoutTest.test_device_put_user_concrete_layout_multi_device (set_mesh)",
    ),
    "format_of_array": (
        lambda: source("ns2d_xy", "float32"),
        lambda: _array_target("ns2d_yx").format,
        lambda: _array_target("ns2d_yx").format,
        None,
        "layout_test LayoutTest.test_device_put_concrete_layout",
    ),
    "memory_space_host": (
        lambda: source("ns2d_xy"),
        lambda: jax.memory.Space.Host,
        lambda: jax.memory.Space.Host,
        None,
        "memories_test DevicePutTest.test_device_put_memory_space",
    ),
    "memory_space_device": (
        lambda: source("ns2d_xy"),
        lambda: jax.memory.Space.Device,
        lambda: jax.memory.Space.Device,
        None,
        "memories_test DevicePutTest.test_device_put_memory_space",
    ),
    "memory_space_device_from_host": (
        lambda: source("ns_first4_pinned"),
        lambda: jax.memory.Space.Device,
        lambda: jax.memory.Space.Device,
        None,
        "memories_test DevicePutTest.test_device_put_host_to_hbm",
    ),
    "with_memory_kind_pinned": (
        lambda: source("single0"),
        lambda: sharding("single0").with_memory_kind("pinned_host"),
        lambda: sharding("single0").with_memory_kind("pinned_host"),
        None,
        "memories_test DevicePutTest.test_device_put_numpy_scalar (pinned_host)",
    ),
    "none_target": (_x2d, lambda: None, lambda: None, None, "api_test APITest.test_device_put_sharding (w = dp(z))"),
}


# A Device or memory-space target a leaf already meets: device_put returns a new array over the same
# buffers, jreshard the leaf itself (as for a sharding it already has); every other property is checked.
_KEPT_AS_IS = {"device_of_source", "memory_space_device"}


@pytest.mark.parametrize("case", list(TARGET_CASES))
def test_transfer_target(case: str) -> None:
    build_x, build_t, build_ref_t, ctx, _origin = TARGET_CASES[case]
    x = build_x()
    with ctx() if ctx else contextlib.nullcontext():
        ref_t, t = build_ref_t(), build_t()
        ref = jax.device_put(x, ref_t)
        res = jreshard.transfer(x, t)
    assert_parity(res, ref, x, identity=case not in _KEPT_AS_IS, target=t)


# --------------------------------------------------------------------------------------------- pytrees


def _tree_x() -> dict[str, Any]:
    """Leaves on different device sets and sharding kinds, committed and not, weak and not."""
    return {
        "a": source("ns_first4", "float32"),
        "b": (source("single5", "int8"), source("gspmd_yx", "bfloat16")),
        "c": jnp.arange(8, dtype=jnp.int32),
        "d": jnp.asarray(4.0),
        "e": _key_source("rbg", "ns1d_x"),
        "f": source("ns2d_4dev_rev", "uint4"),
    }


def _tree_target() -> dict[str, Any]:
    return {
        "a": sharding("ns_last4"),
        "b": (sharding("gspmd_xy"), sharding("ns2d_rep")),
        "c": sharding("ns1d_rev"),
        "d": sharding("single1"),
        "e": sharding("gspmd_tiled8"),
        "f": sharding("ns2d_permuted"),
    }


def _per_leaf(x: Any, t: Any) -> list[Any]:
    return jax.tree_util.tree_structure(x).flatten_up_to(t)


def test_transfer_tree_full() -> None:
    """api_test APITest.test_device_put_sharding_tree, over mixed device sets, sharding kinds and dtypes."""
    x, t = _tree_x(), _tree_target()
    ref = jax.device_put(oracle_input(x), t)
    assert_parity(jreshard.transfer(x, t), ref, x, target=_per_leaf(x, t))


def test_transfer_tree_prefix() -> None:
    """api_test APITest.test_device_put_sharding_tree_prefix: one sharding for a whole subtree."""
    x = {"a": source("ns_first4"), "b": (source("single5"), source("gspmd_yx"), jnp.ones(SHAPE, jnp.int32))}
    t = {"a": sharding("ns2d_xy"), "b": sharding("ns_mid4_cols")}
    ref = jax.device_put(x, t)
    per_leaf = [t["a"], t["b"], t["b"], t["b"]]
    assert_parity(jreshard.transfer(x, t), ref, x, target=per_leaf)


def test_transfer_tree_prefix_tuple() -> None:
    """api_test APITest.test_device_put_sharding_tree_prefix: ``(x, (y, z))`` to ``(s1, s2)`` on a 2x1 mesh."""
    x = (jnp.arange(2), (jnp.arange(2) + 10, jnp.arange(2) + 100))
    mesh = sharding("ns_2x1").mesh
    t = (NamedSharding(mesh, P("x")), NamedSharding(mesh, P("y")))
    ref = jax.device_put(x, t)
    assert_parity(jreshard.transfer(x, t), ref, x)


def test_transfer_tree_none_leaf() -> None:
    """api_test APITest.test_device_put_sharding_tree with a ``None`` target leaf (device_put keeps that leaf)."""
    x = [source("ns2d_xy"), jnp.arange(4)]
    t = [sharding("single1"), None]
    ref = jax.device_put(x, t)
    assert_parity(jreshard.transfer(x, t), ref, x)


def test_transfer_tree_one_sharding() -> None:
    """pjit_test ArrayPjitTest.test_device_put_donate_pytree (without donation): one sharding for a tuple."""
    x = (source("ns_complex_model"), source("ns_complex_model", "float32", shape=(8, 8)))
    t = sharding("ns_complex_q")
    ref = jax.device_put(x, t)
    assert_parity(jreshard.transfer(x, t), ref, x)


def test_transfer_tree_devices_and_formats() -> None:
    """Target leaves of every kind device_put takes in one tree: a Device, a Format, a Sharding, a Space."""
    x = [source("ns2d_xy"), source("ns2d_xy"), source("ns2d_xy"), source("ns2d_xy")]
    t = [devs()[7], Format(None, sharding("ns2d_rep")), sharding("gspmd_rep4"), jax.memory.Space.Device]
    ref = jax.device_put(x, t)
    res = jreshard.transfer(x, t)
    assert_parity(res[:3], ref[:3], x[:3])
    assert_parity(res[3:], ref[3:], x[3:], identity=False)  # a Space it is already in (see _KEPT_AS_IS)


def test_transfer_into_tree_mixed_device_sets() -> None:
    """transfer_into a pytree whose ``into`` leaves live on different device sets and sharding kinds, in place."""
    x = _tree_x()
    targets = _tree_target()
    leaves, treedef = jax.tree_util.tree_flatten(x)
    t_leaves = treedef.flatten_up_to(targets)
    into = []
    for leaf, sh in zip(leaves, t_leaves, strict=True):
        if _is_key(leaf):
            into.append(jax.device_put(keys("rbg", leaf.shape, 9), sh))
        else:
            host = np.asarray(leaf)
            into.append(jax.device_put(jax.device_put(np.ones_like(host), sh), sh, may_alias=False))
    del leaf, t_leaves
    check_into(x, into, treedef)


INTO_KINDS = ["ns1d_x", "ns2d_y_cols_partial", "ns2d_rep", "ns2d_permuted", "single5", "gspmd_yx", "gspmd_rep4"]
INTO_KINDS += ["pmap_out", "ns_reduced_y_sharded_x", "ns_1x2x1_expanded", "ns_complex_q", "ns_first4_pinned"]


@pytest.mark.parametrize("kind", INTO_KINDS)
def test_transfer_into_kind(kind: str) -> None:
    """transfer_into an ``into`` of each sharding kind, from a leaf on another device set."""
    x = source("ns_last4", "float32", seed=4)
    into = [fresh(kind, "float32", seed=5)]
    check_into(x, into, jax.tree_util.tree_structure(0))


def _into_not_handed_over(x: Any, into: jax.Array) -> None:
    """``transfer_into`` over memory jax did not allocate: jax will not hand it over (it cannot tell that
    nothing else reads it), so jreshard writes fresh memory, equal to device_put's, and the report names
    the leaf and the reason; the old ``into`` is not written."""
    from jreshard.report import NotInPlace

    ref = jax.device_put(x, into.sharding)
    old = bits(into)
    res, rep = jreshard.transfer_into(x, into, report=True)
    assert_parity(res, ref, identity=False, target=into.sharding)
    assert rep.not_in_place == ((0, NotInPlace.NOT_HANDED_OVER),)
    assert into.is_deleted() or np.array_equal(bits(into), old)


def test_transfer_into_host_backed_into() -> None:
    """An ``into`` made by device_put from numpy (the CPU backend keeps the numpy memory, no copy)."""
    into = jax.device_put(host_values("int32", SHAPE, 7), sharding("ns1d_x"))
    _into_not_handed_over(source("ns2d_xy", "int32", seed=6), into)


def test_transfer_into_over_a_transfer_result() -> None:
    """An ``into`` that is itself a ``jreshard.transfer`` result (its shards come from jreshard's buffer pool)."""
    into = jreshard.transfer(source("ns_first4", "float32", seed=9), sharding("ns2d_permuted"))
    _into_not_handed_over(source("ns2d_xy", "float32", seed=8), into)


def test_transfer_into_over_a_transfer_into_result() -> None:
    """An ``into`` that is an earlier ``transfer_into`` result (the steady state of a refit loop): in place."""
    into = [fresh("ns2d_yx", "float32", seed=10)]
    first = jreshard.transfer_into(source("ns2d_xy", "float32", seed=11), into.pop())
    into = [first]
    del first
    check_into(source("ns_first4", "float32", seed=12), into, jax.tree_util.tree_structure(0))


def test_transfer_into_x_itself() -> None:
    """``into`` is ``x`` (device_put(x, x.sharding) is x): the values of x, never written over its own buffers."""
    x = source("ns2d_yx", "float32", seed=13)
    host = bits(x)
    res = jreshard.transfer_into(x, x)
    assert_parity(res, jax.device_put(x, x.sharding), identity=False)
    assert np.array_equal(bits(x), host), "x changed"


def test_transfer_into_same_sharding() -> None:
    """transfer_into where x and into share a sharding (device_put(x, into.sharding) is x itself)."""
    x = source("ns2d_xy", "uint16", seed=2)
    into = [fresh("ns2d_xy", "uint16", seed=3)]
    check_into(x, into, jax.tree_util.tree_structure(0))


# ------------------------------------------------------------------------------------------- refusals


def _donated(name: str) -> jax.Array:
    x = source(name, "float32")
    jax.jit(lambda v: v * 2, donate_argnums=0)(x)
    return x


# name: (build x, build target, context, the JAX test); device_put raises, so must jreshard.
REFUSALS: dict[str, tuple[Any, Any, Any, str]] = {
    "indivisible": (
        lambda: jnp.ones((1,)),
        lambda: NamedSharding(sharding("ns_first2_rep").mesh, P("x")),
        None,
        "pjit_test ArrayPjitTest.test_device_put_sharding_nondivisible_sharding_error",
    ),
    "indivisible_in_tuple": (
        lambda: (jnp.ones((2,)), jnp.ones((1,))),
        lambda: NamedSharding(sharding("ns_first2_rep").mesh, P("x")),
        None,
        "pjit_test ArrayPjitTest.test_device_put_sharding_nondivisible_sharding_error",
    ),
    "indivisible_pmap_sharding": (
        lambda: jnp.ones((1,)),
        lambda: jax.pmap(lambda v: v, devices=list(devs()[:2]))(jnp.arange(2)).sharding,
        None,
        "pjit_test ArrayPjitTest.test_device_put_sharding_nondivisible_sharding_error (pmap)",
    ),
    "indivisible_gspmd": (
        lambda: source("single0", shape=(6, 4)),
        lambda: sharding("gspmd_tiled8"),
        None,
        "pjit_test ArrayPjitTest.test_device_put_sharding_nondivisible_sharding_error (GSPMD)",
    ),
    "string_target": (
        lambda: jnp.arange(8),
        lambda: "cpu",
        None,
        "api_test APITest.test_invalid_value_device_put",
    ),
    "pspec_without_mesh": (
        lambda: source("ns1d_x"),
        lambda: P("x"),
        None,
        "pjit_test ShardingInTypesTest.test_device_put_no_set_mesh_error",
    ),
    "pspec_unknown_axis": (
        lambda: source("ns1d_x"),
        lambda: P("z"),
        lambda: jax.set_mesh(sharding("ns2d_xy").mesh),
        "pjit_test ShardingInTypesTest.test_device_put_set_mesh (axis not in the mesh)",
    ),
    "tree_mismatch_same_leaf_count": (
        lambda: (jnp.arange(2), (jnp.arange(2) + 10, jnp.arange(2) + 100)),
        lambda: ((sharding("ns_2x1"), sharding("ns_2x1")), sharding("ns_2x1")),
        None,
        "api_test APITest.test_device_put_sharding_mismatched_tree_same_leaf_count",
    ),
    "tree_mismatch_different_leaf_count": (
        lambda: (jnp.arange(2), jnp.arange(2) + 10, jnp.arange(2) + 100),
        lambda: (sharding("ns_2x1"), sharding("ns_2x1")),
        None,
        "api_test APITest.test_device_put_sharding_mismatched_tree_different_leaf_count",
    ),
    "format_auto_layout": (
        lambda: source("single0", shape=(8, 2)),
        lambda: Format(Layout.AUTO, sharding("single0")),
        None,
        "layout_test LayoutTest.test_device_put_non_concrete_layout_error (l1)",
    ),
    "format_auto_no_sharding": (
        lambda: source("single0", shape=(8, 2)),
        lambda: Format(Layout.AUTO),
        None,
        "layout_test LayoutTest.test_device_put_non_concrete_layout_error (l2)",
    ),
    "format_layout_wrong_rank": (
        lambda: jax.device_put(np.arange(8, dtype=np.int32), devs()[1]),
        lambda: Format(Layout(major_to_minor=(0, 1, 2)), sharding("single0")),
        None,
        "layout_test LayoutTest.test_incompatible_aval_error_device_put",
    ),
    "unreduced_target": (
        lambda: jnp.arange(8.0),
        lambda: NamedSharding(sharding("ns_explicit_x").mesh, P(None, unreduced={"x"})),
        None,
        "array_test JaxArrayTest.test_unreduced_printing (an uncommitted array to unreduced)",
    ),
    "donated_single_device": (
        lambda: _donated("single0"),
        lambda: devs()[-1],
        None,
        "api_test APITest.test_device_put_on_single_device_donated_buffer_fails",
    ),
    "donated_multi_device": (
        lambda: _donated("ns1d_x"),
        lambda: sharding("ns1d_rev"),
        None,
        "api_test APITest.test_device_put_on_multi_device_donated_buffer_fails",
    ),
    "deleted": (
        lambda: (lambda a: (a.delete(), a)[1])(source("ns2d_xy")),
        lambda: sharding("ns2d_yx"),
        None,
        "array_test JaxArrayTest.test_device_put_array_delete",
    ),
}


def _raised(call: Any) -> BaseException | None:
    try:
        out = call()
        jax.block_until_ready(out)
    except Exception as err:
        return err
    return None


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused(case: str) -> None:
    build_x, build_t, ctx, _origin = REFUSALS[case]
    with ctx() if ctx else contextlib.nullcontext():
        jax_err = _raised(lambda: jax.device_put(build_x(), build_t()))
        assert jax_err is not None, "device_put accepted it: the case is wrong"
        ours = _raised(lambda: jreshard.transfer(build_x(), build_t()))
    assert ours is not None, f"jreshard.transfer accepted what device_put refuses ({type(jax_err).__name__}: {jax_err})"


INTO_REFUSALS = {
    "tree_mismatch": (
        lambda: (source("ns2d_xy"), source("ns2d_xy")),
        lambda: [source("ns2d_yx"), source("ns2d_yx")],
        "api_test APITest.test_device_put_sharding_mismatched_tree_same_leaf_count",
    ),
    "donated_source": (
        lambda: _donated("ns1d_x"),
        lambda: source("ns1d_rev", "float32"),
        "api_test APITest.test_device_put_on_multi_device_donated_buffer_fails",
    ),
}


@pytest.mark.parametrize("case", list(INTO_REFUSALS))
def test_into_refused(case: str) -> None:
    """What device_put(x, into.sharding) cannot do, or an ``into`` that is not usable, transfer_into refuses."""
    build_x, build_into, _origin = INTO_REFUSALS[case]
    x, into = build_x(), build_into()
    jax_err = _raised(lambda: jax.device_put(x, jax.tree_util.tree_map(lambda a: a.sharding, into)))
    assert jax_err is not None, "device_put accepted it: the case is wrong"
    ours = _raised(lambda: jreshard.transfer_into(x, into))
    assert ours is not None, f"jreshard.transfer_into accepted what device_put refuses ({type(jax_err).__name__})"


# ------------------------------------------------------------------------------ the comparison itself


def test_comparison_sees_every_property() -> None:
    """``differences`` flags each property alone: a flipped bit, one replica's bits, weak_type, committedness,
    the sharding, the sharding object and identity."""
    host = host_values("float32", SHAPE, 0)
    a = jax.device_put(host, sharding("ns2d_xy"))
    flipped = host.copy()
    flipped.view(np.uint32)[3, 1] ^= 1
    assert differences(jax.device_put(flipped, sharding("ns2d_xy")), a)[0] == "value bits differ"
    rep = sharding("ns_first2_rep")
    parts = [jax.device_put(host, d) for d in rep.mesh.devices.flat]
    odd = [parts[0], jax.device_put(flipped, rep.mesh.devices.flat[1])]
    good = jax.make_array_from_single_device_arrays(SHAPE, rep, parts)
    bad = jax.make_array_from_single_device_arrays(SHAPE, rep, odd)
    assert differences(bad, good) == ["shard value bits differ on device 1"]
    assert differences(jnp.asarray(1.0), jnp.asarray(np.float32(1.0))) == ["weak_type True != False"]
    u = jnp.arange(4)
    assert differences(u, jax.device_put(u, devs()[0])) == ["committed False != True"]
    assert differences(a, jax.device_put(host, sharding("ns2d_yx")))[0].startswith("sharding ")
    other = NamedSharding(sharding("ns2d_xy").mesh, P("x", "y"))
    assert differences(jax.device_put(host, other), a, target=sharding("ns2d_xy")) == [
        "sharding object: device_put returns the target's, the result carries another (equal) one"
    ]
    assert differences(a, jax.device_put(a, sharding("ns2d_xy"), may_alias=False), x=a)[0].startswith("identity")
