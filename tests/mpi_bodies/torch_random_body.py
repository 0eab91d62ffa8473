"""A JAX trainer refits a PyTorch receiver (no jax) of random tensors over MPI (one MPMD mpiexec):
``torch_random_body.py trainer SEED LEAVES`` (one process, 2 devices) and ``torch_random_body.py server SEED
LEAVES [in_place]`` (two processes). Every dtype both jax and torch hold, shapes of rank 0-3 with sizes of 0, the
trainer's leaves on random shardings; each server process holds of each tensor either its half along a
dimension the two split evenly or all of it. Two versions; every tensor's bytes checked against the host
values."""

import random
import sys
from pathlib import Path

import numpy as np
from _common import main, push_versions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for random_trees
from random_trees import torch_leaves as _leaves
from random_trees import values as _values

VERSIONS = (1, 2)


def trainer_side() -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    seed, count = int(sys.argv[2]), int(sys.argv[3])
    leaves = _leaves(seed, count)
    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    r = random.Random(seed + 1)

    def sharding(shape: tuple[int, ...]) -> NamedSharding:
        dims = [d for d, n in enumerate(shape) if n % 2 == 0]
        spec = [None] * len(shape)
        if dims and r.random() < 0.7:
            spec[r.choice(dims)] = "fsdp"
        return NamedSharding(mesh, P(*spec))

    shardings = {n: sharding(s) for n, s, _, _ in leaves}

    def params(v: int) -> dict:
        return {n: jax.device_put(_values(n, s, d, v), shardings[n]) for n, s, d, _ in leaves}

    return push_versions(params, VERSIONS)


def server_side() -> dict:
    sys.modules["jax"] = None  # a PyTorch server: any import of jax from here on raises
    import torch
    from mpi4py import MPI

    from jreshard import Options
    from jreshard.sharding.box import Box
    from jreshard.torch.receiver import Receiver, Shard

    seed, count = int(sys.argv[2]), int(sys.argv[3])
    rank = MPI.COMM_WORLD.Get_rank() - 1  # the trainer is world rank 0
    leaves = _leaves(seed, count)
    shards, boxes = {}, {}
    for n, shape, dtype, split in leaves:
        lo, hi = [0] * len(shape), list(shape)
        if split is not None:
            half = shape[split] // 2
            lo[split], hi[split] = rank * half, (rank + 1) * half
        box = Box(tuple(lo), tuple(hi))
        t = torch.zeros(box.shape, dtype=getattr(torch, dtype))
        shards[f"['{n}']"] = Shard(t, shape, box)  # the trainer's leaf, by its key path
        boxes[n] = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
    rx = Receiver.over_mpi(shards, options=Options(timeout_s=60.0), in_place="in_place" in sys.argv[4:])
    bad = []
    for want_version in VERSIONS:
        v = rx.pull()
        if v != want_version:
            bad.append(f"version {v}, expected {want_version}")
        for n, shape, dtype, _ in leaves:
            want = np.ascontiguousarray(_values(n, shape, dtype, v)[boxes[n]]).reshape(-1).view(np.uint8)
            got = shards[f"['{n}']"].tensor.reshape(-1).view(torch.uint8).numpy()
            if got.tobytes() != want.tobytes():
                bad.append(f"{n} {shape} {dtype} at version {v}")
    rx.close()
    return {"bad": bad, "version": rx.version, "loaded": sorted(m for m in sys.modules if m.startswith("jax."))}


if __name__ == "__main__":
    side = sys.argv[1]
    main(f"torch-random-{side}", trainer_side if side == "trainer" else server_side)
