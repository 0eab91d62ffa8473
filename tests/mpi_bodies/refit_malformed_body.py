"""A RefitGroup whose destination process sends one message that cannot be what it claims:
``refit_malformed_body.py source|destination declaration|begin|commit`` under one MPMD mpiexec.

- ``declaration``: the destination declares ``["not", "a", "declaration"]``; both constructors must raise
  ``PeerError`` naming process 1.
- ``begin``: version 1 goes through, then the destination's begin vote of version 2 is a list; both sides must
  raise ``PeerError`` before any byte moves, the destination still on version 1, and the group refuses a third
  refit (broken).
- ``commit``: version 1 goes through, then the destination's commit vote of version 2 has no ``error`` string;
  both sides must raise ``PeerError`` and the destination keep version 1.

The destination's vote is swapped on its way into the group's ``allgather``, so every process (itself included)
gathers the same malformed vote, as from a peer that sends it to all."""

import sys

import numpy as np
from _common import main, refit_side

SHAPES = {"w": (8, 4), "b": (4,)}
TIMEOUT_S = 30.0


def body() -> dict:
    role, mode = sys.argv[1], sys.argv[2]
    sds = refit_side(role, SHAPES)

    import jax

    import jreshard.refit.group as group_module
    from jreshard.errors import PeerError
    from jreshard.options import Options
    from jreshard.refit import RefitGroup

    log: dict = {"versions": []}
    if mode == "declaration" and role == "destination":
        group_module.declare_local = lambda *a, **k: ["not", "a", "declaration"]
    try:
        group = RefitGroup(role, sds, options=Options(timeout_s=TIMEOUT_S))
    except PeerError as err:
        log["error"] = f"{type(err).__name__}: {err}"
        return log

    def tree(v: int) -> dict:
        return {k: jax.device_put(np.full(s, float(v), np.float32), sds[k].sharding) for k, s in SHAPES.items()}

    if role == "source":
        group.push(tree(1), version=1)
        log["versions"].append(1)
        try:
            group.push(tree(2), version=2)
            log["versions"].append(2)
        except PeerError as err:
            log["error"] = f"{type(err).__name__}: {err}"
        if mode == "begin":
            try:
                group.push(tree(3), version=3)
            except PeerError as err:
                log["third"] = str(err)
        group.close()
        return log

    held, v = group.pull(like=sds)
    log["versions"].append(v)
    real = group._control.allgather
    is_mine = (lambda obj: "role" in obj) if mode == "begin" else (lambda obj: "role" not in obj)

    def swapped(obj, **kw):
        if is_mine(obj):
            obj = ["a", "list"] if mode == "begin" else {"digests": None}
        return real(obj, **kw)

    group._control.allgather = swapped
    try:
        _, v = group.pull(like=sds)
        log["versions"].append(v)
    except PeerError as err:
        log["error"] = f"{type(err).__name__}: {err}"
    group._control.allgather = real
    log["version"] = group.version
    log["held"] = float(np.asarray(held["w"])[0, 0])
    if mode == "begin":
        try:
            group.pull(like=sds)
        except PeerError as err:
            log["third"] = str(err)
    group.close()
    return log


if __name__ == "__main__":
    main(f"malformed-{sys.argv[2]}-{sys.argv[1]}", body)
