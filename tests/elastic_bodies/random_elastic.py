"""Elastic refits of a random tree between separate programs: ``random_elastic.py trainer ADDRESS SEED CATCH_UP``
and ``random_elastic.py replica ADDRESS SEED NAME`` (4 CPU devices each, ``JAX_NUM_CPU_DEVICES``).

Every program draws the same leaves from ``SEED``: every dtype a refit moves, shapes of rank 0-3 with sizes of 0,
the trainer's own random sharding and the replicas' own (one declaration for all of them, some float leaves cast,
some declared weakly typed, so any replica may serve a joiner). The trainer waits for two replicas, pushes versions
1 and 2, says ``join-now`` and waits for three replicas at version 2, then pushes 3 and 4 and closes; every version
changes a tenth of the elements of the one before (deltas go between programs). Each replica pulls until the
trainer closes and checks every shard of every version it holds against the host values (a cast: against jax's
``astype``) and each array's weak type. One JSON line per event on stdout, the results last.
"""

import json
import random
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for random_trees
from random_trees import CASTS, REFIT_DTYPES, mismatches
from random_trees import dtype as _dtype
from random_trees import sharding as _sharding
from random_trees import values as _values

from jreshard import Options
from jreshard.elastic import ElasticReplica, ElasticTrainer
from jreshard.errors import PeerError

STARTUP_S = 60.0  # the replicas are programs of their own: waiting for them includes importing jax


def leaves(seed: int) -> list[tuple]:
    """``(name, shape, dtype, wire, trainer sharding, replica sharding, weak)`` of every leaf."""
    devs = np.array(jax.devices())
    r = random.Random(seed)
    out = []
    for i in range(r.randint(6, 12)):
        shape = tuple(r.choice([0, 1, 2, 3, 4, 6, 8, 16]) for _ in range(r.randint(0, 3)))
        dtype = r.choice(REFIT_DTYPES)
        wire = r.choice(CASTS) if _dtype(dtype).kind == "f" and r.random() < 0.3 else dtype
        out.append(
            (f"l{i}", shape, dtype, wire, _sharding(r, devs, shape), _sharding(r, devs, shape), r.random() < 0.3)
        )
    return out


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def trainer(address: str, seed: int, catch_up: str) -> None:
    tree = leaves(seed)

    def params(v: int) -> dict:
        return {n: jax.device_put(_values(n, s, d, v, True), src) for n, s, d, _, src, _, _ in tree}

    tr = ElasticTrainer(params(0), address_file=address, options=Options(timeout_s=20.0), catch_up=catch_up)
    tr.wait(count=2, timeout_s=STARTUP_S)
    pushes = {}
    for v in (1, 2, 3, 4):
        if v == 3:
            say(event="join-now")
            tr.wait(version=2, count=3, timeout_s=STARTUP_S)
        r = tr.push(params(v), version=v)
        pushes[v] = {"committed": sorted(r.committed), "lost": sorted(r.lost)}
    joined = {n: i.caught_up_from for n, i in tr.replicas().items()}
    tr.close()
    say(pushes=pushes, joined=joined)


def replica(address: str, seed: int, name: str) -> None:
    tree = leaves(seed)
    like = {n: jax.ShapeDtypeStruct(s, _dtype(w), sharding=dst, weak_type=weak) for n, s, _, w, _, dst, weak in tree}
    rep = ElasticReplica(like, address, name=name, options=Options(timeout_s=20.0))
    checked, bad, version, end = [], [], None, ""
    while True:
        try:
            got, version = rep.pull(newer_than=version, timeout_s=60.0)
        except PeerError as err:
            end = str(err)[:300]
            break
        specs = [(n, shape, dtype, wire, dst, weak) for n, shape, dtype, wire, _, dst, weak in tree]
        bad += mismatches(got, specs, version, True)
        checked.append(version)
    arrivals = [[a.version, a.source] for a in rep.arrivals]
    say(name=name, checked=checked, bad=bad[:10], arrivals=arrivals, end=end)


if __name__ == "__main__":
    role, address, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "trainer":
        trainer(address, seed, sys.argv[4])
    else:
        replica(address, seed, sys.argv[4])
