"""How many times ``RefitGroup.push`` / ``pull`` flatten the tree they are given:
``refit_flatten_body.py source|destination`` under one MPMD mpiexec.

Every jax.tree_util / jax.tree flattening function is wrapped, in this process, to count the calls that
see the watched tree (by identity) during one push or pull; the group is made before the watch starts.
"""

import collections
import sys

import numpy as np
from _common import main, refit_side

SHAPES = {"w": (8, 4), "b": (4,)}
FLATTENERS = ("tree_flatten", "tree_leaves", "tree_flatten_with_path", "tree_leaves_with_path", "tree_structure")


def watch(jax, seen, watched):
    def wrap(fn):
        def counting(tree, *args, **kwargs):
            if id(tree) in watched:
                seen[id(tree)] += 1
            return fn(tree, *args, **kwargs)

        return counting

    for name in FLATTENERS:
        setattr(jax.tree_util, name, wrap(getattr(jax.tree_util, name)))
    for name in ("flatten", "leaves", "flatten_with_path", "leaves_with_path", "structure"):
        setattr(jax.tree, name, wrap(getattr(jax.tree, name)))


def body() -> dict:
    role = sys.argv[1]
    sds = refit_side(role, SHAPES)

    import jax

    from jreshard.options import Options
    from jreshard.refit import RefitGroup

    group = RefitGroup(role, sds, options=Options(timeout_s=30.0))
    seen: collections.Counter = collections.Counter()
    if role == "source":
        tree = {k: jax.device_put(np.full(s, 3.0, np.float32), sds[k].sharding) for k, s in SHAPES.items()}
        watch(jax, seen, {id(tree)})
        group.push(tree, version=1)
        value = None
    else:
        tree = sds
        watch(jax, seen, {id(tree)})
        out, _ = group.pull(like=tree)
        value = float(np.asarray(out["w"])[0, 0])
    group.close()
    return {"flattenings": seen[id(tree)], "value": value}


if __name__ == "__main__":
    main("flatten-" + sys.argv[1], body)
