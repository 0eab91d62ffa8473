"""Shared by the bodies launched under mpiexec: results go to one JSON file per process in
``$JRESHARD_MPI_OUT``, named ``<tag>-<world rank>.json``; a body that fails writes its traceback there too."""

from __future__ import annotations

import glob
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any


def world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def write(tag: str, result: dict[str, Any]) -> None:
    out = os.environ["JRESHARD_MPI_OUT"]
    path = os.path.join(out, f"{tag}-{world_rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def main(tag: str, body: Callable[[], dict[str, Any]], *, hard_exit: bool = False) -> None:
    """Run ``body``; write its result (or the traceback). ``hard_exit`` skips interpreter teardown
    (MPI_Finalize with a dead peer can block)."""
    code = 0
    try:
        result = body()
    except BaseException:
        result = {"error": traceback.format_exc()}
        code = 1
    write(tag, result)
    sys.stdout.flush()
    sys.stderr.flush()
    if hard_exit:
        # Exiting without MPI_Finalize makes the launcher kill the job, and a jax cluster's coordinator
        # (its process 0) leaving ends the others: first wait (bounded) until the processes of this
        # program the test expects have all written their results (this tag's files only: the other
        # program's must not count, or process 0 leaves before its peers have written).
        expect = int(os.environ.get("JRESHARD_EXPECT", "0"))
        deadline = time.monotonic() + 30
        while len(glob.glob(os.path.join(os.environ["JRESHARD_MPI_OUT"], f"{tag}-*.json"))) < expect:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        os._exit(code)
    sys.exit(code)


def refit_side(role: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Join ``role``'s side of an MPMD launch (one jax cluster per side) and declare ``shapes`` as float32
    arrays replicated over the side's devices: ``{name: jax.ShapeDtypeStruct}``."""
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    side = world.Split(0 if role == "source" else 1, world.Get_rank())

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard.mpi.cluster import initialize

    if side.Get_size() > 1:
        initialize(side)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    return {k: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(mesh, P())) for k, s in shapes.items()}


def filled_refit(role: str, shapes: dict[str, tuple[int, ...]], timeout_s: float) -> tuple[Any, dict, Callable]:
    """``(group, sds, tree)``: ``role``'s side of an MPMD launch declaring ``shapes`` (:func:`refit_side`), its
    ``RefitGroup`` with ``timeout_s``, and ``tree(v)``: a tree of the side's arrays with every element ``v``."""
    import jax
    import numpy as np

    from jreshard.options import Options
    from jreshard.refit import RefitGroup

    sds = refit_side(role, shapes)
    group = RefitGroup(role, sds, options=Options(timeout_s=timeout_s))

    def tree(v: float) -> dict:
        return {k: jax.device_put(np.full(s, float(v), np.float32), sds[k].sharding) for k, s in shapes.items()}

    return group, sds, tree


def push_versions(params: Callable[[int], Any], versions: Sequence[int]) -> dict[str, Any]:
    """A source ``RefitGroup`` of ``params(0)`` over the launch that pushes ``params(v)`` as each version ``v``."""
    from jreshard import Options, RefitGroup

    group = RefitGroup("source", params(0), options=Options(timeout_s=60.0))
    for v in versions:
        group.push(params(v), version=v)
    group.close()
    return {"version": group.version}
