"""The MPI transport's record for the registry (:mod:`jreshard.call.routes`).

MPI moves host buffers (device buffers only with a CUDA-aware MPI, which only the caller can vouch
for: ``backend="mpi"`` says so) between the processes of one program, and between two programs
joined by ``RefitGroup.connect``. ``auto`` picks it for CPU devices across processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import ModuleType

from jreshard.engine.record import ImportModule, Opened, Reach, TransportRecord, import_failure
from jreshard.mpi.cluster import cluster_comm
from jreshard.mpi.comm import MpiComm, import_mpi, quiet_ucx
from jreshard.mpi.control import Control
from jreshard.mpi.live import LiveComm
from jreshard.options import Options
from jreshard.sharding.topology import Topology
from jreshard.types import Device, MpiCommunicator

__all__ = ["RECORD", "MpiKit"]

MODULE = "mpi4py.MPI"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MpiKit:
    """What programs form MPI groups from: the communicator, its control plane, the wrapper that never
    posts to a peer known gone, and the MPI module itself."""

    comm: type[MpiComm] = MpiComm
    control: type[Control] = Control
    live: type[LiveComm] = LiveComm
    import_mpi: Callable[[], ModuleType] = import_mpi

    def world(self, timeout_s: float = 300.0) -> MpiComm:
        """The communicator over every process of the jax cluster (``MPI.COMM_WORLD``); formed at the first
        call, by every process within ``timeout_s``."""
        return cluster_comm(import_mpi().COMM_WORLD, timeout_s)

    def cluster(self, comm: MpiCommunicator, timeout_s: float = 300.0) -> MpiComm:
        """The communicator over the processes of the mpi4py communicator ``comm``, which must be the jax
        cluster's (every jax device id mapped to its MPI process); formed as :meth:`world` is."""
        return cluster_comm(comm, timeout_s)


def _probe(import_module: ImportModule) -> str | None:
    with quiet_ucx():  # this import may be the one that loads MPI (and UCX): as import_mpi loads it
        mod, why = import_failure(MODULE, import_module)
    return None if mod is not None else f"importing {MODULE} failed ({why})"


def _open(devices: Mapping[int, Device], single_process: bool, options: Options, topology: Topology | None) -> Opened:
    return Opened(comm=MpiKit().world(options.timeout_s))


RECORD: TransportRecord[MpiKit] = TransportRecord(
    name="mpi",
    summary="MPI sends and receives of host buffers (device buffers with a CUDA-aware MPI)",
    serves=frozenset(Reach),
    auto=frozenset({Reach.CPU_PROCESSES}),
    probe=_probe,
    fix=lambda find_spec: "to install mpi4py and an MPI: pip install 'jreshard[mpi]'",
    open=_open,
    why_auto="the arrays are on CPU devices across processes and mpi4py.MPI imports",
    kit=MpiKit(),
)
