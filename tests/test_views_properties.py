"""Property tests of views: random compositions over random shardings equal jnp on full arrays, bit for bit,
and the network bytes of their lowering equal the brute-force lower bound in the wire dtype."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard import Layout, Topology, views
from jreshard.engine import viewcopy
from jreshard.views import native
from jreshard.views.bounds import box_network_bound, brute_force_network_bound
from jreshard.views.casts import CAST_DTYPES
from jreshard.views.lowering import lower_tree

DEVS = np.array(jax.devices())


@st.composite
def shardings(draw, shape):
    """A NamedSharding of ``shape`` over a random subset and order of the 8 devices."""
    n = draw(st.sampled_from([1, 2, 4, 8]))
    devs = draw(st.permutations(list(range(8))))[:n]
    sizes = draw(st.sampled_from([s for s in [(n,), (2, n // 2), (n // 2, 2)] if math.prod(s) == n and min(s) >= 1]))
    names = tuple(f"m{i}" for i in range(len(sizes)))
    mesh = Mesh(DEVS[list(devs)].reshape(sizes), names)
    spec, free = [], list(zip(names, sizes, strict=True))
    for dim in shape:
        fits = [(a, s) for a, s in free if dim % s == 0]
        pick = draw(st.sampled_from([None, *fits])) if fits else None
        if pick is not None:
            free.remove(pick)
        spec.append(None if pick is None else pick[0])
    return NamedSharding(mesh, P(*spec))


def _grouped(xs, axis, groups):
    return jnp.concatenate([jnp.split(x, groups, axis=axis)[i] for i in range(groups) for x in xs], axis=axis)


def _reshapes(shape):
    """Shapes of as many elements: two neighbouring axes merged, one axis split in two, all flattened."""
    out = [(math.prod(shape),)]
    for d in range(len(shape) - 1):
        out.append((*shape[:d], shape[d] * shape[d + 1], *shape[d + 2 :]))
    for d, n in enumerate(shape):
        out += [(*shape[:d], f, n // f, *shape[d + 1 :]) for f in (2, 4) if n % f == 0 and n > f]
    return out


@st.composite
def compositions(draw):
    """(view, jnp value) pairs built by the same random recipe, with the source arrays."""
    shape = draw(st.sampled_from([(4, 8), (8, 4), (2, 4, 4), (8,)]))
    n_src = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    nodes = []
    for _ in range(n_src):
        dtype = draw(st.sampled_from(CAST_DTYPES))
        full = jnp.asarray((rng.standard_normal(shape) * 8).astype(np.float32)).astype(dtype)
        arr = jax.device_put(full, draw(shardings(shape)))
        nodes.append((views.as_view(arr), full))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["cast", "concat", "stack", "slice", "transpose", "unstack", "reshape"]))
        v, x = nodes[-1]
        if op == "cast":
            d = draw(st.sampled_from(CAST_DTYPES))
            nodes.append((views.astype(v, d), x.astype(d)))
        elif op == "transpose" and v.ndim > 1:
            perm = draw(st.permutations(list(range(v.ndim))))
            nodes.append((views.transpose(v, perm), jnp.transpose(x, perm)))
        elif op == "reshape" and v.ndim:
            shape = draw(st.sampled_from(_reshapes(v.shape)))
            nodes.append((views.reshape(v, shape), jnp.reshape(x, shape)))
        elif op == "slice" and v.shape[0] > 1:
            a = draw(st.integers(0, v.shape[0] - 1))
            if draw(st.booleans()) or v.ndim == 1:
                b = draw(st.integers(a + 1, v.shape[0]))
                nodes.append((v[a:b], x[a:b]))
            else:
                nodes.append((v[a], x[a]))
        elif op == "unstack" and v.ndim > 1:
            axis = draw(st.integers(0, v.ndim - 1))
            i = draw(st.integers(0, v.shape[axis] - 1))
            nodes.append((views.unstack(v, axis)[i], jnp.take(x, i, axis=axis)))
        elif op in ("concat", "stack"):
            same = [(w, y) for w, y in nodes if w.shape == v.shape]
            picks = draw(st.lists(st.sampled_from(range(len(same))), min_size=1, max_size=3))
            parts = [(views.astype(same[k][0], v.dtype), same[k][1].astype(v.dtype)) for k in picks]
            if op == "stack":
                axis = draw(st.integers(0, v.ndim))
                nodes.append((views.stack([p for p, _ in parts], axis), jnp.stack([y for _, y in parts], axis)))
            elif v.ndim:
                axis = draw(st.integers(0, v.ndim - 1))
                groups = draw(st.sampled_from([g for g in (1, 2, 4) if v.shape[axis] % g == 0]))
                nodes.append(
                    (views.concat([p for p, _ in parts], axis, groups), _grouped([y for _, y in parts], axis, groups))
                )
    return nodes[-1]


def _bits(a):
    a = np.asarray(a)
    return a.view(f"uint{8 * a.dtype.itemsize}")


@settings(max_examples=50)
@given(st.data())
def test_random_compositions_equal_jnp_then_device_put(data):
    view, expect = data.draw(compositions())
    dst = data.draw(shardings(view.shape))
    domain = data.draw(st.sampled_from([1, 2, 4, 8]))
    topo = Topology.uniform(range(8), domain_size=domain)
    # Narrowing casts run in bands of the source shard: tiny bands cut pieces on every axis.
    band = data.draw(st.sampled_from([None, 1, 6, 40]))
    # The compiled casts where they are built, or numpy's alone.
    kernels = (native.KERNELS, native.SCATTER) if data.draw(st.booleans()) else ({}, {})
    saved, block_bytes = (native.KERNELS, native.SCATTER), viewcopy.BLOCK_BYTES
    try:
        native.KERNELS, native.SCATTER = kernels
        if band is not None:
            viewcopy.BLOCK_BYTES = band
        jreshard.clear_caches()
        out = views.transfer({"w": view}, {"w": dst}, topology=topo)["w"]
    finally:
        viewcopy.BLOCK_BYTES = block_bytes
        native.KERNELS, native.SCATTER = saved
        jreshard.clear_caches()
    ref = jax.device_put(expect, dst)
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.sharding == dst
    got = {s.device: _bits(s.data) for s in out.addressable_shards}
    for s in ref.addressable_shards:
        np.testing.assert_array_equal(got[s.device], _bits(s.data))
    # The bytes: the lowering's network bytes equal the brute-force bound, in the wire dtype.
    leaves = view.leaves()
    layouts = [Layout.from_sharding(leaf.source.sharding, leaf.shape, leaf.dtype) for leaf in leaves]
    dst_lay = Layout.from_sharding(dst, view.shape, view.dtype)
    (low,) = lower_tree([view], leaves, layouts, [dst_lay], topo)
    assert low.network_bytes == brute_force_network_bound([view], leaves, layouts, [dst_lay], topo)
    assert low.network_bytes == box_network_bound(view, leaves, layouts, dst_lay, topo)
    # Every destination element is written by exactly one piece.
    cover = {r: np.zeros(b.shape, np.int32) for r, b in zip(dst_lay.ranks, dst_lay.boxes, strict=True)}
    for p in low.pieces:
        cover[p.dst_rank][p.dst_box.slices()] += 1
    assert all((c == 1).all() for c in cover.values())


@settings(max_examples=25)
@given(st.data())
def test_random_block_fp8_equals_the_numpy_reference(data):
    shape = data.draw(st.sampled_from([(8, 12), (2, 8, 16), (16, 8)]))
    dtype = data.draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    block = (data.draw(st.sampled_from([1, 2, 3, 4, 8])), data.draw(st.sampled_from([2, 4, 5, 8])))
    x = jax.device_put(
        jnp.asarray(np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 5).astype(dtype),
        data.draw(shardings(shape)),
    )
    w, s = views.quantize_fp8(views.transpose(x, (*range(len(shape) - 2), len(shape) - 1, len(shape) - 2)), block)
    dw, ds = data.draw(shardings(w.shape)), data.draw(shardings(s.shape))
    out = views.transfer({"w": w, "s": s}, {"w": dw, "s": ds})
    ref_w, ref_s = views.quantize_fp8_reference(np.swapaxes(np.asarray(x), -1, -2), block)
    for got, ref, sh in ((out["w"], ref_w, dw), (out["s"], ref_s, ds)):
        want = {d: _bits(np.asarray(ref)[idx]) for d, idx in sh.addressable_devices_indices_map(ref.shape).items()}
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(_bits(shard.data), want[shard.device])
