"""A WRITE given up while its receiver is stopped: ``python given_up_write.py PROCESS ADDRESS_FILE MIB``.

Process 1 posts a receive of MIB MiB from process 0 and is SIGSTOPped by process 0 once its post has
arrived. Process 0's exchange times out with its WRITE still running (UCX over TCP: the stopped receiver
reads nothing, so the WRITE cannot finish), drops its send buffer and registers another one (which
releases the registrations of dead buffers), continues process 1, and makes progress until NIXL has
finished the WRITE it gave up. Process 1, continued, fails its exchange and makes progress until the
late bytes have landed in the buffer it abandoned. Each prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time

import numpy as np
from pair_channel import channel

from jreshard.engine.comm import RecvOp, SendOp
from jreshard.errors import JReshardError
from jreshard.net.auth import resolve_secret
from jreshard.nixl import NixlAgent, NixlComm

FILL = 5


def wait_for(what: str, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"given_up_write: no {what} within {timeout_s} s")
        time.sleep(0.001)


def main() -> None:
    me, address_file, nbytes = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]) << 20
    ch = channel(me, address_file, resolve_secret(None))
    agent = NixlAgent(host="127.0.0.1")
    comm = NixlComm(agent, [me], {1 - me: ch}, timeout_s=20.0)
    out: dict = {}
    if me == 1:
        ch.send_control({"op": "test.pid", "pid": os.getpid()}, timeout_s=10.0)
        buf = np.zeros(nbytes, np.uint8)
        try:
            comm.exchange([], [RecvOp(0, 1, 7, buf)], timeout_s=2.0)  # stopped in here, past the timeout
        except JReshardError as err:
            out["error"] = type(err).__name__

        def landed() -> bool:
            agent.arrived(set())  # progress: the WRITE given up goes on
            return bool(buf[-1] == FILL) and bool((buf == FILL).all())

        wait_for("late WRITE", landed)
        out["late_write_landed"] = True
    else:
        got: list = []

        def pid() -> bool:
            ch.pump()
            got.extend(ch.take({"test.pid"}))
            return bool(got)

        wait_for("pid", pid)
        wait_for("post", lambda: ch.pump() or any(m.get("op") == "nixl.post" for m in ch.inbox))
        os.kill(got[0]["pid"], signal.SIGSTOP)
        try:
            sbuf = np.full(nbytes, FILL, np.uint8)
            try:
                comm.exchange([SendOp(0, 1, 7, sbuf)], [], timeout_s=1.0)
            except JReshardError as err:
                out["error"] = type(err).__name__
            out["unfinished"] = agent.unfinished
            del sbuf
            gc.collect()  # the buffer the WRITE reads is dropped by its owner ...
            agent.region(np.ones(4096, np.uint8))  # ... and dead buffers' registrations are released here
            out["registered_while_unfinished"] = agent.registered_bytes
        finally:
            os.kill(got[0]["pid"], signal.SIGCONT)
        wait_for("the WRITE given up to finish", lambda: agent.unfinished == 0)
        out["registered_after"] = agent.registered_bytes
    agent.close()
    ch.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
