"""MPI cluster set-up: ``jax.distributed`` over MPI processes, and one transport per MPI communicator.

:func:`cluster_comm` is the :class:`~jreshard.mpi.comm.MpiComm` the registry
(:func:`jreshard.call.routes.transfer_multiprocess`) hands the engine across processes. The jax
processes must be the MPI processes of ``comm``
(``MPI.COMM_WORLD`` by default), e.g. started by :func:`initialize` under ``mpiexec``.
"""

from __future__ import annotations

import math
import socket
from contextlib import ExitStack

from jreshard.errors import BackendUnavailableError
from jreshard.mpi.comm import MpiComm, import_mpi
from jreshard.mpi.control import Control
from jreshard.net.ports import reserved_port
from jreshard.options import wait_s
from jreshard.types import MpiCommunicator

__all__ = ["cluster_comm", "initialize"]

_COMMS: dict[int, MpiComm] = {}


def initialize(comm: MpiCommunicator = None, *, port: int | None = None, timeout_s: float = 300.0) -> None:
    """Start ``jax.distributed`` over the processes of an MPI communicator.

    ``comm`` defaults to ``MPI.COMM_WORLD``, where jax's ``mpi4py`` cluster
    detection gives each process the devices of its local rank; a
    sub-communicator (one program of an MPMD launch) makes each program its
    own jax cluster. Process 0 of ``comm`` hosts the coordinator: on ``port``
    if given, else on a free port it keeps reserved until the coordinator has
    bound it, so no other process can take it in between. The coordinator
    address is loopback when every process of ``comm`` runs on one host, else
    process 0's host name. Set the CPU device count with
    ``JAX_NUM_CPU_DEVICES`` before jax starts.

    Every wait is bounded by ``timeout_s`` (jax's own start-up included, as its ``initialization_timeout``).

    Raises:
      TransferTimeoutError: not every process of ``comm`` called it within ``timeout_s`` (one failed or exited
        before it: the message names it where it can); end the launch then.
    """
    import jax

    timeout_s = wait_s(timeout_s, 300.0, "jreshard.mpi.cluster.initialize")
    MPI = import_mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    # (MPI's own collectives would wait for a missing process for good)
    control = Control(comm, timeout_s=timeout_s, what="jreshard.mpi.cluster.initialize")
    try:
        with ExitStack() as held:
            if port is None and comm.Get_rank() == 0:
                port = held.enter_context(reserved_port())  # held until the coordinator has bound it
            got = control.allgather({"host": socket.gethostname(), "port": port}, timeout_s=timeout_s)
            host = coordinator_host([got[p]["host"] for p in sorted(got)])
            address = f"{host}:{got[0]['port']}"
            wait = max(1, math.ceil(timeout_s))
            if comm == MPI.COMM_WORLD:  # jax's mpi4py detection: a GPU per process of a host, by local rank
                jax.distributed.initialize(address, cluster_detection_method="mpi4py", initialization_timeout=wait)
            else:
                jax.distributed.initialize(
                    address, num_processes=comm.Get_size(), process_id=comm.Get_rank(), initialization_timeout=wait
                )
    finally:
        control.close()


def coordinator_host(hosts: list[str]) -> str:
    """Where the processes (host names in rank order) reach the coordinator of process 0."""
    return "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]


def cluster_comm(comm: MpiCommunicator, timeout_s: float = 300.0) -> MpiComm:
    """One MpiComm per MPI communicator, mapping every jax device id to its MPI process.

    The first call for ``comm`` forms it, collectively: every process of ``comm`` must make it (its first
    transfer across processes) within ``timeout_s``.

    Raises:
      TransferTimeoutError: a process of ``comm`` did not (the message names it where it can).
    """
    import jax

    key = id(comm)
    c = _COMMS.get(key)
    if c is not None and c.broken is None:
        return c
    # (MPI's allgather would wait for a missing process for good)
    control = Control(comm, timeout_s=timeout_s, what="the first transfer across processes")
    try:  # MPI rank -> jax process index (set up once)
        got = control.allgather(jax.process_index(), timeout_s=timeout_s)
    finally:
        control.close()
    procs = [got[p] for p in sorted(got)]
    if sorted(procs) != list(range(jax.process_count())) or comm.Get_size() != jax.process_count():
        raise BackendUnavailableError(
            f"transfer across processes: the MPI communicator has {comm.Get_size()} processes with jax process "
            f"indices {procs}, but the jax cluster has {jax.process_count()}; the fix is to start jax.distributed "
            "over the MPI processes (jreshard.mpi.cluster.initialize())"
        )
    mpi_of = {p: i for i, p in enumerate(procs)}
    c = _COMMS[key] = MpiComm(comm, {d.id: mpi_of[d.process_index] for d in jax.devices()}, timeout_s=timeout_s)
    return c
