"""Elastic refits of random trees inside one process (8 CPU devices: the trainer on 0-3, a replica on 4-7, the
control over authenticated loopback, the bytes NIXL WRITEs of this process's agent to itself): every dtype jax
holds that a refit moves, shapes of rank 0-3 with sizes of 0, each side's own random sharding (one device, or a
mesh over 1, 2 or 4 of its devices in any order), some float leaves cast on the replica, small and large chunks,
``verify``, and versions that change a tenth of their elements (deltas). Every shard of every version is checked
against the host values (a cast: against jax's ``astype``)."""

from __future__ import annotations

import random
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jreshard import Options
from jreshard.elastic import ElasticReplica, ElasticTrainer

pytestmark = pytest.mark.timeout(120)
D = np.array(jax.devices())
KEY = b"elastic-random-key-0123456789ab"
DTYPES = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "bfloat16", "float32", "complex64",
    "float8_e4m3fn", "float8_e5m2", "float8_e3m4", "float8_e8m0fnu", "float8_e4m3b11fnuz", "float8_e4m3fnuz",
    "float8_e5m2fnuz",
]  # fmt: skip
CASTS = ["float32", "bfloat16", "float16"]


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def _sharding(r: random.Random, devs: np.ndarray, shape: tuple[int, ...]):
    k = r.choice([1, 2, 4])
    d = devs[r.sample(range(len(devs)), k)]
    if r.random() < 0.1:
        return SingleDeviceSharding(d[0])
    mesh_shape = r.choice({1: [(1,)], 2: [(2,), (1, 2)], 4: [(4,), (2, 2)]}[k])
    names = tuple("ab"[: len(mesh_shape)])
    mesh = Mesh(d.reshape(mesh_shape), names)
    spec: list = [None] * len(shape)
    for axis in names:
        if not shape or r.random() < 0.3:
            continue
        dim = r.randrange(len(shape))
        axes = () if spec[dim] is None else (spec[dim] if isinstance(spec[dim], tuple) else (spec[dim],))
        if shape[dim] % (int(np.prod([mesh.shape[a] for a in axes])) * mesh.shape[axis]):
            continue
        spec[dim] = (*axes, axis) if axes else axis
    return NamedSharding(mesh, P(*spec))


def _drawn(name: str, shape: tuple[int, ...], dtype: str, seed: str) -> np.ndarray:
    dt = _dtype(dtype)
    rng = np.random.default_rng(zlib.crc32(f"{name}-{seed}".encode()))
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)  # every bit pattern (NaNs of every payload included)


def _values(name: str, shape: tuple[int, ...], dtype: str, version: int, delta: bool) -> np.ndarray:
    """Version ``version``'s host values: new random bits each version (``delta``: version 0's, with a random
    tenth of the elements redrawn at each version since)."""
    if not delta:
        return _drawn(name, shape, dtype, str(version))
    out = _drawn(name, shape, dtype, "0")
    for v in range(1, version + 1):
        changed = np.random.default_rng(zlib.crc32(f"mask-{name}-{v}".encode())).random(size=shape) < 0.1
        out = np.where(changed, _drawn(name, shape, dtype, str(v)), out)
    return out


FLAGS = ["", "cast", "delta cast", "verify delta"]


@pytest.mark.parametrize(("seed", "flags"), [(seed, FLAGS[seed % 4]) for seed in range(12)])
def test_an_elastic_refit_of_random_leaves(seed, flags):
    r = random.Random(seed)
    delta, cast = "delta" in flags, "cast" in flags
    leaves = {}
    for i in range(r.randint(4, 8)):
        shape = tuple(r.choice([0, 1, 2, 3, 4, 6, 8, 16]) for _ in range(r.randint(0, 3)))
        dtype = r.choice(DTYPES)
        wire = r.choice(CASTS) if cast and _dtype(dtype).kind == "f" and r.random() < 0.5 else dtype
        leaves[f"l{i}"] = (shape, dtype, wire, _sharding(r, D[:4], shape), _sharding(r, D[4:], shape))

    def params(v: int) -> dict:
        return {n: jax.device_put(_values(n, s, d, v, delta), src) for n, (s, d, _, src, _) in leaves.items()}

    like = {n: jax.ShapeDtypeStruct(s, _dtype(w), sharding=dst) for n, (s, _, w, _, dst) in leaves.items()}
    chunks = r.choice([{"chunk_bytes": 64, "staging_bytes": 1024}, {}])
    opts = Options(timeout_s=20.0, secret=KEY, verify="verify" in flags, delta="on" if delta else "auto", **chunks)
    trainer = ElasticTrainer(params(0), devices=list(D[:4]), options=opts)
    try:
        replica = ElasticReplica(like, trainer.address, name="r", devices=list(D[4:]), options=opts)
        trainer.wait(count=1)
        for v in (1, 2, 3):
            trainer.push(params(v), version=v)
            tree, got = replica.pull(newer_than=v - 1)
            assert got == v
            for n, (shape, dtype, wire, _, dst) in leaves.items():
                a, host = tree[n], _values(n, shape, dtype, v, delta)
                want = np.asarray(jnp.asarray(host).astype(_dtype(wire))) if wire != dtype else host
                assert a.shape == shape and a.dtype == _dtype(wire) and a.sharding.is_equivalent_to(dst, len(shape))
                for s in a.addressable_shards:
                    w = np.ascontiguousarray(want[s.index])
                    got_bytes = np.asarray(s.data).reshape(-1).view(np.uint8).tobytes()
                    assert got_bytes == w.reshape(-1).view(np.uint8).tobytes(), (n, shape, dtype, wire, v, s.device)
        replica.leave()
    finally:
        trainer.close()
