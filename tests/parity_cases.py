"""Case tables for ``test_parity.py``: the shardings, dtypes, sources and targets that ``jax.device_put``
is tested with in JAX's own test suite (jax-v0.10.2: tests/array_test.py, pjit_test.py, api_test.py,
layout_test.py, memories_test.py), re-expressed as names that the tests build on 8 CPU devices.

Every sharding is built on first use (``sharding(name)``) and cached, so that equal names give the same
object. Shapes are tiny: the 2-D cases are ``SHAPE = (8, 4)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax._src.sharding_impls import GSPMDSharding
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

SHAPE = (8, 4)
X64 = bool(jax.config.jax_enable_x64)  # the suite's setting (off by default: 64-bit values become 32-bit)
WIDE = ["int64", "uint64", "float64", "complex128"]


def devs() -> np.ndarray:
    return np.array(jax.devices())


def _mesh(devices: Any, shape: tuple[int, ...], names: tuple[str, ...], explicit: bool = False) -> Mesh:
    types = (AxisType.Explicit,) * len(names) if explicit else None
    arr = np.asarray(devices).reshape(shape)
    return Mesh(arr, names, axis_types=types) if types else Mesh(arr, names)


def _gspmd_like(named: NamedSharding, ndim: int) -> GSPMDSharding:
    return GSPMDSharding(tuple(named.mesh.devices.flat), named._to_xla_hlo_sharding(ndim))


def _pmap_sharding() -> Any:
    # jax 0.10.2 has no PmapSharding: a pmap output's sharding is a NamedSharding over the pmap axis.
    return jax.pmap(lambda v: v)(jnp.zeros((8, 4), jnp.int32)).sharding


def _complex_meshes() -> tuple[Mesh, Mesh]:
    """The two meshes of pjit_test ``test_device_put_efficient_reshard_complex_mesh``."""
    d = devs()
    m1 = Mesh(d.reshape(1, 2, 2, 2), ("replica", "data", "seq", "model"))
    m2 = Mesh(d.reshape(1, 1, 2, 2, 2, 1).swapaxes(2, 3).reshape(1, 1, 4, 2, 1), ("r", "d", "q", "kv", "o"))
    return m1, m2


_BUILDERS: dict[str, Callable[[], Any]] = {
    # 1-D meshes
    "ns1d_x": lambda: NamedSharding(_mesh(devs(), (8,), ("x",)), P("x")),
    "ns1d_rep": lambda: NamedSharding(_mesh(devs(), (8,), ("x",)), P()),
    "ns1d_rev": lambda: NamedSharding(_mesh(devs()[::-1], (8,), ("x",)), P("x")),
    "ns_first4": lambda: NamedSharding(_mesh(devs()[:4], (4,), ("x",)), P("x")),
    "ns_last4": lambda: NamedSharding(_mesh(devs()[4:], (4,), ("x",)), P("x")),
    "ns_mid4_cols": lambda: NamedSharding(_mesh(devs()[2:6], (4,), ("x",)), P(None, "x")),
    "ns_first2_rep": lambda: NamedSharding(_mesh(devs()[:2], (2,), ("x",)), P()),
    # 2-D meshes
    "ns2d_xy": lambda: NamedSharding(_mesh(devs(), (2, 4), ("x", "y")), P("x", "y")),
    "ns2d_yx": lambda: NamedSharding(_mesh(devs(), (2, 4), ("x", "y")), P("y", "x")),
    "ns2d_x_partial": lambda: NamedSharding(_mesh(devs(), (2, 4), ("x", "y")), P("x")),
    "ns2d_y_cols_partial": lambda: NamedSharding(_mesh(devs(), (2, 4), ("x", "y")), P(None, "y")),
    "ns2d_xy_on_dim0": lambda: NamedSharding(_mesh(devs(), (2, 4), ("x", "y")), P(("x", "y"), None)),
    "ns2d_yx_on_dim0": lambda: NamedSharding(_mesh(devs(), (2, 4), ("x", "y")), P(("y", "x"))),
    "ns2d_rep": lambda: NamedSharding(_mesh(devs(), (2, 4), ("x", "y")), P()),
    "ns2d_rev_devices": lambda: NamedSharding(_mesh(devs()[::-1], (2, 4), ("x", "y")), P("x", "y")),
    "ns2d_permuted": lambda: NamedSharding(_mesh(devs()[[3, 1, 0, 2, 7, 5, 4, 6]], (4, 2), ("a", "b")), P("a", "b")),
    "ns2d_4dev_rev": lambda: NamedSharding(_mesh(devs()[[3, 2, 1, 0]], (2, 2), ("x", "y")), P("x")),
    "ns2d_4dev_xy": lambda: NamedSharding(_mesh(devs()[:4], (2, 2), ("x", "y")), P("x", "y")),
    "ns_2x1": lambda: NamedSharding(_mesh(devs()[:2], (2, 1), ("x", "y")), P("x", None)),
    "ns_1x2x1_expanded": lambda: NamedSharding(_mesh(devs()[:2], (1, 2, 1), ("replicas", "x", "y")), P("x", None)),
    "ns_complex_model": lambda: NamedSharding(_complex_meshes()[0], P("model")),
    "ns_complex_q": lambda: NamedSharding(_complex_meshes()[1], P("q")),
    "ns_complex_rep": lambda: NamedSharding(_complex_meshes()[1], P()),
    "ns_explicit_x": lambda: NamedSharding(_mesh(devs()[:2], (2,), ("x",), explicit=True), P("x")),
    # reduced axes (jax 0.10.2: Explicit mesh axes only; unreduced is refused by device_put)
    "ns_reduced_x": lambda: NamedSharding(_mesh(devs()[:2], (2,), ("x",), explicit=True), P(None, reduced={"x"})),
    "ns_reduced_scalar": lambda: NamedSharding(_mesh(devs()[:2], (2,), ("x",), explicit=True), P(reduced={"x"})),
    "ns_unreduced_x": lambda: NamedSharding(_mesh(devs()[:2], (2,), ("x",), explicit=True), P(None, unreduced={"x"})),
    "ns_reduced_y_sharded_x": lambda: NamedSharding(
        _mesh(devs()[4:], (2, 2), ("x", "y"), explicit=True), P("x", reduced={"y"})
    ),
    # memory kinds
    "ns_first4_pinned": lambda: NamedSharding(_mesh(devs()[:4], (4,), ("x",)), P("x"), memory_kind="pinned_host"),
    "ns_last4_unpinned": lambda: NamedSharding(_mesh(devs()[4:], (4,), ("x",)), P("x"), memory_kind="unpinned_host"),
    "single0_pinned": lambda: SingleDeviceSharding(devs()[0], memory_kind="pinned_host"),
    # single devices
    "single0": lambda: SingleDeviceSharding(devs()[0]),
    "single1": lambda: SingleDeviceSharding(devs()[1]),
    "single5": lambda: SingleDeviceSharding(devs()[5]),
    # GSPMDSharding
    "gspmd_yx": lambda: _gspmd_like(sharding("ns2d_yx"), 2),
    "gspmd_xy": lambda: _gspmd_like(sharding("ns2d_xy"), 2),
    "gspmd_last4": lambda: _gspmd_like(sharding("ns_last4"), 2),
    "gspmd_rep4": lambda: GSPMDSharding.get_replicated(tuple(devs()[:4])),
    "gspmd_tiled8": lambda: _gspmd_like(sharding("ns1d_x"), 2),
    # a pmap output's sharding (the PmapSharding of older jax)
    "pmap_out": _pmap_sharding,
}

SHARDING_NAMES = tuple(_BUILDERS)


@functools.cache
def sharding(name: str) -> Any:
    return _BUILDERS[name]()


# (source, target) pairs: each names the JAX test it re-expresses.
PAIRS: list[tuple[str, str, str]] = [
    ("ns1d_rep", "ns1d_x", "api_test APITest.test_device_put_sharding"),
    ("ns1d_x", "ns1d_x", "api_test APITest.test_device_put_sharding (same sharding: device_put returns x)"),
    ("ns1d_x", "single0", "api_test APITest.test_device_put_sharding (to one device)"),
    ("ns1d_x", "ns1d_rev", "api_test APITest.test_device_put_on_multi_device_donated_buffer_fails (reversed mesh)"),
    ("ns2d_x_partial", "ns2d_xy", "pjit_test ArrayPjitTest.test_device_put_on_different_sharding"),
    ("ns2d_xy", "ns2d_x_partial", "pjit_test ShardingInTypesTest.test_device_put_under_set_mesh"),
    ("ns2d_xy", "ns2d_yx", "pjit_test ArrayPjitTest.test_device_put_on_different_sharding (transposed)"),
    ("ns2d_xy", "ns2d_y_cols_partial", "pjit_test ShardingInTypesTest.test_sharded_unreduced_roundtrip (specs)"),
    ("ns2d_y_cols_partial", "ns2d_xy_on_dim0", "pjit_test ShardingInTypesTest.test_sharded_unreduced_roundtrip"),
    ("ns2d_xy_on_dim0", "ns2d_yx_on_dim0", "pjit_test ShardingInTypesTest.test_reshape_split_one_dim_multi_axes"),
    ("ns2d_rep", "ns2d_xy", "pjit_test ShardingInTypesTest.test_fully_replicated_array_mul"),
    ("ns2d_xy", "ns2d_rep", "pjit_test ArrayPjitTest.test_device_put_efficient_reshard_complex_mesh (to P())"),
    ("ns2d_xy", "ns2d_rev_devices", "pjit_test ArrayPjitTest.test_wsc_eager_different_order_devices"),
    ("ns2d_xy", "ns2d_permuted", "pjit_test ShardingInTypesTest.test_device_put_different_dst_mesh"),
    ("ns2d_4dev_xy", "ns2d_4dev_rev", "pjit_test ArrayPjitTest.test_device_put_efficient_reshard_single_host"),
    ("ns_first4", "ns_last4", "pjit_test ArrayPjitTest.test_mpmd_device_put_fast_path (disjoint devices)"),
    ("ns_first4", "ns_mid4_cols", "array_test JaxArrayTest.test_device_put_to_cpu (overlapping devices)"),
    ("ns_first2_rep", "ns2d_xy", "pjit_test ArrayPjitTest.test_different_named_sharding_object_replicated"),
    ("ns_complex_model", "ns_complex_rep", "pjit_test ArrayPjitTest.test_device_put_efficient_reshard_complex_mesh"),
    ("ns_complex_q", "ns_complex_model", "pjit_test ArrayPjitTest.test_device_put_efficient_reshard_complex_mesh"),
    ("ns_complex_model", "ns_complex_q", "pjit_test ArrayPjitTest.test_device_put_donate_pytree"),
    ("ns_2x1", "ns_1x2x1_expanded", "api_test JitTest.test_device_put_aliasing_with_diff_compatible_sharding"),
    ("single0", "single1", "api_test APITest.test_device_put_across_devices"),
    ("single0", "single0", "api_test JitTest.test_device_put_aliasing (same device)"),
    ("single5", "ns2d_xy", "pjit_test ArrayPjitTest.test_cpu_bfloat16_to_tpu"),
    ("ns2d_xy", "gspmd_yx", "pjit_test ArrayPjitTest.test_device_put_sharding_prng (GSPMDSharding)"),
    ("gspmd_yx", "ns2d_yx", "pjit_test ArrayPjitTest.test_to_gspmd_sharding_cache_with_and_without_device"),
    ("gspmd_xy", "gspmd_last4", "pjit_test ArrayPjitTest.test_device_put_sharding_prng (GSPMDSharding)"),
    ("gspmd_rep4", "gspmd_tiled8", "pjit_test ArrayPjitTest.test_device_put_sharding_prng (GSPMDSharding)"),
    ("pmap_out", "ns2d_xy", "pjit_test ArrayPjitTest.test_device_put_sharding_prng (pmap output)"),
    ("ns2d_xy", "pmap_out", "pjit_test ArrayPjitTest.test_device_put_sharding_prng (to a pmap sharding)"),
    ("ns_explicit_x", "ns_reduced_x", "array_test JaxArrayTest.test_unreduced_printing (reduced={'x'})"),
    ("ns_reduced_x", "ns2d_xy", "pjit_test ShardingInTypesTest.test_reduced_reshard_unreduced_bwd"),
    ("ns2d_xy", "ns_reduced_y_sharded_x", "pjit_test ShardingInTypesTest.test_one_input_sharded_another_reduced"),
    ("ns_first4", "ns_first4_pinned", "memories_test DevicePutTest.test_device_put_hbm_to_host"),
    ("ns_first4_pinned", "ns_last4", "memories_test DevicePutTest.test_device_put_host_to_hbm"),
    ("ns2d_xy", "ns_last4_unpinned", "memories_test DevicePutTest.test_device_put_hbm_to_host (unpinned_host)"),
    ("single0_pinned", "single1", "memories_test DevicePutTest.test_device_put_different_device_and_memory"),
]

# A few pairs every dtype moves over: resharded across device sets, a single device to a partial replication.
DTYPE_PAIRS: list[tuple[str, str]] = [("ns2d_xy", "ns_last4"), ("single0", "ns2d_y_cols_partial")]

_DTYPE_NAMES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e8m0fnu",
    "int4",
    "uint4",
    "int2",
    "uint2",
    "float4_e2m1fn",
]
DTYPES = [n for n in _DTYPE_NAMES if hasattr(jnp, n)]
SUB_BYTE = {"int4": (-8, 8), "uint4": (0, 16), "int2": (-2, 2), "uint2": (0, 4)}
KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


def host_values(dtype_name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Host values of ``dtype_name`` with every bit pattern the dtype can hold (NaNs included); 64-bit types
    without x64 get small values (device_put narrows them to 32 bits without an overflow warning)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    dt = np.dtype(getattr(jnp, dtype_name))
    if dtype_name == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype_name in SUB_BYTE:
        lo, hi = SUB_BYTE[dtype_name]
        return rng.integers(lo, hi, size=shape).astype(dt)
    if dtype_name == "float4_e2m1fn":
        return rng.integers(0, 16, size=shape).astype(np.uint8).view(ml_dtypes.float4_e2m1fn)
    if dt.itemsize >= 8 and not jax.config.jax_enable_x64:  # read at the call: jax.enable_x64 may be on
        base = rng.integers(-1000, 1000, size=shape)
        if dt.kind in "fc":
            return (base / 8).astype(dt) + (1j * (base / 4) if dt.kind == "c" else 0)
        return (base if dt.kind == "i" else base % 1000).astype(dt)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def keys(impl: str, shape: tuple[int, ...], seed: int) -> jax.Array:
    """Typed PRNG keys of ``impl`` (uncommitted, on the default device)."""
    return jax.random.split(jax.random.key(seed, impl=impl), int(np.prod(shape))).reshape(shape)
