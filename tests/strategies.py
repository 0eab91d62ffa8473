"""Hypothesis strategies over meshes, specs, shapes, rank sets and topologies."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Topology

DTYPES = ["float32", "bfloat16", "float16", "int8", "int32", "bool", "uint8", "float64"]


def factorizations(n: int, max_axes: int = 3) -> list[tuple[int, ...]]:
    """Ordered factorizations of n into at most max_axes factors (1s allowed once)."""
    out: list[tuple[int, ...]] = [(n,)]
    if max_axes > 1:
        for f in range(1, n + 1):
            if n % f == 0:
                out += [(f, *rest) for rest in factorizations(n // f, max_axes - 1)]
    return sorted(set(out))


@st.composite
def box_in(draw, shape: tuple[int, ...]) -> Box:
    """A non-empty box inside ``shape`` (every extent at least 1)."""
    lo, hi = [], []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        lo.append(a)
        hi.append(draw(st.integers(a + 1, n)))
    return Box(tuple(lo), tuple(hi))


@st.composite
def mesh_layout(draw, ranks: list[int], ndim: int, mults: list[int], dtype: str) -> Layout:
    """A structured layout of a tensor over ``ranks`` with a random mesh and spec.

    The shape of each dimension is the product of the mesh axes that split it
    times ``mults[d]``; it is returned through Layout.shape.
    """
    shape_axes = draw(st.sampled_from(factorizations(len(ranks))))
    names = tuple(f"a{i}" for i in range(len(shape_axes)))
    order = draw(st.permutations(ranks))
    mesh = np.array(order).reshape(shape_axes)
    free = list(names)
    spec = []
    for _ in range(ndim):
        k = draw(st.integers(0, min(2, len(free))))
        axes = tuple(draw(st.permutations(free))[:k])
        free = [a for a in free if a not in axes]
        spec.append(axes if len(axes) != 1 else axes[0])
    return mesh, names, tuple(spec)


def shape_for(meshes: list[tuple], ndim: int, mults: list[int]) -> tuple[int, ...]:
    shape = []
    for d in range(ndim):
        need = 1
        for mesh, names, spec in meshes:
            entry = spec[d]
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            sizes = dict(zip(names, mesh.shape, strict=True))
            need = math.lcm(need, math.prod(sizes[a] for a in axes))
        shape.append(need * mults[d])
    return tuple(shape)


@st.composite
def plan_case(draw, max_ranks: int = 16):
    """(src, dst, topology, options-kwargs): random layouts over overlapping or
    disjoint rank sets of a pool of up to ``max_ranks``, random domains and colocation."""
    pool = max_ranks
    n_src = draw(st.integers(1, 8))
    n_dst = draw(st.integers(1, 8))
    mode = draw(st.sampled_from(["disjoint", "disjoint", "same", "overlap"]))
    if mode == "disjoint":
        src_ranks = list(range(n_src))
        dst_ranks = list(range(pool - n_dst, pool))
    elif mode == "same":
        src_ranks = dst_ranks = list(range(n_src))
    else:
        src_ranks = draw(st.lists(st.integers(0, pool - 1), min_size=n_src, max_size=n_src, unique=True))
        dst_ranks = draw(st.lists(st.integers(0, pool - 1), min_size=n_dst, max_size=n_dst, unique=True))
    ndim = draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(DTYPES))
    mults = [draw(st.integers(1, 3)) for _ in range(ndim)]
    s_mesh = draw(mesh_layout(src_ranks, ndim, mults, dtype))
    d_mesh = draw(mesh_layout(dst_ranks, ndim, mults, dtype))
    shape = shape_for([s_mesh, d_mesh], ndim, mults)
    src = Layout.from_mesh(*s_mesh, shape, dtype)
    dst = Layout.from_mesh(*d_mesh, shape, dtype)
    all_ranks = sorted(set(src_ranks) | set(dst_ranks))
    if draw(st.booleans()):
        n_domains = draw(st.integers(1, 6))
        domains = {r: draw(st.integers(0, n_domains - 1)) for r in all_ranks}
    else:  # consecutive blocks, as on real clusters
        size = draw(st.sampled_from([1, 2, 4]))
        domains = {r: r // size for r in all_ranks}
    devices = {r: r for r in all_ranks}
    # Colocate some destination ranks with a source rank of their domain (a shared device).
    if draw(st.booleans()):
        for r in dst_ranks:
            if r in src_ranks:
                continue
            peers = [s for s in src_ranks if domains[s] == domains[r] and s not in dst_ranks]
            if peers and draw(st.booleans()):
                devices[r] = devices[draw(st.sampled_from(peers))]
    topo = Topology.from_domains(domains, devices=devices)
    opts = {"relays": draw(st.booleans()), "min_stripe_bytes": draw(st.sampled_from([0, 1, 16, 1 << 16]))}
    return src, dst, topo, opts


@st.composite
def overlap_case(draw, max_ranks: int = 12):
    """(src, dst, topology, options-kwargs) whose destination boxes overlap inside domains.

    The source is a mesh layout (any spec, so it may be replicated or split); every
    destination rank holds a random box, and boxes of one domain often overlap. Some
    destination ranks share a device with one another, some with a source rank.
    """
    ndim = draw(st.integers(1, 2))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    dtype = draw(st.sampled_from(["float32", "int8", "float64"]))
    n_src = draw(st.integers(1, 4))
    src_ranks = list(range(n_src))
    mesh, names, spec = draw(mesh_layout(src_ranks, ndim, [1] * ndim, dtype))
    sizes = dict(zip(names, mesh.shape, strict=True))
    # Keep only the splits that divide the drawn shape (else replicate that dimension).
    fixed = []
    for d, e in enumerate(spec):
        axes = () if e is None else (e,) if isinstance(e, str) else e
        fixed.append(e if shape[d] % math.prod(sizes[a] for a in axes) == 0 else None)
    src = Layout.from_mesh(mesh, names, tuple(fixed), shape, dtype)
    n_dst = draw(st.integers(1, max_ranks - n_src))
    dst_ranks = list(range(n_src, n_src + n_dst))
    boxes = {}
    for r in dst_ranks:
        boxes[r] = draw(box_in(shape))
    dst = Layout.from_boxes(shape, dtype, boxes)
    n_domains = draw(st.integers(1, 3))
    domains = {r: draw(st.integers(0, n_domains - 1)) for r in src_ranks + dst_ranks}
    devices = {r: r for r in domains}
    for r in dst_ranks:  # share a device with a rank of the same domain, sometimes
        peers = [q for q in domains if q < r and domains[q] == domains[r]]
        if peers and draw(st.integers(0, 3)) == 0:
            devices[r] = devices[draw(st.sampled_from(peers))]
    topo = Topology.from_domains(domains, devices=devices)
    opts = {"relays": draw(st.booleans()), "min_stripe_bytes": draw(st.sampled_from([0, 1, 16]))}
    return src, dst, topo, opts


def byte_shape(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """A C-ordered tensor's shape seen as bytes: the last extent times ``itemsize`` (rank 0: ``(itemsize,)``)."""
    shape = tuple(int(n) for n in shape)
    return (*shape[:-1], shape[-1] * itemsize) if shape else (itemsize,)
