"""The trainer side of a refit: FSDP parameters pushed to the server every step.

Run both programs with one line (from the repository root):

  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2 .venv/bin/mpiexec -n 2 .venv/bin/python examples/trainer.py : \
      -n 2 .venv/bin/python examples/server.py
"""

import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import jreshard
from jreshard.mpi.cluster import initialize

SHAPES = {"embed": (256, 64), "wq": (64, 64), "wo": (64, 64), "w1": (64, 256), "w2": (256, 64)}

side = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())  # the trainer's own processes
initialize(side)  # one jax cluster per program
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
params = {
    k: jax.make_array_from_callback(s, NamedSharding(mesh, P("fsdp")), lambda i, s=s: np.zeros(s, np.float32)[i])
    for k, s in SHAPES.items()
}
group = jreshard.RefitGroup("source", params)
for step in range(1, 6):
    params = jax.tree.map(lambda p: p + 1.0, params)  # the "optimizer step"
    t0 = time.perf_counter()
    group.push(params, version=step)
    seconds = time.perf_counter() - t0
    held = sum(s.data.nbytes for p in params.values() for s in p.addressable_shards)  # this process's shards
    if side.Get_rank() == 0:
        print(f"trainer: pushed version {step}: {held / 2**20:.2f} MiB held here, {seconds * 1e3:.1f} ms", flush=True)
group.close()
