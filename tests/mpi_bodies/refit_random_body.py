"""One side of a refit between two programs (``mpiexec -n 1 ... source : -n 1 ... destination``) of a tree of
random leaves: every dtype a refit moves, shapes of rank 0-3 with sizes of 0 and more, each side's own random
sharding over its devices (one device, or a mesh over 1, 2 or 4 of them in any order), some float leaves cast
on the destination. Two versions; the destination checks every shard's bits against the host values (a cast:
against jax's ``astype``). ``refit_random_body.py source|destination SEED LEAVES [verify] [x64] [delta] [async]
[into]`` (``x64``: with ``jax_enable_x64``, the 64-bit dtypes too; ``delta``: ``Options(delta="on")`` and three
versions, each changing a random tenth of the elements of the one before; ``async``: the destination pulls with
``pull_async`` and flips; ``into``: it pulls ``into=`` the arrays it holds; ``nixl``: the two form their group over
NIXL, ``RefitGroup.connect`` at an address file in ``$JRESHARD_MPI_OUT``, rather than over the launch's MPI).
"""

import dataclasses
import os
import random
import sys
from pathlib import Path

import numpy as np
from _common import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for random_trees
from random_trees import CASTS, mismatches
from random_trees import dtype as _dtype
from random_trees import sharding as _sharding
from random_trees import values as _values

DTYPES = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "bfloat16", "float32", "complex64",
    "float8_e4m3fn", "float8_e5m2", "float8_e3m4", "float8_e8m0fnu",
]  # fmt: skip


def body() -> dict:
    import jax

    from jreshard.options import Options
    from jreshard.refit import RefitGroup

    role, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dtypes = DTYPES
    if "x64" in sys.argv[4:]:
        jax.config.update("jax_enable_x64", True)
        dtypes = [*DTYPES, "float64", "complex128", "int64", "uint64"]
    devs = np.array(jax.devices())
    r = random.Random(seed)  # both programs draw the same cases
    leaves = []
    for i in range(count):
        dtype = r.choice(dtypes)
        shape = tuple(r.choice([0, 1, 2, 3, 4, 6, 8, 12]) for _ in range(r.choice([0, 1, 2, 2, 3])))
        wire = r.choice(CASTS) if dtype in CASTS and r.random() < 0.3 else dtype
        leaves.append((f"l{i}", shape, dtype, wire, _sharding(r, devs, shape), _sharding(r, devs, shape)))
    flags = set(sys.argv[4:])
    delta = "delta" in flags
    opts = Options(timeout_s=60.0, verify="verify" in flags, **({"delta": "on"} if delta else {}))
    if "nixl" in flags:
        opts = dataclasses.replace(opts, secret=b"refit-random-nixl-key-0123456789")
    if role == "source":
        tree = {n: jax.device_put(_values(n, s, dt, 0, delta), src) for n, s, dt, _, src, _ in leaves}
    else:  # some leaves declared weakly typed: their arrays come back so
        weak = random.Random(seed + 1000)
        tree = {
            n: jax.ShapeDtypeStruct(s, _dtype(w), sharding=dst, weak_type=weak.random() < 0.3)
            for n, s, _, w, _, dst in leaves
        }
    if "nixl" in flags:
        address = os.path.join(os.environ["JRESHARD_MPI_OUT"], "address")
        group = RefitGroup.connect(role, tree, address=address, transport="nixl", options=opts)
    else:
        group = RefitGroup(role, tree, options=opts)
    bad: list[str] = []
    held = None
    modes: list[str] = []  # the source's delta report of each version: full or delta
    for version in (1, 2, 3) if delta else (1, 2):
        if role == "source":
            group.push(
                {n: jax.device_put(_values(n, s, dt, version, delta), src) for n, s, dt, _, src, _ in leaves},
                version=version,
            )
            rep = group.delta_report
            modes.append(rep.mode if rep is not None else "none")
            continue
        where = {"into": held} if "into" in flags and held is not None else {"like": tree}
        if "async" in flags:
            out, got_version = group.pull_async(**where).result()
        else:
            out, got_version = group.pull(**where)
        held = out
        assert got_version == version
        bad += mismatches(
            out, [(n, s, dt, w, dst, tree[n].weak_type) for n, s, dt, w, _, dst in leaves], version, delta
        )
    group.close()
    return {"leaves": count, "bad": bad, "version": group.version, "modes": modes}


if __name__ == "__main__":
    main(f"random-{sys.argv[1]}", body)
