"""A CPU twin of a device-memory transport, for the rank-local tests.

:class:`DeviceLikeBuffers` is a buffer backend that is not ``CpuBuffers`` and remembers every
buffer it hands out ("device memory"): shard views, destination blocks, staging and uploads
(which copy, as a host-to-device copy does). :class:`DeviceOnlyComm` wraps a transport and, as
NCCL does, refuses any send or receive whose buffer is not in that memory, so a payload built in
host memory (the scheduling mail, say) cannot slip through. It counts the mail it carried.
"""

from __future__ import annotations

import numpy as np

from jreshard.engine.buffers import Buffers, CpuBuffers
from jreshard.engine.comm import Communicator
from jreshard.schedule.pairsched import MAIL_TAG


class HostMemoryOnTheWire(AssertionError):
    pass


class DeviceLikeBuffers(Buffers[np.ndarray]):
    """Host buffers behind a backend that is not CpuBuffers; every buffer it gives out is recorded."""

    def __init__(self) -> None:
        self.cpu = CpuBuffers()
        self.owned: list[np.ndarray] = []
        self.uploads = self.downloads = 0

    def _own(self, a: np.ndarray) -> np.ndarray:
        self.owned.append(a)
        return a

    def holds(self, a: np.ndarray) -> bool:
        if a.size == 0:
            return True
        p = a.ctypes.data
        return any(o.ctypes.data <= p and p + a.nbytes <= o.ctypes.data + o.nbytes for o in self.owned)

    def export_source(self, shard):
        return self._own(self.cpu.export_source(shard))

    def writable_view(self, array):
        return self._own(self.cpu.writable_view(array))

    def allocate(self, sizes, device):
        return [self._own(b) for b in self.cpu.allocate(sizes, device)]

    def import_shard(self, buffer, shape, dtype, device):
        return self.cpu.import_shard(buffer, shape, dtype, device)

    def staging(self, nbytes, device=None):
        return self._own(self.cpu.staging(nbytes, device))

    def upload(self, data, device):
        self.uploads += 1
        buf = self.staging(data.size, device)
        buf[:] = data  # a copy, as host-to-device is
        return buf

    def download(self, buffer):
        if not self.holds(buffer):
            raise HostMemoryOnTheWire("download of a buffer this backend did not give out")
        self.downloads += 1
        return np.array(buffer)

    def pack(self, table, buffers, staging):
        self.cpu.pack(table, buffers, staging)

    def unpack(self, table, staging, buffers):
        self.cpu.unpack(table, staging, buffers)

    def copy(self, src_table, src, dst_table, dst):
        self.cpu.copy(src_table, src, dst_table, dst)


class DeviceOnlyComm(Communicator):
    """``inner``, refusing every op whose buffer ``buffers`` did not give out; counts mail ops."""

    def __init__(self, inner: Communicator, buffers: DeviceLikeBuffers) -> None:
        self.inner, self.buffers = inner, buffers
        self.mail_ops = self.chunk_ops = 0

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.inner.local_ranks

    def exchange(self, sends, recvs, *, timeout_s: float) -> None:
        for op in [*sends, *recvs]:
            if not self.buffers.holds(op.buffer):
                raise HostMemoryOnTheWire(
                    f"{type(op).__name__} {op.src}->{op.dst} tag {op.tag:#x}: its buffer is host memory"
                )
            if op.tag >= MAIL_TAG:
                self.mail_ops += 1
            else:
                self.chunk_ops += 1
        self.inner.exchange(sends, recvs, timeout_s=timeout_s)

    def close(self) -> None:
        self.inner.close()
