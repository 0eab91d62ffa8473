"""``Options(verify=...)`` of a RefitGroup over MPI: ``refit_verify_body.py source|destination on|off|connect
posted|prepared``, ``on``/``off`` under one MPMD mpiexec (one MPI universe: hashes), ``connect`` as two launches
meeting at ``$JRESHARD_ADDRESS`` (the processes share a secret: keyed MACs), both with ``verify=True``. Three
versions; with ``verify`` the destination flips one byte of one message of version 2 as it lands
(tests/_faulty_comm.py: ``posted``, with every group posted afresh; ``prepared``, in the prepared groups, which
replay in the compiled loop where it was built), which both sides must refuse, keeping version 1, and version 3
must then land whole. Each side records what it saw, its digest costs and how many of each version's steps ran
in the compiled replay."""

import os
import sys

import numpy as np
from _common import main, refit_side

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
from _faulty_comm import plant, unplant

SHAPES = {"w": (64, 32), "b": (32,)}


def value(v: int, shape: tuple[int, ...]) -> np.ndarray:
    return (np.arange(np.prod(shape), dtype=np.float32) + 1000 * v).reshape(shape)


def body() -> dict:
    role, mode, path = sys.argv[1], sys.argv[2], sys.argv[3]
    verify = mode in ("on", "connect")
    sds = refit_side(role, SHAPES)

    import jax

    from jreshard.engine import replay
    from jreshard.errors import IntegrityError
    from jreshard.options import Options
    from jreshard.refit import RefitGroup

    # delta="off": the byte is flipped in a full refit's message (a flipped delta encoding can fail to decode
    # before the digests are compared)
    opts = Options(timeout_s=30.0, chunk_bytes=2048, staging_bytes=8192, verify=verify, delta="off")
    if mode == "connect":
        group = RefitGroup.connect(role, sds, address=os.environ["JRESHARD_ADDRESS"], options=opts)
    else:
        group = RefitGroup(role, sds, options=opts)
    seen: list = []
    costs: list = []
    native: list = []  # per version, the steps run in the compiled replay so far on the group's communicator
    held = None
    for v in (1, 2, 3):
        flip = plant(group, nth=2, prepared=path == "prepared") if verify and v == 2 and role == "destination" else None
        try:
            if role == "source":
                tree = {k: jax.device_put(value(v, s), sds[k].sharding) for k, s in SHAPES.items()}
                group.push(tree, version=v)
                seen.append([v, "ok"])
            else:
                tree, got = group.pull(like=sds)
                exact = all(np.array_equal(np.asarray(tree[k]), value(got, s)) for k, s in SHAPES.items())
                held = (tree, got)
                seen.append([got, "ok" if exact else "wrong bytes"])
        except IntegrityError as err:
            seen.append([v, "refused", str(err)])
        finally:
            native.append(sum(r.native_steps for r in replay._by_comm.get(group._comm, {}).values()))
            if flip is not None:
                unplant(group, flip)
        c = group.digest_cost
        costs.append(None if c is None else [c.kind, c.nbytes, c.messages, c.seconds])
        if role == "destination" and held is not None:  # what the server holds after each refit
            tree, got = held
            whole = all(np.array_equal(np.asarray(tree[k]), value(got, s)) for k, s in SHAPES.items())
            seen[-1].append({"holds": got, "whole": whole})
    group.close()
    return {"seen": seen, "costs": costs, "version": group.version, "native": native}


if __name__ == "__main__":
    main("verify-" + sys.argv[1], body)
