"""A RefitGroup whose source side closes after two versions while the destination pulls a third:
``refit_close_body.py source|destination`` under one MPMD mpiexec. The destination records how long
its third pull took to fail (it should raise at once, not after ``timeout_s``)."""

import sys
import time

import numpy as np
from _common import filled_refit, main

SHAPES = {"w": (8, 4), "b": (4,)}
TIMEOUT_S = 30.0


def body() -> dict:
    role = sys.argv[1]
    group, sds, tree = filled_refit(role, SHAPES, TIMEOUT_S)

    from jreshard.errors import PeerError

    log: dict = {"versions": []}
    if role == "source":
        for v in (1, 2):
            group.push(tree(v), version=v)
            log["versions"].append(v)
        group.close()
        return log
    for _ in (1, 2):
        tree, v = group.pull(like=sds)
        assert float(np.asarray(tree["w"])[0, 0]) == v
        log["versions"].append(v)
    t0 = time.monotonic()
    try:
        group.pull(like=sds)
    except PeerError as err:
        log["error"] = str(err)
    log["elapsed"] = time.monotonic() - t0
    log["version"] = group.version
    group.close()
    return log


if __name__ == "__main__":
    main(f"close-{sys.argv[1]}", body)
