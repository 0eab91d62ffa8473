"""A RefitGroup whose source pushes, after a tree that matched its declaration, trees that only look like it:
``refit_stale_body.py source|destination`` under one MPMD mpiexec (one process a side).

A group checks a tree against its declaration in full only when the tree differs from the last one that matched
(its structure, or a leaf's type, shape, dtype or sharding). What that key cannot see is checked every call.

1. version 1, a good tree: published.
2. the same tree, one leaf deleted since (donated by a train step): refused on both sides before anything moves
   (``PeerError`` naming the leaf, at once, not at the timeout); the destination keeps version 1.
3. a tree whose leaf has another dtype (the key differs): checked in full and refused the same way.
4. version 2, a good tree: published, every element checked.
"""

import sys
import time

import numpy as np
from _common import filled_refit, main

SHAPES = {"w": (8, 4), "b": (4,)}
TIMEOUT_S = 30.0


def body() -> dict:
    role = sys.argv[1]
    group, sds, tree = filled_refit(role, SHAPES, TIMEOUT_S)

    import jax.numpy as jnp

    from jreshard.errors import PeerError

    log: dict = {"versions": [], "errors": [], "seconds": []}
    if role == "source":
        group.push(tree(1.0), version=1)
        log["versions"].append(1)
        deleted = tree(9.0)
        deleted["b"].delete()
        cast = tree(9.0)
        cast["w"] = cast["w"].astype(jnp.bfloat16)
        for bad in (deleted, cast):
            t0 = time.monotonic()
            try:
                group.push(bad, version=9)
                log["versions"].append(9)
            except PeerError as err:
                log["errors"].append(str(err))
            log["seconds"].append(time.monotonic() - t0)
        group.push(tree(2.0), version=2)
        log["versions"].append(2)
        group.close()
        return log

    held, v = group.pull(like=sds)
    log["versions"].append(v)
    for _ in range(2):
        t0 = time.monotonic()
        try:
            held, v = group.pull(into=held)
            log["versions"].append(v)
        except PeerError as err:
            log["errors"].append(str(err))
        log["seconds"].append(time.monotonic() - t0)
        log.setdefault("held", []).append(float(held["w"][0, 0]))
    held, v = group.pull(into=held)
    log["versions"].append(v)
    log["exact"] = all(np.array_equal(np.asarray(held[k]), np.full(s, 2.0, np.float32)) for k, s in SHAPES.items())
    group.close()
    return log


if __name__ == "__main__":
    main(f"stale-{sys.argv[1]}", body)
