"""A replica program of the elastic tests: ``replica.py ADDRESS_FILE NAME MODE``.

With ``JRESHARD_COORDINATOR``, ``JRESHARD_PROCESSES`` and ``JRESHARD_PROCESS`` set, it is one process
of a replica of several (a jax cluster of its own). Modes: ``ok``; ``kill:V`` (SIGKILLs itself in the
middle of receiving version V); ``leave:V`` (leaves cleanly once it holds version V). Checks every
pulled tree element by element and prints its results as one JSON line.
"""

import json
import os
import signal
import sys

import jax
import numpy as np
from _model import SHAPES, options, value
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard.elastic import ElasticReplica
from jreshard.elastic import replica as replica_module
from jreshard.errors import PeerError
from jreshard.nixl import NixlComm


def arm_kill(version):
    """SIGKILL this process at its second data exchange of ``version`` (some bytes in, some not)."""
    state = {"v": None, "calls": 0}
    receive = replica_module.ElasticReplica._receive

    def watched_receive(self, ch, decl, v, source, **kw):
        state["v"], state["calls"] = v, 0
        return receive(self, ch, decl, v, source, **kw)

    def deadly(exchange):  # exchange, or exchange_sized (a delta refit's groups)
        def deadly_exchange(self, sends, recvs, *, timeout_s):
            if state["v"] == version and recvs:
                state["calls"] += 1
                if state["calls"] == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
            return exchange(self, sends, recvs, timeout_s=timeout_s)

        return deadly_exchange

    replica_module.ElasticReplica._receive = watched_receive
    NixlComm.exchange = deadly(NixlComm.exchange)
    NixlComm.exchange_sized = deadly(NixlComm.exchange_sized)


def main():
    address, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode.startswith("kill:"):
        arm_kill(int(mode[5:]))
    if "JRESHARD_COORDINATOR" in os.environ:  # one process of a replica of several: its own jax cluster
        jax.distributed.initialize(
            coordinator_address=os.environ["JRESHARD_COORDINATOR"],
            num_processes=int(os.environ["JRESHARD_PROCESSES"]),
            process_id=int(os.environ["JRESHARD_PROCESS"]),
        )
    devs = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devs.reshape(1, -1), ("dp", "tp"))
    spec = {k: P(None, "tp") if len(s) == 2 else P() for k, s in SHAPES.items()}
    like = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(mesh, spec[k])) for k, s in SHAPES.items()}
    rep = ElasticReplica(like, address, name=name, options=options())
    checked, bad, version, why = [], [], None, ""
    while True:
        try:
            tree, version = rep.pull(newer_than=version, timeout_s=60.0)
        except PeerError as err:
            why = str(err)
            break
        for k, s in SHAPES.items():
            shards = tree[k].addressable_shards
            exact = all(np.array_equal(np.asarray(sh.data), value(k, s, version)[sh.index]) for sh in shards)
            if tree[k].sharding != like[k].sharding or not shards or not exact:
                bad.append([version, k])
        checked.append(version)
        if mode == f"leave:{version}":
            rep.leave()
            why = "left"
            break
    arrivals = [[a.version, a.source] for a in rep.arrivals]
    result = {"name": name, "process": jax.process_index(), "checked": checked, "bad": bad, "arrivals": arrivals}
    print(json.dumps(result | {"end": why}), flush=True)


if __name__ == "__main__":
    main()
