"""In one process: :class:`LocalComm`, message passing between ranks whose buffers are all visible.

The message-passing engine runs over it in one process (the path MPI and NCCL
take), for GPUs in one process, tests and comparisons. The in-process path on CPU
devices needs no messages at all (:mod:`jreshard.engine.inprocess`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jreshard.engine.comm import Communicator, RecvOp, SendOp
from jreshard.engine.record import Opened, Reach, TransportRecord
from jreshard.errors import PeerError
from jreshard.options import Options
from jreshard.sharding.topology import Topology
from jreshard.types import Device

__all__ = ["LocalComm", "RECORD", "copied_bytes", "match", "match_and_copy"]


def match(
    sends: Sequence[SendOp], recvs: Sequence[RecvOp], size: Callable[[Any], int] = len, *, bounded: bool = False
) -> list[tuple[SendOp, RecvOp]]:
    """Match every send to the receive with its ``(src, dst, tag)``, in listed order.

    Args:
      size: a buffer's size in bytes (``len`` of a 1-D uint8 buffer by default).
      bounded: a receive's buffer is the most its message may hold (:meth:`Communicator.exchange_sized`), so a
        send may be shorter than it.

    Raises:
      PeerError: a send or receive has no partner, or partners differ in size (with ``bounded``: a send is
        longer than its receive).
    """
    waiting: dict[tuple[int, int, int], list[RecvOp]] = {}
    for r in recvs:
        waiting.setdefault((r.src, r.dst, r.tag), []).append(r)
    pairs = []
    for s in sends:
        queue = waiting.get((s.src, s.dst, s.tag))
        if not queue:
            raise PeerError(f"send {s.src}->{s.dst} tag {s.tag} ({size(s.buffer)} B) has no matching receive")
        r = queue.pop(0)
        if size(r.buffer) != size(s.buffer) and not (bounded and size(s.buffer) < size(r.buffer)):
            raise PeerError(
                f"send {s.src}->{s.dst} tag {s.tag} has {size(s.buffer)} B but its receive expects {size(r.buffer)} B"
            )
        pairs.append((s, r))
    left = [k for k, q in waiting.items() if q]
    if left:
        raise PeerError(f"receives {left[:8]} (src, dst, tag) have no matching send in this group")
    return pairs


def match_and_copy(
    sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, bounded: bool = False
) -> list[tuple[SendOp, RecvOp]]:
    """:func:`match` every send to its receive, and copy its bytes (with ``bounded``, into the first bytes of
    the receive's buffer).

    Raises:
      PeerError: a send or receive has no partner, or partners differ in size (``bounded``: a send is longer).
    """
    pairs = match(sends, recvs, bounded=bounded)
    for s, r in pairs:
        if bounded:
            r.buffer[: len(s.buffer)] = s.buffer
        else:
            r.buffer[...] = s.buffer
    return pairs


class LocalComm(Communicator):
    """Message passing between ranks of one process: a send is a copy into the matching receive (final).

    Example:
      >>> import numpy as np
      >>> comm = LocalComm(ranks=[0, 1])
      >>> a, b = np.arange(4, dtype=np.uint8), np.zeros(4, np.uint8)
      >>> comm.exchange([SendOp(0, 1, 7, a)], [RecvOp(0, 1, 7, b)], timeout_s=1.0)
      >>> b.tolist()
      [0, 1, 2, 3]
    """

    def __init__(self, ranks: Sequence[int]):
        self._ranks = tuple(sorted(int(r) for r in ranks))

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._ranks

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        outside = sorted(({s.src for s in sends} | {r.dst for r in recvs}) - set(self._ranks))
        if outside:
            raise PeerError(f"LocalComm over ranks {self._ranks} was given ops of ranks {outside}")
        match_and_copy(sends, recvs)

    def exchange_sized(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> list[int]:
        """Copies into the first bytes of each receive's buffer: one group (the sizes are the sends')."""
        outside = sorted(({s.src for s in sends} | {r.dst for r in recvs}) - set(self._ranks))
        if outside:
            raise PeerError(f"LocalComm over ranks {self._ranks} was given ops of ranks {outside}")
        return copied_bytes(recvs, match_and_copy(sends, recvs, bounded=True))


def copied_bytes(recvs: Sequence[RecvOp], pairs: Sequence[tuple[SendOp, RecvOp]]) -> list[int]:
    """Per receive of ``recvs``, in order, the bytes its send in ``pairs`` (:func:`match_and_copy`) copied."""
    got = {id(r): len(s.buffer) for s, r in pairs}
    return [got[id(r)] for r in recvs]


def _open(devices: Mapping[int, Device], single_process: bool, options: Options, topology: Topology | None) -> Opened:
    return Opened(comm=LocalComm(sorted(devices)))


RECORD: TransportRecord[None] = TransportRecord(
    name="loopback",
    summary="copies between the ranks of one process, through the engine's rounds (tests)",
    serves=frozenset({Reach.CPU_ONE_PROCESS}),
    open=_open,
)
"""The loopback transport, registered like any other (it runs the engine over :class:`LocalComm`)."""
