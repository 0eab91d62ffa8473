"""The ``local`` transport's record for the registry (:mod:`jreshard.call.routes`).

``auto`` picks it whenever every device taking part is in this process. The call on CPU devices
runs the in-process copies (:func:`jreshard.engine.inprocess.run_local`, chosen by the caller once
the call is prepared); :func:`_open` is the engine's path: on GPUs, stream-ordered copies between
them (not run on GPU), on CPU devices, :class:`~jreshard.engine.loopback.LocalComm`.
"""

from __future__ import annotations

from collections.abc import Mapping

from jreshard.engine.loopback import LocalComm
from jreshard.engine.record import Opened, Reach, TransportRecord
from jreshard.options import Options
from jreshard.sharding.topology import Topology
from jreshard.types import Device

__all__ = ["RECORD"]

_CUDA_PLATFORMS = frozenset({"gpu", "cuda"})


def _open(devices: Mapping[int, Device], single_process: bool, options: Options, topology: Topology | None) -> Opened:
    if not all(str(d.platform) in _CUDA_PLATFORMS for d in devices.values()):
        return Opened(comm=LocalComm(sorted(devices)))
    from jreshard.cuda.buffers import CupyBuffers
    from jreshard.local.gpu import CupyLocalComm

    gpu = CupyBuffers(timeout_s=options.timeout_s)
    return Opened(comm=CupyLocalComm(sorted(devices), gpu), buffers=gpu, close=gpu.release)


RECORD: TransportRecord[None] = TransportRecord(
    name="local",
    summary="copies between buffers of one process",
    serves=frozenset({Reach.CPU_ONE_PROCESS, Reach.GPU_ONE_PROCESS}),
    auto=frozenset({Reach.CPU_ONE_PROCESS, Reach.GPU_ONE_PROCESS}),
    open=_open,
    why_auto="every device is in this process; direct copies, measured faster than backend 'xla' on CPU "
    "(benchmarks/transfer_bench.py)",
)
