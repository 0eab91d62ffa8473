"""A server without jax: the trainer's parameters pulled into numpy arrays every step (see trainer.py).

Run both programs with one line (from the repository root):

  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2 .venv/bin/mpiexec -n 2 .venv/bin/python examples/trainer.py : \
      -n 1 .venv/bin/python examples/numpy_server.py
"""

import sys

sys.modules["jax"] = None  # this program never imports jax: the refit lands in numpy arrays it owns

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from jreshard import Box  # noqa: E402
from jreshard.refit import Declaration, Endpoint, Tensor  # noqa: E402

SHAPES = {"embed": (256, 64), "wq": (64, 64), "wo": (64, 64), "w1": (64, 256), "w2": (256, 64)}

MPI.COMM_WORLD.Split(1, MPI.COMM_WORLD.Get_rank())  # collective: the trainer splits its own processes off
# Two slots (as two tensor-parallel GPUs would hold them): each holds half of every tensor's columns.
tensors, buffers = [], {}
for key, (rows, cols) in SHAPES.items():
    name, half = f"['{key}']", cols // 2
    boxes = ((0, Box((0, 0), (rows, half))), (1, Box((0, half), (rows, cols))))
    tensors.append(Tensor(name=name, shape=(rows, cols), dtype="float32", boxes=boxes))
    for slot, _ in boxes:
        buffers[(name, slot)] = np.zeros((rows, half), np.float32)
endpoint = Endpoint(Declaration(tensors=tuple(tensors), slots=2))
for _ in range(5):
    version = endpoint.pull(buffers)  # every buffer holds this version's bytes once it returns
    means = sorted({float(b.mean()) for b in buffers.values()})
    print(f"numpy server: pulled version {version} into {len(buffers)} numpy arrays, their means {means}", flush=True)
endpoint.close()
