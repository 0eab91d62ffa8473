"""Any dtype, any shape (zero-size and scalars included), any pair of shardings: ``transfer``, ``transfer_into``,
a cast on the way and backend ``xla``, weakly typed sources among them, each shard checked against the host
values (and ``weak_type`` kept, as ``jax.device_put`` keeps it).

The oracle is the host array the source was placed from (``jax.device_put`` from the host, then read back, so
a value a dtype cannot hold is what the device holds) indexed by the target sharding's own index map; for a
cast, ``x.astype`` computed by jax and read back. ``jax.device_put`` between devices is not the oracle: it
overruns packed buffers (``tests/test_subbyte_props.py``). This property found the zero-size leaves whose
every shard came back with the global shape (``tests/test_zero_size.py``). ``HYPOTHESIS_PROFILE=deep`` runs it
400 times; the sweep that found those bugs ran it under glibc's checking allocator and
``JRESHARD_CHECK_BOUNDS=1`` (``tests/test_subbyte.py`` runs its own property so, in CI).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jreshard
from tests.parity_cases import DTYPES, host_values

DEVS = np.array(jax.devices())
MESH_SHAPES = {1: [(1,)], 2: [(2,), (1, 2), (2, 1)], 4: [(4,), (2, 2), (1, 4)], 8: [(8,), (2, 4), (4, 2), (2, 2, 2)]}


@st.composite
def shardings(draw, shape: tuple[int, ...]):
    """A sharding of ``shape``: one device, or a mesh over 1, 2, 4 or 8 of the devices (any of them, in any
    order) with each axis splitting a dimension it divides (several axes may split one) or none."""
    k = draw(st.sampled_from([1, 2, 4, 8]))
    ids = draw(st.permutations(range(8)))[:k]
    if k == 1 and draw(st.booleans()):
        return SingleDeviceSharding(DEVS[ids[0]])
    mesh_shape = draw(st.sampled_from(MESH_SHAPES[k]))
    names = tuple("abc"[: len(mesh_shape)])
    mesh = Mesh(DEVS[list(ids)].reshape(mesh_shape), names)
    spec: list = [None] * len(shape)
    for axis in names:
        if not shape or not draw(st.booleans()):
            continue
        d = draw(st.integers(0, len(shape) - 1))
        axes = () if spec[d] is None else (spec[d] if isinstance(spec[d], tuple) else (spec[d],))
        if shape[d] % (int(np.prod([mesh.shape[a] for a in axes])) * mesh.shape[axis]):
            continue
        spec[d] = (*axes, axis) if axes else axis
    return NamedSharding(mesh, P(*spec))


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 4, 6, 8]), max_size=4)))
    return dtype, shape, draw(shardings(shape)), draw(shardings(shape))


def _bytes(a) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def _check(out, host: np.ndarray, target, dtype) -> None:
    shape = host.shape
    assert out.shape == shape and out.dtype == dtype
    assert out.sharding.is_equivalent_to(target, len(shape))
    index = target.addressable_devices_indices_map(shape)
    assert {s.device for s in out.addressable_shards} == set(index)
    for s in out.addressable_shards:
        want = host[index[s.device]] if shape else host
        got = np.asarray(s.data)
        assert got.shape == np.shape(want), (s.device, got.shape, np.shape(want))
        assert _bytes(got) == _bytes(want), s.device


WEAK = {"float32": 1.5, "int32": 3, "complex64": 2j, "bool": True}  # a Python scalar broadcast: weakly typed


@settings(max_examples=120, deadline=None)
@given(
    cases(),
    st.sampled_from(["transfer", "transfer_into", "cast"]),
    st.sampled_from(DTYPES),
    st.integers(0, 9),
    st.booleans(),
)
def test_every_dtype_shape_and_sharding_pair_lands_as_the_host_values(case, mode, to, draw_xla, weak):
    dtype, shape, src, dst = case
    if weak and dtype in WEAK:
        x = jax.device_put(jnp.broadcast_to(WEAK[dtype], shape), src)
    else:
        x = jax.device_put(host_values(dtype, shape, seed=len(shape)), src)
    host = np.asarray(x)  # what the devices hold (a value the dtype cannot hold, as jax stored it)
    options = jreshard.Options(backend="xla") if draw_xla == 0 else None  # a tenth of the cases: compiling is slow
    if mode == "transfer":
        out = jreshard.transfer(x, dst, options=options)
        _check(out, host, dst, x.dtype)
        assert out.weak_type == x.weak_type  # as jax.device_put keeps it
    elif mode == "transfer_into":
        per = dst.shard_shape(shape)
        into = jax.make_array_from_single_device_arrays(
            shape, dst, [jax.device_put(np.zeros(per, x.dtype), d) for d in dst.addressable_devices_indices_map(shape)]
        )
        out = jreshard.transfer_into(x, into, options=options)
        _check(out, host, dst, x.dtype)
        assert out.weak_type == x.weak_type
    else:
        # Casts jax warns about (complex to real; 64-bit without x64, truncated) are refused by the suite's
        # warnings-as-errors; jreshard's cast is jax's there too.
        assume(not (np.dtype(x.dtype).kind == "c" and jnp.dtype(to).kind != "c"))
        assume(jax.config.jax_enable_x64 or to not in ("int64", "uint64", "float64", "complex128"))
        to_dtype = jnp.dtype(to)
        cast = np.asarray(x.astype(to_dtype))  # jax's cast, read back: the oracle
        target = jax.ShapeDtypeStruct(shape, to_dtype, sharding=dst)
        _check(jreshard.transfer(x, target, options=options), cast, dst, cast.dtype)
