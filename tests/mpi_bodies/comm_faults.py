"""``mpiexec -n 2 comm_faults.py``: each call MpiComm makes into mpi4py (post a receive, post a send,
test the requests, free the communicator) made to raise ``MPI.Exception`` on process 0, in turn; one
exchange each way per call. Records what each process's caller saw."""

import time

from _common import main

TIMEOUT_S = 1.0


class _Faulty:
    """An mpi4py object whose ``method`` raises ``MPI.Exception``; everything else is the real one's."""

    def __init__(self, real, method, MPI):
        self._real, self._method, self._MPI = real, method, MPI

    def __getattr__(self, name):
        if name == self._method:

            def fail(*a, **k):
                raise self._MPI.Exception(self._MPI.ERR_OTHER)

            return fail
        return getattr(self._real, name)


def body() -> dict:
    import numpy as np
    from mpi4py import MPI

    from jreshard.engine.comm import RecvOp, SendOp
    from jreshard.errors import JReshardError
    from jreshard.mpi.comm import MpiComm

    world = MPI.COMM_WORLD
    me, other = world.Get_rank(), 1 - world.Get_rank()
    says = {"Irecv": "posting the receive", "Isend": "posting the send", "Testsome": "while waiting"}
    out: dict = {"calls": {}}
    for call in ("Irecv", "Isend", "Testsome"):
        world.Barrier()
        comm = MpiComm(world, {0: 0, 1: 1})
        if me == 0:
            if call == "Testsome":
                comm._MPI = _Faulty(MPI, "Request", MPI)  # MPI.Request.Testsome, the wait's poll
                comm._MPI.Request = _Faulty(MPI.Request, "Testsome", MPI)
            else:
                comm._comm = _Faulty(comm._comm, call, MPI)
        got = np.zeros(16, np.uint8)
        t0 = time.monotonic()
        seen = {"says": says[call]}
        try:
            comm.exchange(
                [SendOp(me, other, 7, np.full(16, me + 1, np.uint8))], [RecvOp(other, me, 7, got)], timeout_s=TIMEOUT_S
            )
            seen |= {"type": "ok", "message": ""}
        except JReshardError as err:
            seen |= {"type": type(err).__name__, "message": str(err)}
        seen["seconds"] = time.monotonic() - t0
        seen["broken"] = comm.broken is not None
        try:
            comm.exchange([], [], timeout_s=TIMEOUT_S)
            seen["next"] = "ok"
        except JReshardError as err:
            seen["next"] = f"{type(err).__name__}: {err}"
        out["calls"][call] = seen
        time.sleep(0.1 + TIMEOUT_S if me == 0 else 0.0)  # the peer's bounded wait ends before the next call
    world.Barrier()
    comm = MpiComm(world, {0: 0, 1: 1})
    if me == 0:
        comm._broken = "planted"  # a broken communicator is kept (a dead peer may never answer)
        comm.close()
        comm2 = MpiComm(MPI.COMM_SELF, {0: 0})
        comm2._comm = _Faulty(comm2._comm, "Free", MPI)
        try:
            comm2.close()
            out["closed"] = "ok"
        except Exception as err:
            out["closed"] = f"{type(err).__name__}: {err}"
    else:
        comm.close()
    world.Barrier()
    return out


if __name__ == "__main__":
    main("comm-faults", body)
