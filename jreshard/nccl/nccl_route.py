"""``backend="nccl"`` for ``jreshard.transfer``: the engine over ``NcclComm`` with CuPy
buffers, in one process with GPUs or across the processes of a ``jax.distributed``
cluster. Not run on GPU.
"""

from __future__ import annotations

from typing import Any

import jax

from jreshard.errors import BackendUnavailableError
from jreshard.nccl.cupy_nccl import NcclComm
from jreshard.nccl.rendezvous import KeyValueRendezvous
from jreshard.options import Options
from jreshard.report import ReportBuilder
from jreshard.sharding.topology import Topology

__all__ = ["nccl_in_process", "nccl_multiprocess"]


def _leaves_and_targets(x: Any, target: Any) -> tuple[list, list]:
    """The leaves of ``x`` and the target sharding of each (``None``: kept)."""
    from jreshard.frontdoor import flatten, target_sharding

    leaves, _, targets = flatten(x, target)
    return leaves, [t.sharding if isinstance(t, jax.Array) else target_sharding(t, "a target") for t in targets]


def nccl_in_process(x: Any, target: Any, topology: Topology | None, options: Options, builder: ReportBuilder) -> Any:
    """``backend="nccl"`` with every GPU in this process: the engine over ``NcclComm``. Not run on GPU."""
    from jreshard.multi import transfer_multiprocess

    leaves, targets = _leaves_and_targets(x, target)
    devs = {d.id: d for leaf in leaves for d in leaf.sharding.device_set}
    devs.update({d.id: d for t in targets if t is not None for d in t.device_set})
    comm = NcclComm(
        devices={r: r for r in devs},
        local_devices={r: int(d.local_hardware_id) for r, d in devs.items()},
        rendezvous=KeyValueRendezvous.in_process(),
        namespace="jreshard.transfer",
        timeout_s=options.timeout_s,
    )
    buffers = comm.buffers(timeout_s=options.timeout_s)  # stream-ordered: one host wait, at the end
    try:
        out = transfer_multiprocess(
            x, target, topology=topology, options=options, transport=comm, buffers=buffers, report=builder
        )
    finally:
        buffers.synchronize()
        buffers.release()
    return out


def nccl_multiprocess(
    x: Any, target: Any, topology: Topology | None, options: Options, builder: ReportBuilder | None = None
) -> Any:
    """``backend="nccl"`` across the processes of a ``jax.distributed`` cluster: every process
    calls ``transfer``; the engine runs over ``NcclComm``, the unique id shared through the
    cluster's key-value store. Not run on GPU."""
    from jreshard.multi import transfer_multiprocess

    leaves, targets = _leaves_and_targets(x, target)
    devs = {d.id: d for leaf in leaves for d in leaf.sharding.device_set}
    devs.update({d.id: d for t in targets if t is not None for d in t.device_set})
    mine = {r: d for r, d in devs.items() if d.process_index == jax.process_index()}
    if not mine:
        raise BackendUnavailableError(
            f"backend 'nccl': process {jax.process_index()} holds none of the {len(devs)} devices of this transfer, "
            "and an NCCL communicator needs at least one; the fix is to call transfer only on the processes "
            "that take part, or backend='mpi'"
        )
    comm = NcclComm(
        devices={r: r for r in devs},
        local_devices={r: int(d.local_hardware_id) for r, d in mine.items()},
        rendezvous=KeyValueRendezvous.from_jax(namespace="jreshard.transfer"),
        namespace="jreshard.transfer",
        timeout_s=options.timeout_s,
    )
    buffers = comm.buffers(timeout_s=options.timeout_s)  # stream-ordered: one host wait, at the end
    try:
        return transfer_multiprocess(
            x, target, topology=topology, options=options, transport=comm, buffers=buffers, report=builder
        )
    finally:
        buffers.synchronize()
        buffers.release()
