"""A replica of the elastic fault suite: ``fault_replica.py NAME MODE``, in its own network namespace.

Modes: ``ok``; ``die:V:N``: SIGKILL itself at its ``N``-th receive exchange of version ``V`` (mid-WRITE:
some bytes in, some not); ``rejoin``: when the trainer goes, report what it holds and join the
trainer that replaces it, under the same name, with the weights it held (``held=``: handed out again
only once current). Pulls every version to ``$JRESHARD_STEPS`` (hashing what it holds against every
version after each), then leaves. One JSON line per event: ``ready``, ``pulled``, ``rejoined``, ``end``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax
import numpy as np
from _fault_model import held, shape
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard import Options, PeerError, TransferTimeoutError
from jreshard.elastic import ElasticReplica
from jreshard.elastic import replica as replica_module
from jreshard.nixl import NixlComm


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def arm_kill(version: int, nth: int) -> None:
    state = {"v": None, "calls": 0}
    receive = replica_module.ElasticReplica._receive

    def watched(self, ch, decl, v, source, **kw):
        state["v"], state["calls"] = v, 0
        return receive(self, ch, decl, v, source, **kw)

    def deadly(exchange):  # exchange, or exchange_sized (a delta refit's groups)
        def deadly_exchange(self, sends, recvs, *, timeout_s):
            if state["v"] == version and recvs:
                state["calls"] += 1
                if state["calls"] == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
            return exchange(self, sends, recvs, timeout_s=timeout_s)

        return deadly_exchange

    from jreshard.nixl.prepared import NixlPrepared

    wait = NixlPrepared.wait

    def deadly_wait(self, group):  # a prepared refit's groups (the rounds' agreement stays per operation)
        if state["v"] == version:
            state["calls"] += 1
            if state["calls"] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
        return wait(self, group)

    replica_module.ElasticReplica._receive = watched
    NixlComm.exchange = deadly(NixlComm.exchange)
    NixlComm.exchange_sized = deadly(NixlComm.exchange_sized)
    NixlPrepared.wait = deadly_wait


def main() -> None:
    name, mode = sys.argv[1], sys.argv[2]
    steps, timeout = int(os.environ["JRESHARD_STEPS"]), float(os.environ["JRESHARD_TIMEOUT"])
    if mode.startswith("die:"):
        _, v, n = mode.split(":")
        arm_kill(int(v), int(n))
    say(event="ready", pid=os.getpid())
    sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()).reshape(1, -1), ("dp", "tp")), P(None, "tp"))
    like = {"w": jax.ShapeDtypeStruct(shape(), np.float32, sharding=sharding)}
    opts = Options(timeout_s=timeout, chunk_bytes=1 << 18, staging_bytes=1 << 21)

    def join(held=None) -> ElasticReplica:
        """Join the trainer at the address file; a file left by a trainer that is gone is read again
        until its new trainer replaces it (bounded)."""
        deadline = time.monotonic() + 90
        while True:
            try:
                return ElasticReplica(
                    like,
                    os.environ["JRESHARD_ADDRESS"],
                    name=name,
                    host=os.environ["JRESHARD_HOST"],
                    options=opts,
                    held=held,
                )
            except (PeerError, TransferTimeoutError) as err:
                if time.monotonic() > deadline:
                    raise
                say(event="retry", error=str(err)[:300])
                time.sleep(0.2)

    rep = join()
    version, why, rejoins = None, "", 0
    while version is None or version < steps:
        try:
            tree, version = rep.pull(newer_than=version, timeout_s=120.0)
        except (PeerError, TransferTimeoutError) as err:
            why = f"{type(err).__name__}: {err}"
            if mode != "rejoin" or rejoins or version is None:
                break
            tree, have = rep.pull(allow_stale=True)  # the trainer is gone: what this replica holds, whole
            say(event="trainer-lost", version=have, held=held(tree, steps), why=why)
            rep.leave()
            rejoins += 1
            rep = join(held=(tree, have))  # the new trainer: back under its name, with what it held
            say(event="rejoined", publication=rep.publication.value, version=have)
            version, why = None, ""
            continue
        say(event="pulled", version=version, held=held(tree, steps))
    rep.leave()
    say(event="end", version=version, why=why)


if __name__ == "__main__":
    main()
