"""A CPU twin of a device-memory transport, for the per-process tests.

:class:`DeviceLikeBuffers` is a buffer backend that is not ``CpuBuffers`` and remembers every
buffer it hands out ("device memory"): shard views, destination blocks, staging and uploads
(which copy, as a host-to-device copy does). It runs a descriptor table as ``CupyBuffers`` does:
the byte rows as bytes, the cast rows through the GPU cast kernel's launch table
(``casts.pack_launch``/``unpack_launch``/``copy_launch``) and its numpy re-expression
(``casts.element_addresses``), every element read and written at its address in the memory it
gave out, its value cast by ``views.casts`` (which the kernel's C source matches bit for bit).
:class:`DeviceOnlyComm` wraps a transport and, as NCCL does, refuses any send or receive whose
buffer is not in that memory, so a payload built in host memory (the scheduling mail, say) cannot
slip through. It counts the mail it carried.
"""

from __future__ import annotations

import numpy as np

from jreshard.cuda import casts as CC
from jreshard.engine.buffers import Buffers, CpuBuffers
from jreshard.engine.comm import Communicator
from jreshard.schedule import kernels as K
from jreshard.schedule.pairsched import MAIL_TAG
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.views.casts import cast_chain


class HostMemoryOnTheWire(AssertionError):
    pass


class DeviceLikeBuffers(Buffers[np.ndarray]):
    """Host buffers behind a backend that is not CpuBuffers; every buffer it gives out is recorded."""

    def __init__(self) -> None:
        self.cpu = CpuBuffers()
        self.owned: list[np.ndarray] = []
        self.staged: dict = {}  # device -> bytes of staging arenas handed out (uploads are not staging)
        self.uploads = self.downloads = 0
        self.cast_launches = self.cast_elements = 0

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
        self.staged[device] = self.staged.get(device, 0) + int(nbytes)  # the staging the engine asked for
        return self._own(self.cpu.staging(nbytes, device))

    def upload(self, data, device):
        self.uploads += 1
        buf = self._own(self.cpu.staging(data.size, device))
        buf[:] = data  # a copy, as host-to-device is
        return buf

    def download(self, buffer):
        if not self.holds(buffer):
            raise HostMemoryOnTheWire("download of a buffer this backend did not give out")
        self.downloads += 1
        return np.array(buffer)

    @staticmethod
    def _ptrs(buffers) -> list[int]:
        return [0 if b is None else b.ctypes.data for b in buffers]

    def pack(self, table, buffers, staging):
        byte, cast = CC.split(table)
        self.cpu.pack(byte, buffers, staging)
        self._cast(CC.pack_launch(cast, self._ptrs(buffers), staging.ctypes.data))

    def unpack(self, table, staging, buffers):
        byte, cast = CC.split(table)
        self.cpu.unpack(byte, staging, buffers)
        self._cast(CC.unpack_launch(cast, staging.ctypes.data, self._ptrs(buffers)))

    def copy(self, src_table, src, dst_table, dst):
        cast = src_table[:, K.CAST] != 0
        self.cpu.copy(src_table[~cast], src, dst_table[~cast], dst)
        self._cast(CC.copy_launch(src_table[cast], self._ptrs(src), dst_table[cast], self._ptrs(dst)))

    def _at(self, addresses: np.ndarray, size: int, write: bool) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(buffer, element indices, byte offsets)`` per buffer this backend gave out that holds the
        ``size``-byte elements at ``addresses``; an address outside them is refused."""
        bases = np.array([o.ctypes.data for o in self.owned], np.int64)
        ends = bases + np.array([o.nbytes for o in self.owned], np.int64)
        ok = (bases[None, :] <= addresses[:, None]) & (addresses[:, None] + size <= ends[None, :])
        if write:
            ok &= np.array([o.flags.writeable for o in self.owned])[None, :]
        if not ok.any(axis=1).all():
            what = "writes" if write else "reads"
            raise HostMemoryOnTheWire(f"the cast kernel {what} memory this backend did not give out")
        owner = ok.argmax(axis=1)
        out = []
        for k in np.unique(owner):
            sel = np.nonzero(owner == k)[0]
            out.append((self.owned[int(k)], sel, addresses[sel] - bases[k]))
        return out

    def _cast(self, launch: np.ndarray) -> None:
        """Run a cast launch table as the kernel does: every element at the addresses its threads compute."""
        if not len(launch):
            return
        self.cast_launches += 1
        src, dst, row = CC.element_addresses(launch)
        self.cast_elements += len(src)
        chains = launch[row, CC.CHAIN]
        for code in np.unique(chains):
            chain = K.chain_of(code)
            sel = np.nonzero(chains == code)[0]
            a, b = (numpy_dtype(chain[i]).itemsize for i in (0, -1))
            raw = np.zeros((len(sel), a), np.uint8)
            for buf, idx, off in self._at(src[sel], a, write=False):
                raw[idx] = buf[off[:, None] + np.arange(a)]
            out = np.ascontiguousarray(cast_chain(raw.view(numpy_dtype(chain[0])).reshape(-1), chain[1:]))
            bits = out.view(np.uint8).reshape(-1, b)
            for buf, idx, off in self._at(dst[sel], b, write=True):
                buf[off[:, None] + np.arange(b)] = bits[idx]


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
