"""Random plans between 512 trainer and 512 inference ranks, checked by the numpy reference executor:
every destination exact, every element written once, network bytes equal to the brute-force bound."""

from __future__ import annotations

import numpy as np
import pytest
from _reference import brute_force_lower_bound, check_destinations, execute, network_entries, random_values

import jreshard

N = 512
FACTORS = [(512,), (8, 64), (64, 8), (16, 32), (2, 16, 16)]


def _layout(rng: np.random.Generator, first: int, shape: tuple[int, ...], dtype: str) -> jreshard.Layout:
    mesh_shape = FACTORS[int(rng.integers(len(FACTORS)))]
    names = tuple("abc"[: len(mesh_shape)])
    ranks = np.arange(first, first + N)
    if rng.integers(2):  # any device order, as JAX meshes allow
        ranks = rng.permutation(ranks)
    mesh = ranks.reshape(mesh_shape)
    spec: list = [None] * len(shape)
    for ax, size in zip(names, mesh_shape, strict=True):  # each axis splits a dimension it divides, or replicates
        dims = [d for d in range(len(shape)) if shape[d] % size == 0 and rng.integers(3)]
        if dims:
            d = int(rng.choice(dims))
            used = spec[d] or ()
            block = int(np.prod([dict(zip(names, mesh_shape, strict=True))[a] for a in used])) * size
            if shape[d] % block == 0:
                spec[d] = (*used, ax)
    return jreshard.Layout.from_mesh(mesh, names, tuple(spec), shape, dtype)


@pytest.mark.parametrize("seed", range(8))
def test_random_512_plus_512_rank_plans(seed):
    rng = np.random.default_rng(seed)
    shape = [(1024, 8), (64, 64), (8, 16, 32), (4096,)][seed % 4]
    dtype = ["float32", "bfloat16", "int8", "int32"][seed % 4]
    src, dst = _layout(rng, 0, shape, dtype), _layout(rng, N, shape, dtype)
    domain = int(rng.choice([8, 64, 72]))
    topo = jreshard.Topology.uniform(range(2 * N), domain_size=domain)
    plan = jreshard.plan(src, dst, topo)
    values = random_values(plan, seed)
    check_destinations(plan, values, execute(plan, values))
    s = plan.stats()
    assert s.network_bytes == s.network_bytes_lower_bound == brute_force_lower_bound(src, dst, topo)
    assert max(int(c.max()) for c in network_entries(plan).values()) <= 1
    assert len(set(plan.topology.ranks)) == 2 * N
