"""Random leaves for the refit tests that draw their trees (``test_elastic_random.py``, the MPI bodies
``refit_random_body.py`` and ``torch_random_body.py``, the NIXL body ``torch_bodies/random_pair.py``): dtypes by
name, a random sharding of a shape over some devices, and each version's host values. Imports neither jax nor
torch at module level (a PyTorch server without jax reads the values too)."""

from __future__ import annotations

import random
import zlib
from typing import Any

import numpy as np


def dtype(name: str) -> np.dtype:
    """The numpy dtype of a name, ml_dtypes' included (``bfloat16``, ``float8_e4m3fn``...)."""
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, None) or name)


def sharding(r: random.Random, devs: np.ndarray, shape: tuple[int, ...]) -> Any:
    """A random sharding of ``shape``: one device (a tenth of the time), or a mesh over 1, 2 or 4 of ``devs`` in
    any order whose axes split the dimensions they divide (some left unused)."""
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

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


def _drawn(name: str, shape: tuple[int, ...], dtype_name: str, seed: int) -> np.ndarray:
    dt = dtype(dtype_name)
    rng = np.random.default_rng(zlib.crc32(f"{name}-{seed}".encode()))
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)  # every bit pattern (NaNs of every payload included)


def values(name: str, shape: tuple[int, ...], dtype_name: str, version: int, delta: bool = False) -> np.ndarray:
    """Leaf ``name``'s host values at ``version``: new random bits each version (``delta``: version 0's, with a
    random tenth of the elements redrawn at each version since, as a training step changes some weights)."""
    if not delta:
        return _drawn(name, shape, dtype_name, version)
    out = _drawn(name, shape, dtype_name, 0)
    for v in range(1, version + 1):
        changed = np.random.default_rng(zlib.crc32(f"mask-{name}-{v}".encode())).random(size=shape) < 0.1
        out = np.where(changed, _drawn(name, shape, dtype_name, v), out)
    return out


REFIT_DTYPES = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "bfloat16", "float32", "complex64",
    "float8_e4m3fn", "float8_e5m2", "float8_e3m4", "float8_e8m0fnu", "float8_e4m3b11fnuz", "float8_e4m3fnuz",
    "float8_e5m2fnuz",
]  # fmt: skip
"""Every dtype jax holds (without ``jax_enable_x64``) that a refit moves."""

CASTS = ["float32", "bfloat16", "float16"]
"""The float dtypes a destination may declare a float leaf as (the cast on the way)."""


def mismatches(out: Any, leaves: list, version: int, delta: bool = False) -> list[str]:
    """What ``out`` (a pulled tree of jax arrays, by leaf name) holds wrongly at ``version``: per leaf of ``leaves``,
    ``(name, shape, dtype name, wire dtype name, destination sharding, declared weak_type or None)``, its dtype,
    shape, sharding, weak type, and every shard's bits against the host values (a cast: against jax's ``astype``)."""
    import jax.numpy as jnp

    bad = []
    for name, shape, dtype_name, wire, dst, weak in leaves:
        a, host = out[name], values(name, shape, dtype_name, version, delta)
        want = np.asarray(jnp.asarray(host).astype(dtype(wire))) if wire != dtype_name else host
        what = f"{name} {shape} {dtype_name}->{wire} at version {version}"
        if a.dtype != dtype(wire) or a.shape != shape or not a.sharding.is_equivalent_to(dst, len(shape)):
            bad.append(f"{what}: {a.dtype} {a.shape} {a.sharding}")
            continue
        if weak is not None and a.weak_type != weak:
            bad.append(f"{what}: weak_type {a.weak_type}, declared {weak}")
        for s in a.addressable_shards:
            w, g = np.array(want[s.index], order="C"), np.asarray(s.data)  # (0-d stays 0-d)
            if g.shape != w.shape or g.reshape(-1).view(np.uint8).tobytes() != w.reshape(-1).view(np.uint8).tobytes():
                bad.append(f"{what} on {s.device}: {g.shape} against {w.shape}")
                break
    return bad


TORCH_DTYPES = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "bfloat16", "float32", "complex64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
]  # fmt: skip
"""Every dtype a jax trainer and a PyTorch receiver both hold."""


def torch_leaves(seed: int, count: int) -> list[tuple[str, tuple[int, ...], str, int | None]]:
    """Random leaves for a PyTorch receiver of two processes, ``(name, shape, dtype, split)``: shapes of rank 0-3
    with sizes of 0, and ``split`` the dimension the two processes halve (``None``: each holds all of it)."""
    r = random.Random(seed)
    out = []
    for i in range(count):
        shape = tuple(r.choice([0, 1, 2, 3, 4, 6, 8]) for _ in range(r.choice([0, 1, 2, 2, 3])))
        even = [d for d, n in enumerate(shape) if n % 2 == 0]
        split = r.choice(even) if even and r.random() < 0.7 else None
        out.append((f"t{i}", shape, r.choice(TORCH_DTYPES), split))
    return out


def torch_shardings(seed: int, leaves: list, devices: Any) -> dict[str, Any]:
    """The trainer's sharding of each of ``leaves`` (``torch_leaves``'s): a mesh over ``devices`` (two), each leaf
    split along one of its even dimensions (7 in 10) or replicated."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("fsdp",))
    r = random.Random(seed + 1)
    out = {}
    for name, shape, _, _ in leaves:
        dims = [d for d, n in enumerate(shape) if n % 2 == 0]
        spec: list[str | None] = [None] * len(shape)
        if dims and r.random() < 0.7:
            spec[r.choice(dims)] = "fsdp"
        out[name] = NamedSharding(mesh, P(*spec))
    return out


def torch_shards(leaves: list, index: int) -> tuple[dict[str, Any], dict[str, tuple[slice, ...]]]:
    """What receiving process ``index`` of two holds of ``leaves`` (``torch_leaves``'s): ``({key path: Shard}, {name:
    its box as slices})``, each tensor zeros of its dtype."""
    import torch

    from jreshard.sharding.box import Box
    from jreshard.torch.receiver import Shard

    shards, boxes = {}, {}
    for name, shape, dtype_name, split in leaves:
        lo, hi = [0] * len(shape), list(shape)
        if split is not None:
            half = shape[split] // 2
            lo[split], hi[split] = index * half, (index + 1) * half
        box = Box(tuple(lo), tuple(hi))
        shards[f"['{name}']"] = Shard(torch.zeros(box.shape, dtype=getattr(torch, dtype_name)), shape, box)
        boxes[name] = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
    return shards, boxes


def torch_mismatches(leaves: list, shards: dict, boxes: dict, version: int, delta: bool = False) -> list[str]:
    """The leaves whose tensor does not hold ``version``'s bytes (``torch_shards``'s shards and boxes)."""
    import torch

    bad = []
    for name, shape, dtype_name, _ in leaves:
        want = np.ascontiguousarray(values(name, shape, dtype_name, version, delta)[boxes[name]])
        got = shards[f"['{name}']"].tensor.reshape(-1).view(torch.uint8).numpy()
        if got.tobytes() != want.reshape(-1).view(np.uint8).tobytes():
            bad.append(f"{name} {shape} {dtype_name} at version {version}")
    return bad
