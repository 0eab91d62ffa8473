"""One inference replica of elastic refit: joins the trainer, catches up, then takes every version.

See examples/elastic_trainer.py for how to run the pair. ``--leave-after V`` leaves cleanly once it
holds version V; start it again (same name) to rejoin.
"""

import argparse

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard.elastic import ElasticReplica

SHAPES = {"embed": (256, 64), "wq": (64, 64), "wo": (64, 64), "w1": (64, 256), "w2": (256, 64)}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("address_file", help="the file the trainer wrote its address to")
parser.add_argument("name", help="this replica's name (unique among live replicas)")
parser.add_argument("--leave-after", type=int, default=None, help="leave once holding this version")
args = parser.parse_args()

mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, -1), ("dp", "tp"))  # tensor parallel, its own mesh
spec = {"embed": P(None, "tp"), "wq": P(None, "tp"), "wo": P("tp", None), "w1": P(None, "tp"), "w2": P("tp", None)}
like = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(mesh, spec[k])) for k, s in SHAPES.items()}
replica = ElasticReplica(like, args.address_file, name=args.name, options=jreshard.Options(timeout_s=30.0))
version = None
while True:
    try:
        params, version = replica.pull(newer_than=version, timeout_s=120.0)
    except jreshard.PeerError as err:  # the trainer finished (or died)
        print(f"{args.name}: stopping: {err}", flush=True)
        break
    arrival = replica.arrivals[-1]
    value = float(np.asarray(params["wq"].addressable_shards[0].data)[0, 0])
    print(f"{args.name}: version {version} from {arrival.source}, wq[0, 0] = {value}", flush=True)
    if version == args.leave_after:
        replica.leave()
        print(f"{args.name}: left at version {version}", flush=True)
        break
