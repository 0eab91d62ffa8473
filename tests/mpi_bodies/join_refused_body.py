"""One MPI launch where the destination side fails before it makes its side of the group (here: a PyTorch
receiver whose tensor has a dtype it refuses, or any error): ``join_refused_body.py source|destination``. The
source must raise :class:`TransferTimeoutError` within its ``timeout_s``, not wait forever in MPI."""

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


if __name__ == "__main__":
    main(f"join-{sys.argv[1]}", source if sys.argv[1] == "source" else destination)
