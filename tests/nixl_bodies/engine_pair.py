"""The engine over NixlComm between two processes: the MPI test's refit (tests/mpi_bodies/engine_groups.py).

``python engine_pair.py PROCESS ADDRESS_FILE`` (the key in ``$JRESHARD_SECRET``): process 0 listens and
writes its address to ADDRESS_FILE, process 1 connects. Process ``p`` drives the ranks ``r`` with
``r % 2 == p`` of 8, so both send and receive and the fan-out inside a domain crosses processes.
Each checks its destination shards byte for byte against numpy and prints one JSON line: the bytes
it sent by link, its chunks and rounds, and the error of a second exchange with a silent peer.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "mpi_bodies"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/: the schedule oracle

import numpy as np
from engine_groups import case, check, shards_for
from pair_channel import channel
from schedule_oracle import build_schedule

from jreshard.engine.comm import RecvOp
from jreshard.engine.rounds import execute
from jreshard.errors import TransferTimeoutError
from jreshard.net.auth import resolve_secret
from jreshard.nixl import NixlAgent, NixlComm
from jreshard.options import Options


def main() -> None:
    me, address_file = int(sys.argv[1]), sys.argv[2]
    ch = channel(me, address_file, resolve_secret(None))
    ranks = [r for r in range(8) if r % 2 == me]
    plan, pairs, globals_ = case(8)
    options = Options(chunk_bytes=96, staging_bytes=1024, max_group_ops=7, timeout_s=20.0)
    agent = NixlAgent.shared()
    comm = NixlComm(agent, ranks, {r: ch for r in range(8) if r % 2 != me}, timeout_s=20.0)
    shards = shards_for(pairs, globals_, set(ranks))
    stats = execute(build_schedule(plan, options), comm, shards, options=options)
    checked = check(pairs, globals_, shards)
    # process 1 waits for a message process 0 never sends: a timeout naming rank 0
    err, elapsed = None, 0.0
    if me == 1:
        t0 = time.monotonic()
        try:
            comm.exchange([], [RecvOp(0, 1, 99, np.zeros(8, np.uint8))], timeout_s=1.0)
        except TransferTimeoutError as e:
            err = str(e)
        elapsed = time.monotonic() - t0
        ch.send_control({"op": "done"}, timeout_s=5.0)
    else:  # (the silent exchange's post arrives first)
        while ch.recv_control(timeout_s=30.0).get("op") != "done":
            pass
    print(
        json.dumps(
            {
                "process": me,
                "checked": checked,
                "sent": {k.name: v for k, v in stats.sent_bytes.items()},
                "chunks": stats.chunks,
                "rounds": stats.rounds,
                "network": plan.stats().network_bytes,
                "fast": plan.stats().fast_bytes,
                "registered": agent.registered_bytes,
                "timed_out": err,
                "elapsed": elapsed,
            }
        ),
        flush=True,
    )
    ch.close()
    agent.close()


if __name__ == "__main__":
    main()
