"""One MPI launch where the destination side fails before it makes its side of the group (here: a PyTorch
receiver whose tensor has a dtype it refuses, or any error): ``join_refused_body.py source|destination``. The
source must raise :class:`TransferTimeoutError` within its ``timeout_s``, not wait forever in MPI.

``join_refused_body.py initialize|absent``: the same for :func:`jreshard.mpi.cluster.initialize`, which the
``absent`` process never calls. ``join_refused_body.py transfer|idle``: a multi-controller cluster whose ``idle``
process never makes the first transfer across processes (it waits, then exits). ``join_refused_body.py
mpicomm|duplicates``: an ``MpiComm`` whose other process duplicates the communicator with it, then never
takes part in what MpiComm agrees next (each process's host and cores)."""

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


def transfer() -> dict:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import Options, TransferTimeoutError
    from jreshard.call.routes import transfer_multiprocess
    from jreshard.mpi.cluster import initialize

    initialize(timeout_s=60.0)
    devs = jax.devices()
    one, other = (NamedSharding(jax.sharding.Mesh(np.array(d), ("a",)), P("a")) for d in (devs[:1], devs[1:]))
    x = jax.make_array_from_callback((8,), one, lambda idx: np.arange(8, dtype=np.float32)[idx])
    t0 = time.monotonic()
    try:
        transfer_multiprocess(x, other, options=Options(timeout_s=TIMEOUT_S))
    except TransferTimeoutError as err:
        return {"raised": str(err), "after_s": time.monotonic() - t0}
    return {"raised": None}


def idle() -> dict:
    import jax

    from jreshard.mpi.cluster import initialize

    initialize(timeout_s=60.0)
    jax.devices()  # the cluster's CPU client forms with every process's
    time.sleep(3 * TIMEOUT_S)  # never calls the transfer; the other process must give up first
    return {}


def mpicomm() -> dict:
    from mpi4py import MPI

    from jreshard import TransferTimeoutError
    from jreshard.mpi.comm import MpiComm

    t0 = time.monotonic()
    try:
        MpiComm(MPI.COMM_WORLD, {0: 0, 1: 1}, timeout_s=TIMEOUT_S)
    except TransferTimeoutError as err:
        return {"raised": str(err), "after_s": time.monotonic() - t0}
    return {"raised": None}


def duplicates() -> dict:
    from mpi4py import MPI

    from jreshard.mpi.comm import dup_within

    dup_within(MPI.COMM_WORLD, 60.0, "the test's duplicate")  # MpiComm's first step, with the other process
    time.sleep(3 * TIMEOUT_S)  # then nothing: the other process must give up first
    return {}


if __name__ == "__main__":
    bodies = {
        "source": source,
        "destination": destination,
        "initialize": initialize,
        "transfer": transfer,
        "idle": idle,
        "mpicomm": mpicomm,
        "duplicates": duplicates,
    }
    if sys.argv[1] == "absent":  # a process of the launch (MPI started) that exits before it calls initialize
        from mpi4py import MPI  # noqa: F401  (starts MPI)

        sys.exit(0)
    main(f"join-{sys.argv[1]}", bodies[sys.argv[1]])
