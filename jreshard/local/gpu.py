"""CupyLocalComm: message passing between the GPUs of one process as stream-ordered copies. Not run on GPU.

The engine's path for GPUs in one process (``backend="local"`` on GPUs). A send and its
receive become one ``cudaMemcpyAsync`` on the GPU's comm stream of the
:class:`~jreshard.cuda.buffers.CupyBuffers` in use; between two GPUs, one
``cudaMemcpyPeerAsync`` on the sender's comm stream, after an event of the receiver's and
followed by one the receiver's waits for. Copies are so ordered with the packs and unpacks
of both GPUs exactly as NCCL's sends and receives are (the buffers' ``fence``), without a
host wait and without the legacy default stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jreshard.cuda.runtime import device_pointer
from jreshard.engine.comm import Communicator, RecvOp, SendOp
from jreshard.engine.loopback import match
from jreshard.errors import PeerError

if TYPE_CHECKING:
    from jreshard.cuda.buffers import CupyBuffers

__all__ = ["CupyLocalComm"]


class CupyLocalComm(Communicator):
    """Sends and receives between GPUs of one process as copies on ``buffers``' comm streams (final).

    Args:
      ranks: the jreshard ranks of this process.
      buffers: the ``CupyBuffers`` whose streams order the copies.
    """

    __slots__ = ("_buffers", "_ranks")

    def __init__(self, ranks: Sequence[int], buffers: CupyBuffers):
        self._ranks = tuple(sorted(int(r) for r in ranks))
        self._buffers = buffers

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._ranks

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        """Match every send to its receive (by ``(src, dst, tag)``, in order) and copy it on the
        receiving GPU's comm stream. Not run on GPU.

        Raises:
          PeerError: an op of a rank not driven here, an unmatched op, or partners of different sizes.
        """
        outside = sorted(({s.src for s in sends} | {r.dst for r in recvs}) - set(self._ranks))
        if outside:
            raise PeerError(f"CupyLocalComm over ranks {self._ranks} was given ops of ranks {outside}")
        pairs = []
        for s, r in match(sends, recvs, size=lambda b: device_pointer(b)[1]):
            (sp, n), (rp, _) = device_pointer(s.buffer), device_pointer(r.buffer)
            pairs.append((s.buffer.device.id, sp, r.buffer.device.id, rp, n))
        cp = self._buffers.cupy
        rt = cp.cuda.runtime
        for so, sp, ro, rp, n in pairs:
            here = self._buffers.stream(so)
            if so == ro:
                with cp.cuda.Device(so):
                    rt.memcpyAsync(rp, sp, n, rt.memcpyDeviceToDevice, here.ptr)
                continue
            # Between two GPUs: on the sender's comm stream (which releases the sender's staging, as
            # NCCL's send does), after the receiver's (which ordered the receiving side), and back.
            there = self._buffers.stream(ro)
            with cp.cuda.Device(ro):
                ready = there.record()
            with cp.cuda.Device(so):
                here.wait_event(ready)
                rt.memcpyPeerAsync(rp, ro, sp, so, n, here.ptr)
                done = here.record()
            with cp.cuda.Device(ro):
                there.wait_event(done)
