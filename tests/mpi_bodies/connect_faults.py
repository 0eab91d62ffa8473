"""One side of two MPI launches joined by ``RefitGroup.connect(address=FILE)``, for the fault tests.

Usage: ``connect_faults.py source|destination MODE``, the address file in ``$JRESHARD_ADDRESS``,
``timeout_s`` in ``$JRESHARD_TIMEOUT``, versions ``$JRESHARD_FIRST`` (default 1) to ``$JRESHARD_STEPS``
(default 4). Modes:

- ``alone``: connect with no peer coming; records the error and how long it took.
- ``ok``: refit every version (a destination checks every byte of each against the version).
- ``die:V``: as ``ok``, but this process SIGKILLs itself in the data phase of version V.
- ``vanish``: SIGKILL itself after the MPI port name went round, before its side of the MPI connect.
- ``again``: as ``ok``; when a refit fails (its peer died), the group is closed and this process connects
  again at the same address and goes on from the version that failed.

jreshard is imported before mpi4py. Each process exits through the interpreter (MPI_Finalize included).
"""

import os
import signal
import sys
import time

import numpy as np
from _common import main

import jreshard  # noqa: F401 - before mpi4py

SHAPE = (64, 16)


def value(version: int) -> np.ndarray:
    return (np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) + 1000 * version).astype(np.float32)


def body() -> dict:
    role, mode = sys.argv[1], sys.argv[2]
    address = os.environ["JRESHARD_ADDRESS"]
    timeout = float(os.environ.get("JRESHARD_TIMEOUT", "10"))
    steps = int(os.environ.get("JRESHARD_STEPS", "4"))

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard.errors import JReshardError, TransferError, TransferTimeoutError
    from jreshard.options import Options
    from jreshard.refit import RefitGroup

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sds = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=NamedSharding(mesh, P()))}
    opts = Options(timeout_s=timeout, chunk_bytes=512, staging_bytes=1 << 16)
    log: dict = {"versions": [], "failures": []}
    t0 = time.monotonic()
    if mode == "alone":
        try:
            RefitGroup.connect(role, sds, address=address, options=opts)
            log["error"] = "connected to nobody?"
        except JReshardError as err:
            log["raised"] = f"{type(err).__name__}: {err}"
        except ValueError as err:
            log["raised"] = f"ValueError: {err}"
        log["elapsed"] = time.monotonic() - t0
        return log
    die = int(mode.split(":")[1]) if mode.startswith("die:") else None
    if mode == "vanish":  # SIGKILL itself once the port name went round, before its side of the MPI connect
        from jreshard.nixl.group import ProcessGroup

        real = ProcessGroup.allgather

        def once(self, obj, **kw):
            out = real(self, obj, **kw)
            if isinstance(obj, dict) and "port" in obj:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        ProcessGroup.allgather = once
    group = RefitGroup.connect(role, sds, address=address, options=opts)
    current = None
    v = int(os.environ.get("JRESHARD_FIRST", "1"))
    while v <= steps:
        if die == v:  # die at the first post of this version's data, however the engine posts it
            from jreshard.engine import replay

            def dying(*a, **k):
                os.kill(os.getpid(), signal.SIGKILL)

            group._comm.exchange = group._comm.start_rows = group._comm.exchange_rows = dying
            group._comm.exchange_sized = dying  # a delta refit's groups (deltas are on between programs)
            replay.release(group._comm)  # a prepared refit starts its groups itself: re-prepared, from Python
            prepare = group._comm.prepare

            def prepared(groups, prepare=prepare):
                p = prepare(groups)
                if p is not None:
                    p.native = None
                    p.start = dying
                return p

            group._comm.prepare = prepared
        t0 = time.monotonic()
        try:
            if role == "source":
                group.push({"w": jax.device_put(value(v), sds["w"].sharding)}, version=v)
            else:
                new, got = group.pull(like=sds)
                assert got == v, (got, v)
                assert np.array_equal(np.asarray(new["w"]), value(v)), v  # every byte, this version only
                current = new
        except TransferError as err:
            failed = {"version": v, "error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - t0}
            failed["intact"] = err.destination_intact
            if current is not None:  # the previous version, untouched
                failed["previous_exact"] = bool(np.array_equal(np.asarray(current["w"]), value(v - 1)))
            log["failures"].append(failed)
            group.close()
            if mode != "again" or len(log["failures"]) > 1:
                return log
            deadline = time.monotonic() + 60  # a new peer: a program still starting (its own timeout_s each try)
            while True:
                try:
                    group = RefitGroup.connect(role, sds, address=address, options=opts)
                    break
                except TransferTimeoutError:
                    if time.monotonic() > deadline:
                        raise
            continue
        log["versions"].append(v)
        v += 1
    group.close()
    return log


if __name__ == "__main__":
    main(f"faults-{sys.argv[1]}-{sys.argv[2].replace(':', '')}", body)
