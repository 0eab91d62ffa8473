"""MPI cluster set-up: ``jax.distributed`` over MPI processes, and one transport per MPI communicator.

:func:`cluster_comm` is the :class:`~jreshard.mpi.comm.MpiComm` the router
(:func:`jreshard.routes.transfer_multiprocess`) hands the engine across processes. The jax
processes must be the MPI processes of ``comm``
(``MPI.COMM_WORLD`` by default), e.g. ``jax.distributed.initialize(cluster_detection_method="mpi4py")``
under ``mpiexec``; :func:`initialize` does that for CPU devices.
"""

from __future__ import annotations

from typing import Any

from jreshard.errors import BackendUnavailableError
from jreshard.mpi.comm import MpiComm, import_mpi

__all__ = ["cluster_comm", "initialize"]

_COMMS: dict[int, MpiComm] = {}


def initialize(comm: Any = None, *, port: int | None = None) -> None:
    """Start ``jax.distributed`` over the processes of an MPI communicator.

    With ``comm`` = ``MPI.COMM_WORLD`` (the default) this is
    ``jax.distributed.initialize(cluster_detection_method="mpi4py")``. For a
    sub-communicator (one program of an MPMD launch), process 0 of ``comm``
    picks a free local port for the coordinator and shares it, so each program
    is its own jax cluster. Set the CPU device count with ``JAX_NUM_CPU_DEVICES``
    before jax starts.
    """
    import jax

    MPI = import_mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm == MPI.COMM_WORLD and port is None:
        jax.distributed.initialize(cluster_detection_method="mpi4py")
        return
    if port is None and comm.Get_rank() == 0:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=comm.Get_size(), process_id=comm.Get_rank()
    )


def cluster_comm(comm: Any) -> MpiComm:
    """One MpiComm per MPI communicator, mapping every jax device id to its MPI process."""
    import jax

    key = id(comm)
    c = _COMMS.get(key)
    if c is not None and c.broken is None:
        return c
    procs = comm.allgather(jax.process_index())  # MPI rank -> jax process index (setup, once)
    if sorted(procs) != list(range(jax.process_count())) or comm.Get_size() != jax.process_count():
        raise BackendUnavailableError(
            f"transfer across processes: the MPI communicator has {comm.Get_size()} processes with jax process "
            f"indices {procs}, but the jax cluster has {jax.process_count()}; the fix is to start jax.distributed "
            "over the MPI processes (jreshard.mpi.cluster.initialize())"
        )
    mpi_of = {p: i for i, p in enumerate(procs)}
    c = _COMMS[key] = MpiComm(comm, {d.id: mpi_of[d.process_index] for d in jax.devices()})
    return c
