"""The server side of a refit: TP x DP parameters pulled from the trainer every step (see trainer.py)."""

import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import jreshard
from jreshard.mpi.cluster import initialize

SHAPES = {"embed": (256, 64), "wq": (64, 64), "wo": (64, 64), "w1": (64, 256), "w2": (256, 64)}

side = MPI.COMM_WORLD.Split(1, MPI.COMM_WORLD.Get_rank())  # the server's own processes
initialize(side)
devs = np.array(jax.devices())
mesh = jax.sharding.Mesh(devs.reshape(2, -1) if devs.size % 2 == 0 else devs.reshape(1, -1), ("dp", "tp"))
spec = {"embed": P(None, "tp"), "wq": P(None, "tp"), "wo": P("tp", None), "w1": P(None, "tp"), "w2": P("tp", None)}
like = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(mesh, spec[k])) for k, s in SHAPES.items()}
group = jreshard.RefitGroup("destination", like)
for _ in range(5):
    t0 = time.perf_counter()
    params, version = group.pull(like=like)
    seconds = time.perf_counter() - t0
    landed = sum(s.data.nbytes for p in params.values() for s in p.addressable_shards)  # this process's shards
    mean = float(np.asarray(params["wq"].addressable_shards[0].data).mean())
    if side.Get_rank() == 0:
        print(
            f"server: pulled version {version}: {landed / 2**20:.2f} MiB landed here in {seconds * 1e3:.1f} ms "
            f"({landed / seconds / 1e9:.3f} GB/s), wq shard mean {mean}",
            flush=True,
        )
group.close()
