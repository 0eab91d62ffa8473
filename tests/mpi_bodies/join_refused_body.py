"""One MPI launch where the destination side fails before it makes its side of the group (here: a PyTorch
receiver whose tensor has a dtype it refuses, or any error): ``join_refused_body.py source|destination``. The
source must raise :class:`TransferTimeoutError` within its ``timeout_s``, not wait forever in MPI.

``join_refused_body.py initialize|absent``: the same for :func:`jreshard.mpi.cluster.initialize`, which the
``absent`` process never calls."""

import sys
import time

from _common import main

TIMEOUT_S = 4.0


def source() -> dict:
    import jax.numpy as jnp

    from jreshard import Options, RefitGroup, TransferTimeoutError

    t0 = time.monotonic()
    try:
        RefitGroup("source", {"w": jnp.zeros(8)}, options=Options(timeout_s=TIMEOUT_S))
    except TransferTimeoutError as err:
        return {"raised": str(err), "after_s": time.monotonic() - t0}
    return {"raised": None}


def destination() -> dict:
    sys.modules["jax"] = None  # a PyTorch server
    import torch

    from jreshard import Options
    from jreshard.sharding.box import Box
    from jreshard.torch.receiver import Receiver, Shard

    t = torch.zeros(8, dtype=torch.int4)  # a dtype the receiver refuses, before it joins
    try:
        Receiver.over_mpi({"w": Shard(t, (8,), Box((0,), (8,)))}, options=Options(timeout_s=TIMEOUT_S))
    except TypeError as err:
        return {"refused": str(err)}
    return {"refused": None}


def initialize() -> dict:
    from jreshard import TransferTimeoutError
    from jreshard.mpi.cluster import initialize

    t0 = time.monotonic()
    try:
        initialize(timeout_s=TIMEOUT_S)
    except TransferTimeoutError as err:
        return {"raised": str(err), "after_s": time.monotonic() - t0}
    return {"raised": None}


if __name__ == "__main__":
    bodies = {"source": source, "destination": destination, "initialize": initialize}
    if sys.argv[1] == "absent":  # a process of the launch (MPI started) that exits before it calls initialize
        from mpi4py import MPI  # noqa: F401  (starts MPI)

        sys.exit(0)
    main(f"join-{sys.argv[1]}", bodies[sys.argv[1]])
