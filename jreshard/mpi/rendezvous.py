"""The NCCL unique id (or any one value) shared among the processes of an MPI launch, every wait bounded."""

from __future__ import annotations

from jreshard.engine.comm import Rendezvous
from jreshard.errors import BackendUnavailableError, PeerError
from jreshard.mpi.control import Control
from jreshard.types import MpiCommunicator

__all__ = ["MpiRendezvous"]


class MpiRendezvous(Rendezvous):
    """Over an mpi4py communicator: an all-to-all exchange of every process's value, bounded by ``timeout_s``
    (a :class:`~jreshard.mpi.control.Control`: MPI's own collectives cannot time out) (final). For
    :class:`~jreshard.nccl.cupy_nccl.NcclComm` under ``mpiexec``.

    Args:
      comm: an mpi4py communicator spanning every process of the group
        (``mpi4py.MPI.COMM_WORLD`` by default, imported when first needed).
    """

    __slots__ = ("_comm",)

    def __init__(self, comm: MpiCommunicator = None):
        if comm is None:
            try:
                from mpi4py import MPI
            except ImportError as err:
                raise BackendUnavailableError(
                    f"MpiRendezvous: mpi4py does not import ({err}); the fix is pip install 'jreshard[mpi]'"
                ) from err
            comm = MPI.COMM_WORLD
        self._comm = comm

    def share(self, key: str, value: bytes | None, *, timeout_s: float) -> bytes:
        control = Control(self._comm, timeout_s=timeout_s, what=f"rendezvous {key!r}")
        try:
            got = control.allgather(None if value is None else bytes(value), timeout_s=timeout_s)
        finally:
            control.close()
        values = [got[p] for p in sorted(got)]
        made = [i for i, v in enumerate(values) if v is not None]
        if len(made) != 1:
            raise PeerError(
                f"rendezvous {key!r}: MPI processes {made} supplied a value; exactly one must "
                f"(the one that drives NCCL rank 0)",
                destination_intact=True,
            )
        return values[made[0]]
