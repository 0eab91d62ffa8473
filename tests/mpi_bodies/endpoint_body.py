"""A refit from a JAX trainer into the numpy buffers of a receiver that cannot import jax:
``endpoint_body.py source|destination`` under one MPMD mpiexec (two devices or slots a side).

The trainer holds ``w`` (float32, rows split over its two devices) and ``b`` (float32, replicated); the
receiver (``sys.modules["jax"] = None`` before anything of jreshard is imported) declares ``w`` split by
columns over its two slots and ``b`` as bfloat16 (a cast) in slot 1. Its first pull hands one buffer too
few: refused on both sides, nothing moved, the group usable; then two versions land bit for bit.
"""

import sys

import numpy as np
from _common import main

SHAPE_W, SHAPE_B = (8, 6), (6,)
VERSIONS = (1, 2)


def values(v: int) -> dict[str, np.ndarray]:
    w = (np.arange(48, dtype=np.float32).reshape(SHAPE_W) + 0.25) * (v + 1)
    b = np.linspace(-3.0, 3.0, 6, dtype=np.float32) * v
    return {"['w']": w, "['b']": b}


def source() -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard.errors import PeerError
    from jreshard.options import Options
    from jreshard.refit import RefitGroup

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    rows, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())

    def tree(v: int) -> dict:
        got = values(v)
        return {"w": jax.device_put(got["['w']"], rows), "b": jax.device_put(got["['b']"], rep)}

    group = RefitGroup("source", tree(0), options=Options(timeout_s=30.0))
    refused = ""
    try:
        group.push(tree(1), version=1)
    except PeerError as err:  # the receiver's first pull is refused before anything moves
        refused = str(err)
    for v in VERSIONS:
        group.push(tree(v), version=v)
    group.close()
    return {"refused": refused, "version": group.version}


def destination() -> dict:
    sys.modules["jax"] = None  # any import of jax from here on raises
    import ml_dtypes

    from jreshard.errors import LayoutError
    from jreshard.options import Options
    from jreshard.refit.endpoint import Declaration, Endpoint, Tensor
    from jreshard.sharding.box import Box

    w = Tensor(name="['w']", shape=SHAPE_W, dtype="float32", boxes=((0, Box((0, 0), (8, 3))), (1, Box((0, 3), (8, 6)))))
    b = Tensor(name="['b']", shape=SHAPE_B, dtype="bfloat16", boxes=((1, Box((0,), (6,))),))
    ep = Endpoint(Declaration(tensors=(w, b), slots=2), options=Options(timeout_s=30.0))
    buffers = {
        ("['w']", 0): np.zeros((8, 3), np.float32),
        ("['w']", 1): np.zeros((8, 3), np.float32),
        ("['b']", 1): np.zeros(6, ml_dtypes.bfloat16),
    }
    refused = ""
    try:
        ep.pull({k: v for k, v in buffers.items() if k != ("['b']", 1)})
    except LayoutError as err:
        refused = str(err)
    exact = []
    for v in VERSIONS:
        got = ep.pull(buffers)
        want = values(v)
        exact.append(
            got == v
            and np.array_equal(buffers[("['w']", 0)], want["['w']"][:, :3])
            and np.array_equal(buffers[("['w']", 1)], want["['w']"][:, 3:])
            and np.array_equal(
                buffers[("['b']", 1)].view(np.uint16), want["['b']"].astype(ml_dtypes.bfloat16).view(np.uint16)
            )
        )
    ep.close()
    loaded = sorted(m for m in sys.modules if m == "jaxlib" or m.startswith(("jax.", "jaxlib.")))
    return {
        "refused": refused,
        "exact": exact,
        "version": ep.version,
        "jax_blocked": sys.modules["jax"] is None,
        "loaded": loaded,
    }


def body() -> dict:
    return source() if sys.argv[1] == "source" else destination()


if __name__ == "__main__":
    main("endpoint-" + sys.argv[1], body)
