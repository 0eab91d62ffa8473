"""Prepared groups over NixlComm between two processes (the MPI test's refit, tests/mpi_bodies/engine_groups.py).

``python prepared_pair.py PROCESS ADDRESS_FILE MODE`` (the key in ``$JRESHARD_SECRET``), set up as
``engine_pair.py``. Modes:

- ``steps``: six steps prepared, then six per operation (``NixlComm.prepares`` off), each with the source
  bytes changed (xor the step) and, at steps 4 to 6, fresh destination arrays (the receive buffers move).
  Prints one JSON line: per step the SHA-256 of the destination shards, the bytes checked against numpy,
  and the prepared groups' counters (descriptor posts, WRITE handles made, registrations held).
- ``kill``: one prepared step, then process 1 SIGKILLs itself in the middle of the second; process 0
  prints what it raised and how long it took.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "mpi_bodies"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: the schedule oracle

import numpy as np
from engine_groups import case, check, shards_for
from pair_channel import channel
from schedule_oracle import build_schedule

from jreshard.engine import replay
from jreshard.engine.rounds import execute
from jreshard.errors import PeerError, TransferTimeoutError
from jreshard.net.auth import resolve_secret
from jreshard.nixl import NixlAgent, NixlComm
from jreshard.options import Options


def prepared_of(comm):
    return [r.prepared for r in replay._by_comm.get(comm, {}).values() if r.prepared is not None]


def main() -> None:
    me, address_file, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    ch = channel(me, address_file, resolve_secret(None))
    ranks = [r for r in range(8) if r % 2 == me]
    plan, pairs, globals_ = case(8)
    options = Options(chunk_bytes=96, staging_bytes=1024, max_group_ops=7, timeout_s=20.0)
    schedule = build_schedule(plan, options)
    agent = NixlAgent.shared()
    out: dict = {"process": me}

    def step(comm, s: int, shards):
        data = [(g.view(np.uint8) ^ np.uint8(s)).view(g.dtype).reshape(g.shape) for g in globals_]
        fresh = shards_for(pairs, data, set(ranks))
        if shards is None:
            shards = fresh
        else:  # same destination arrays (same addresses), new source bytes
            for k, v in fresh.src.items():
                shards.src[k][:] = v
        execute(schedule, comm, shards, options=options)
        digest = hashlib.sha256(b"".join(shards.dst[k].tobytes() for k in sorted(shards.dst))).hexdigest()
        return shards, digest, check(pairs, data, shards)

    if mode == "steps":
        for name, prepares in (("prepared", True), ("per_op", False)):
            comm = NixlComm(agent, ranks, {r: ch for r in range(8) if r % 2 != me}, timeout_s=20.0)
            comm.prepares = prepares
            shards, rows = None, []
            for s in range(1, 7):
                shards, digest, checked = step(comm, s, None if s >= 4 else shards)
                counters = [(p.posts, p.prepped, len({k for k in p._keys if k})) for p in prepared_of(comm)]
                rows.append({"digest": digest, "checked": checked, "counters": counters})
            out[name] = rows
            out[name + "_rows_steps"] = sum(r.rows_steps for r in replay._by_comm.get(comm, {}).values())
            comm.close()
            ch.send_control({"op": "phase"}, timeout_s=20.0)  # both done before the next communicator posts
            ch.recv_control(timeout_s=60.0)
    else:  # kill
        comm = NixlComm(agent, ranks, {r: ch for r in range(8) if r % 2 != me}, timeout_s=20.0)
        comm.prepares = True  # whatever the environment says
        shards, _, checked = step(comm, 1, None)
        out["checked"] = checked
        if me == 1:
            (prep,) = prepared_of(comm)
            waits = [0]
            inner = prep.wait

            def dying(g):
                waits[0] += 1
                if waits[0] == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                inner(g)

            prep.wait = dying
        t0 = time.monotonic()
        try:
            step(comm, 2, shards)
            out["error"] = None
        except (PeerError, TransferTimeoutError) as err:
            out["error"] = f"{type(err).__name__}: {err}"
        out["seconds"] = time.monotonic() - t0
        out["broken"] = comm.broken is not None
        try:
            step(comm, 3, shards)
        except PeerError as err:
            out["after"] = str(err)
    print(json.dumps(out), flush=True)
    ch.close()
    agent.close()


if __name__ == "__main__":
    main()
