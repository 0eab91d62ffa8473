"""A JAX trainer refits a PyTorch receiver (no jax) of random tensors over MPI (one MPMD mpiexec):
``torch_random_body.py trainer SEED LEAVES`` (one process, 2 devices) and ``torch_random_body.py server SEED
LEAVES [in_place]`` (two processes). Every dtype both jax and torch hold, shapes of rank 0-3 with sizes of 0, the
trainer's leaves on random shardings; each server process holds of each tensor either its half along a
dimension the two split evenly or all of it. Two versions; every tensor's bytes checked against the host
values."""

import sys
from pathlib import Path

from _common import main, push_versions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for random_trees
from random_trees import torch_leaves as _leaves
from random_trees import torch_mismatches, torch_shardings, torch_shards
from random_trees import values as _values

VERSIONS = (1, 2)


def trainer_side() -> dict:
    import jax

    seed, count = int(sys.argv[2]), int(sys.argv[3])
    leaves = _leaves(seed, count)
    shardings = torch_shardings(seed, leaves, jax.devices()[:2])

    def params(v: int) -> dict:
        return {n: jax.device_put(_values(n, s, d, v), shardings[n]) for n, s, d, _ in leaves}

    return push_versions(params, VERSIONS)


def server_side() -> dict:
    sys.modules["jax"] = None  # a PyTorch server: any import of jax from here on raises
    from mpi4py import MPI

    from jreshard import Options
    from jreshard.torch.receiver import Receiver

    seed, count = int(sys.argv[2]), int(sys.argv[3])
    leaves = _leaves(seed, count)
    shards, boxes = torch_shards(leaves, MPI.COMM_WORLD.Get_rank() - 1)  # the trainer is world rank 0
    rx = Receiver.over_mpi(shards, options=Options(timeout_s=60.0), in_place="in_place" in sys.argv[4:])
    bad = []
    for want_version in VERSIONS:
        v = rx.pull()
        if v != want_version:
            bad.append(f"version {v}, expected {want_version}")
        bad += torch_mismatches(leaves, shards, boxes, v)
    rx.close()
    return {"bad": bad, "version": rx.version, "loaded": sorted(m for m in sys.modules if m.startswith("jax."))}


if __name__ == "__main__":
    side = sys.argv[1]
    main(f"torch-random-{side}", trainer_side if side == "trainer" else server_side)
