"""The trainer side of elastic refit: pushes a new version every step to whichever replicas are there.

Replicas (examples/elastic_replica.py) may start, leave, or be killed at any time; each push reports
who committed the version and who was lost. From the repository root, in three terminals (or with &):

  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2 .venv/bin/python examples/elastic_trainer.py /tmp/jreshard-address
  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2 .venv/bin/python examples/elastic_replica.py /tmp/jreshard-address r1
  JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2 .venv/bin/python examples/elastic_replica.py /tmp/jreshard-address r2
"""

import argparse
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.elastic import ElasticTrainer

SHAPES = {"embed": (256, 64), "wq": (64, 64), "wo": (64, 64), "w1": (64, 256), "w2": (256, 64)}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("address_file", help="where to write 127.0.0.1:PORT for the replicas")
parser.add_argument("--steps", type=int, default=20, help="versions to push")
parser.add_argument("--step-seconds", type=float, default=0.5, help="the 'training step' between pushes")
parser.add_argument("--replicas", type=int, default=1, help="replicas to wait for before the first push")
args = parser.parse_args()

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
params = {k: jax.device_put(np.zeros(s, np.float32), NamedSharding(mesh, P("fsdp"))) for k, s in SHAPES.items()}
trainer = ElasticTrainer(params, address_file=args.address_file, options=jreshard.Options(timeout_s=30.0))
print(f"trainer: listening at {trainer.address}; waiting for {args.replicas} replica(s)", flush=True)
trainer.wait(count=args.replicas, timeout_s=120.0)
for step in range(1, args.steps + 1):
    params = jax.tree.map(lambda p: p + 1.0, params)  # the "optimizer step"
    report = trainer.push(params, version=step)
    print(f"trainer: {report.summary()}", flush=True)
    time.sleep(args.step_seconds)
trainer.wait(version=args.steps, count=1)  # "any 1 replica at the last version"
print(f"trainer: done; replicas {trainer.replicas(include_gone=True)}", flush=True)
trainer.close()
