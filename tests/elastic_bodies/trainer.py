"""The trainer program of the elastic tests: ``trainer.py ADDRESS_FILE SCENARIO [CATCH_UP]``.

Prints one JSON line per event on stdout (the test starts replicas when it sees them) and its
results as the last line.
"""

import json
import os
import sys
import time

import jax
import numpy as np
from _model import SHAPES, options, value
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreshard.elastic import ElasticTrainer

STARTUP_S = 60.0  # replicas are separate programs: waiting for them to start includes importing jax


def say(**event):
    print(json.dumps(event), flush=True)


def params(version):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))  # every process's devices
    out = {}
    for k, s in SHAPES.items():
        full = value(k, s, version)
        sharding = NamedSharding(mesh, P("fsdp") if s[0] % 2 == 0 else P())
        out[k] = jax.make_array_from_callback(s, sharding, lambda i, full=full: full[i])
    return out


def follow(address, scenario):
    host = os.environ.get("JRESHARD_HOST", "127.0.0.1")  # the interface it serves its shards on
    tr = ElasticTrainer(params(0), host=host, address_file=address, options=options(), catch_up="peer")
    reports = {}
    for v in {"big": (1, 2, 3, 4, 5)}[scenario]:
        r = tr.push(params(v), version=v)
        reports[v] = {"committed": sorted(r.committed), "lost": sorted(r.lost)}
    tr.close()
    say(event="done", process=jax.process_index(), reports=reports)


def main():
    address, scenario = sys.argv[1], sys.argv[2]
    if "JRESHARD_COORDINATOR" in os.environ:  # one process of a trainer of several: one jax cluster
        jax.distributed.initialize(
            coordinator_address=os.environ["JRESHARD_COORDINATOR"],
            num_processes=int(os.environ["JRESHARD_PROCESSES"]),
            process_id=int(os.environ["JRESHARD_PROCESS"]),
        )
    if jax.process_index() > 0:  # a follower: the same pushes; membership is process 0's
        follow(address, scenario)
        return
    catch_up = sys.argv[3] if len(sys.argv) > 3 else "auto"
    out = {"pushes": {}}
    host = os.environ.get("JRESHARD_HOST", "127.0.0.1")  # the interface to listen on
    tr = ElasticTrainer(params(0), host=host, address_file=address, options=options(), catch_up=catch_up)
    tr.wait(count=1 if scenario in ("multi", "dense") else 2, timeout_s=STARTUP_S)

    def push(v, **kw):
        t0 = time.monotonic()
        r = tr.push(params(v), version=v, **kw)
        if r is not None:
            out["pushes"][v] = {"committed": list(r.committed), "lost": r.lost, "seconds": time.monotonic() - t0}
            out["pushes"][v]["delta"] = {
                n: [d.mode, d.sent_bytes, d.full_bytes, list(d.reasons)] for n, d in r.delta.items()
            }
        say(event="pushed", version=v)

    if scenario == "join":
        for v in (1, 2, 3):
            push(v)
        say(event="join-now")
        out["at3"] = tr.wait(version=3, count=3, timeout_s=STARTUP_S)
        out["joined"] = {n: i.caught_up_from for n, i in tr.replicas().items()}
        for v in (4, 5):
            push(v)
    elif scenario == "kill":
        for v in (1, 2, 3, 4, 5):
            push(v)
        out["after5"] = {n: i.version for n, i in tr.replicas().items()}
        say(event="join-now")
        out["at5"] = tr.wait(version=5, count=2, timeout_s=STARTUP_S)  # the replacement caught up
        out["joined"] = {n: i.caught_up_from for n, i in tr.replicas().items()}
        push(6)
    elif scenario == "leave":
        push(1)
        push(2)
        t0 = time.monotonic()
        while len(tr.replicas()) > 1 and time.monotonic() - t0 < STARTUP_S:  # r2 leaves after version 2
            time.sleep(0.01)
        out["gone"] = {n: i.error for n, i in tr.replicas(include_gone=True).items() if i.error}
        push(3, block=False)
        out["any1"] = tr.wait(version=3, count=1)
        out["all3"] = tr.wait(version=3)
        out["members3"] = sorted(tr.replicas())
        say(event="join-now")
        out["rejoined"] = tr.wait(version=3, count=2, timeout_s=STARTUP_S)
        push(4, block=False)
        out["any1_4"] = tr.wait(version=4, count=1)
        out["all4"] = tr.wait(version=4)
    elif scenario == "big":  # a trainer of 2 processes; r1 stays, r2 leaves after 2, r3 joins at 2 and dies in 4
        push(1)
        push(2)
        t0 = time.monotonic()
        while "r2" in tr.replicas() and time.monotonic() - t0 < STARTUP_S:
            time.sleep(0.01)
        out["gone"] = {n: i.error for n, i in tr.replicas(include_gone=True).items() if i.error}
        say(event="join-now")
        out["at2"] = tr.wait(version=2, count=2, timeout_s=STARTUP_S)
        out["joined"] = {n: i.caught_up_from for n, i in tr.replicas().items()}
        push(3)
        push(4)
        push(5)
    elif scenario == "dense":  # every element changes every version ($JRESHARD_DENSE): delta="auto" backs off
        for v in range(1, 9):
            push(v)
    elif scenario == "multi":  # r2 is two processes; r3 joins and catches up from it
        push(1)
        push(2)
        say(event="join-now")
        out["at2"] = tr.wait(version=2, count=2, timeout_s=STARTUP_S)
        out["joined"] = {n: i.caught_up_from for n, i in tr.replicas().items()}
        push(3)
        say(event="kill-now")  # the test SIGKILLs one process of r2: the whole replica is dropped
        t0 = time.monotonic()
        while "r2" in tr.replicas() and time.monotonic() - t0 < STARTUP_S:
            time.sleep(0.005)
        out["noticed_s"] = time.monotonic() - t0
        out["gone"] = {n: i.error for n, i in tr.replicas(include_gone=True).items() if i.error}
        push(4)
    tr.close()
    say(event="done", **out)


if __name__ == "__main__":
    main()
