"""The NCCL transport's record for the registry (:mod:`jreshard.call.routes`).

NCCL moves CUDA device buffers between GPUs, in one process (an in-process rendezvous) or across
the processes of a ``jax.distributed`` cluster (the unique id shared through the cluster's key-value
store; every process calls). ``auto`` picks it for GPUs across processes; its buffers are the
device layer's (:class:`~jreshard.cuda.buffers.CupyBuffers`, through ``NcclComm.buffers``). Not run
on GPU.
"""

from __future__ import annotations

from collections.abc import Mapping

from jreshard.engine.record import FindSpec, ImportModule, Opened, Reach, TransportRecord, import_failure
from jreshard.errors import BackendUnavailableError, cuda_extra
from jreshard.options import Options
from jreshard.sharding.topology import Topology
from jreshard.types import Device

__all__ = ["RECORD"]

MODULE = "cupy.cuda.nccl"
NAMESPACE = "jreshard.transfer"


def _probe(import_module: ImportModule) -> str | None:
    mod, said = import_failure(MODULE, import_module)
    if mod is None:
        return f"importing {MODULE} failed ({said})"
    if mod.available is not True:  # cupy.cuda.nccl imports without libnccl and declares it here
        return f"{MODULE}.available is False ({said or 'libnccl was not loaded'})"
    return None


def _fix(find_spec: FindSpec) -> str:
    return f"to install CuPy with NCCL: {cuda_extra(find_spec)}"


def _open(devices: Mapping[int, Device], single_process: bool, options: Options, topology: Topology | None) -> Opened:
    """An ``NcclComm`` over the GPUs of this process that take part, and its stream-ordered buffers (one
    host wait, at the end). Not run on GPU."""
    import jax

    from jreshard.nccl.cupy_nccl import NcclComm
    from jreshard.nccl.rendezvous import KeyValueRendezvous

    here = jax.process_index()
    mine = devices if single_process else {r: d for r, d in devices.items() if d.process_index == here}
    if not mine:
        raise BackendUnavailableError(
            f"backend 'nccl': process {here} holds none of the {len(devices)} devices of this transfer, "
            "and an NCCL communicator needs at least one; the fix is to call transfer only on the processes "
            "that take part, or backend='mpi'"
        )
    rendezvous = KeyValueRendezvous.in_process() if single_process else KeyValueRendezvous.from_jax(namespace=NAMESPACE)
    comm = NcclComm(
        devices={r: r for r in devices},
        local_devices={r: int(d.local_hardware_id) for r, d in mine.items()},
        rendezvous=rendezvous,
        namespace=NAMESPACE,
        timeout_s=options.timeout_s,
    )
    buffers = comm.buffers(timeout_s=options.timeout_s)

    def close() -> None:
        buffers.synchronize()
        buffers.release()

    return Opened(comm=comm, buffers=buffers, close=close)


RECORD: TransportRecord[None] = TransportRecord(
    name="nccl",
    summary="NCCL moves CUDA device buffers between GPUs",
    serves=frozenset({Reach.GPU_ONE_PROCESS, Reach.GPU_PROCESSES}),
    auto=frozenset({Reach.GPU_PROCESSES}),
    probe=_probe,
    fix=_fix,
    open=_open,
    why_auto="the arrays are on GPUs across processes and cupy.cuda.nccl imports",
    auto_note="pass backend='mpi' if your MPI is CUDA-aware",
)
