"""The views matrix through elastic refit between separate programs: ``views.py trainer ADDRESS_FILE`` or
``views.py replica ADDRESS_FILE NAME`` (with the ``JRESHARD_*`` variables, one process of a replica of several).

The trainer is two processes (one jax cluster: ``JRESHARD_COORDINATOR``, ``JRESHARD_PROCESSES``,
``JRESHARD_PROCESS``), its float32 parameters FSDP over their four devices (``views_cases.globals_()`` plus
the version); process 0 waits for r1, pushes version 1, says ``join-now``, waits until two replicas hold
version 1 (r2 catches up from r1), pushes version 2 and closes. A replica (four devices: one process,
or two of two) declares the server's bfloat16 / FP8 tree on a TP2 x DP2 mesh and the recipe of
``views_cases.build`` over ``views.param`` leaves, and compares every shard of every version it holds bit
for bit with numpy.

Each program prints the network bytes its ``run_pair`` sent (the engine's count), by version, as its
last JSON line.
"""

import json
import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "mpi_bodies"))
from views_cases import SPECS, bits, build, globals_, references

from jreshard import Options, views
from jreshard.elastic import ElasticReplica, ElasticTrainer
from jreshard.elastic import followers as followers_module
from jreshard.elastic import membership as membership_module
from jreshard.elastic import replica as replica_module
from jreshard.errors import PeerError
from jreshard.sharding.topology import Link

OPTS = Options(timeout_s=20.0, chunk_bytes=64, staging_bytes=512, max_group_ops=4)
STARTUP_S = 90.0
G = globals_()
SENT: list[int] = []


def say(**event):
    print(json.dumps(event), flush=True)


def count_sent(module):
    """Record the network bytes every sending ``run_pair`` of ``module`` sent (the engine's statistics)."""
    real = module.run_pair

    def spy(pair, process, channels, *, shards, options, **kw):
        out, stats = real(pair, process, channels, shards=shards, options=options, **kw)
        if process < pair.n_src:
            SENT.append(int(stats.sent_bytes.get(Link.NETWORK, 0)))
        return out, stats

    module.run_pair = spy


def trainer(address):
    jax.distributed.initialize(
        coordinator_address=os.environ["JRESHARD_COORDINATOR"],
        num_processes=int(os.environ["JRESHARD_PROCESSES"]),
        process_id=int(os.environ["JRESHARD_PROCESS"]),
    )
    count_sent(followers_module if jax.process_index() else membership_module)
    fsdp = NamedSharding(Mesh(np.array(jax.devices()), ("f",)), P("f"))

    def params(v):
        return {n: jax.make_array_from_callback(a.shape, fsdp, lambda i, a=a: (a + v)[i]) for n, a in G.items()}

    tr = ElasticTrainer(params(0), address_file=address, options=OPTS, catch_up="peer")
    sent, out = {}, {}
    if jax.process_index() == 0:
        tr.wait(count=1, timeout_s=STARTUP_S)
    for v in (1, 2):
        if v == 2 and jax.process_index() == 0:
            say(event="join-now")
            out["at1"] = tr.wait(version=1, count=2, timeout_s=STARTUP_S)
            out["joined"] = {n: i.caught_up_from for n, i in tr.replicas().items()}
        SENT.clear()
        report = tr.push(params(v), version=v)
        sent[v] = sum(SENT)
        out[f"committed{v}"] = sorted(report.committed) if report is not None else None
    tr.close()
    say(event="done", process=jax.process_index(), sent=sent, **out)


def replica(address, name):
    if "JRESHARD_COORDINATOR" in os.environ:  # one process of a replica of several: its own jax cluster
        jax.distributed.initialize(
            coordinator_address=os.environ["JRESHARD_COORDINATOR"],
            num_processes=int(os.environ["JRESHARD_PROCESSES"]),
            process_id=int(os.environ["JRESHARD_PROCESS"]),
        )
    count_sent(replica_module)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "tp"))
    shardings = {k: NamedSharding(mesh, P(*s)) for k, s in SPECS.items()}
    like = {k: jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=shardings[k]) for k, r in references(G).items()}
    params = {n: views.param(f"['{n}']", a.shape, "float32") for n, a in G.items()}
    rep = ElasticReplica(like, address, name=name, options=OPTS, recipe={"w": None, "c": None, **build(views, params)})
    checked, bad, version, why = {}, [], None, ""
    while True:
        try:
            tree, version = rep.pull(newer_than=version, timeout_s=STARTUP_S)
        except PeerError as err:
            why = str(err)
            break
        n = 0
        for k, ref in references({m: a + version for m, a in G.items()}).items():
            leaf = tree[k]
            if leaf.sharding != shardings[k] or leaf.dtype != ref.dtype:
                bad.append([version, k, "sharding or dtype"])
            for s in leaf.addressable_shards:
                if not np.array_equal(bits(np.asarray(s.data)), bits(ref[s.index])):
                    bad.append([version, k, str(s.index)])
                n += 1
        checked[version] = n
    arrivals = [[a.version, a.source] for a in rep.arrivals]
    say(
        event="done",
        name=name,
        process=jax.process_index(),
        checked=checked,
        bad=bad,
        arrivals=arrivals,
        served=sum(SENT),
        end=why,
    )


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        trainer(sys.argv[2])
    else:
        replica(sys.argv[2], sys.argv[3])
