"""Elastic refits of random trees inside one process (8 CPU devices: the trainer on 0-3, a replica on 4-7, the
control over authenticated loopback, the bytes NIXL WRITEs of this process's agent to itself): every dtype jax
holds that a refit moves, shapes of rank 0-3 with sizes of 0, each side's own random sharding (one device, or a
mesh over 1, 2 or 4 of its devices in any order), some float leaves cast on the replica, small and large chunks,
``verify``, and versions that change a tenth of their elements (deltas); some leaves declared weakly typed.
Every shard of every version is checked against the host values (a cast: against jax's ``astype``), and each
array's ``weak_type`` against the replica's declaration."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest
from random_trees import CASTS, REFIT_DTYPES, mismatches
from random_trees import dtype as _dtype
from random_trees import sharding as _sharding
from random_trees import values as _values

from jreshard import Options
from jreshard.elastic import ElasticReplica, ElasticTrainer

pytestmark = pytest.mark.timeout(120)
D = np.array(jax.devices())
KEY = b"elastic-random-key-0123456789ab"
FLAGS = ["", "cast", "delta cast", "verify delta"]


@pytest.mark.parametrize(("seed", "flags"), [(seed, FLAGS[seed % 4]) for seed in range(12)])
def test_an_elastic_refit_of_random_leaves(seed, flags):
    r = random.Random(seed)
    delta, cast = "delta" in flags, "cast" in flags
    leaves = {}
    for i in range(r.randint(4, 8)):
        shape = tuple(r.choice([0, 1, 2, 3, 4, 6, 8, 16]) for _ in range(r.randint(0, 3)))
        dtype = r.choice(REFIT_DTYPES)
        wire = r.choice(CASTS) if cast and _dtype(dtype).kind == "f" and r.random() < 0.5 else dtype
        leaves[f"l{i}"] = (shape, dtype, wire, _sharding(r, D[:4], shape), _sharding(r, D[4:], shape))

    def params(v: int) -> dict:
        return {n: jax.device_put(_values(n, s, d, v, delta), src) for n, (s, d, _, src, _) in leaves.items()}

    weak = random.Random(seed + 1000)  # some replicas declare a leaf weakly typed: its arrays come back so
    like = {
        n: jax.ShapeDtypeStruct(s, _dtype(w), sharding=dst, weak_type=weak.random() < 0.3)
        for n, (s, _, w, _, dst) in leaves.items()
    }
    chunks = r.choice([{"chunk_bytes": 64, "staging_bytes": 1024}, {}])
    opts = Options(timeout_s=20.0, secret=KEY, verify="verify" in flags, delta="on" if delta else "auto", **chunks)
    trainer = ElasticTrainer(params(0), devices=list(D[:4]), options=opts)
    try:
        _refits(trainer, like, leaves, params, delta, opts)
    finally:
        trainer.close()


def _refits(trainer, like: dict, leaves: dict, params, delta: bool, opts: Options) -> None:
    """Three versions pushed and pulled, every shard and weak type checked."""
    replica = ElasticReplica(like, trainer.address, name="r", devices=list(D[4:]), options=opts)
    trainer.wait(count=1)
    for v in (1, 2, 3):
        trainer.push(params(v), version=v)
        tree, got = replica.pull(newer_than=v - 1)
        assert got == v
        specs = [(n, s, d, w, dst, like[n].weak_type) for n, (s, d, w, _, dst) in leaves.items()]
        assert mismatches(tree, specs, v, delta) == []
    replica.leave()
