"""Two RefitGroups one after the other on the same processes (the second made after the first closed):
``refit_twice_body.py source|destination`` under one MPMD mpiexec. The first group's close notices must
never close the second group."""

import sys

import numpy as np
from _common import main, refit_side

SHAPES = {"w": (8, 4)}


def body() -> dict:
    role = sys.argv[1]
    sds = refit_side(role, SHAPES)

    import jax

    from jreshard.options import Options
    from jreshard.refit import RefitGroup

    got = []
    for g in range(3):
        group = RefitGroup(role, sds, options=Options(timeout_s=30.0))
        if role == "source":
            tree = {k: jax.device_put(np.full(s, float(g), np.float32), sds[k].sharding) for k, s in SHAPES.items()}
            group.push(tree, version=g + 1)
        else:
            tree, version = group.pull(like=sds)
            got.append((version, float(np.asarray(tree["w"])[0, 0])))
        group.close()
    return {"got": got}


if __name__ == "__main__":
    main("twice-" + sys.argv[1], body)
