"""SocketComm: the engine's :class:`Communicator` over :class:`Channel` connections (host buffers only).

One process drives its ``local_ranks``; every other rank is reached through
the channel of the process that drives it. :meth:`SocketComm.exchange` queues
every remote send as a data frame, then reads and writes every channel involved
until all sends are handed to the kernel and all receives are filled, or
``timeout_s`` passes. Messages between two local ranks are copies
(``match_and_copy``). Within one ordered pair of ranks, frames are matched to
receives by ``(src, dst, tag)`` in the order they were listed, as NCCL and
:class:`MpiComm` match them; one TCP connection keeps that order. A frame
that arrives before its receive is posted (the peer is a step ahead) is kept
until a later exchange posts it, as MPI keeps unexpected messages; sizes are
checked when it is matched.

A peer that closes or dies is noticed at once (its connection ends); one that
stops answering, after ``timeout_s``. Either way the error names the peer and
the communicator is broken (fail-stop, like NCCL); other channels are not
touched, so the caller can drop that one peer and go on with the others.
"""

from __future__ import annotations

import collections
import select
import time
from collections.abc import Mapping, Sequence

from jreshard.elastic.wire import Channel
from jreshard.engine.comm import Communicator, RecvOp, SendOp
from jreshard.engine.loopback import match_and_copy
from jreshard.errors import PeerError, TransferTimeoutError

__all__ = ["SocketComm"]


class SocketComm(Communicator):
    """Grouped point-to-point messages over loopback TCP channels (final).

    Args:
      local: the ranks this process drives.
      remote: ``{rank: channel of the process that drives it}`` for every other rank.

    Example:
      >>> import socket, numpy as np
      >>> a, b = socket.socketpair()
      >>> left = SocketComm([0], {1: Channel(a, "right")})
      >>> right = SocketComm([1], {0: Channel(b, "left")})
      >>> left.exchange([SendOp(0, 1, 7, np.arange(4, dtype=np.uint8))], [], timeout_s=1.0)
      >>> got = np.zeros(4, np.uint8)
      >>> right.exchange([], [RecvOp(0, 1, 7, got)], timeout_s=1.0)
      >>> got.tolist()
      [0, 1, 2, 3]
      >>> a.close(); b.close()
    """

    def __init__(self, local: Sequence[int], remote: Mapping[int, Channel]):
        self._local = tuple(sorted(int(r) for r in local))
        clash = sorted(set(self._local) & set(remote))
        if clash:
            raise ValueError(f"SocketComm: ranks {clash} are both local and remote")
        self._remote = dict(remote)
        self.broken: str | None = None
        # frames that arrived before their receive was posted (MPI's "unexpected messages")
        self._early: dict[tuple[int, int, int], collections.deque[bytearray]] = {}

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._local

    def _channel(self, rank: int, what: str) -> Channel:
        try:
            return self._remote[rank]
        except KeyError:
            raise ValueError(f"SocketComm.exchange: {what} rank {rank} is neither local nor reachable") from None

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        if self.broken is not None:
            raise PeerError(f"SocketComm is broken since an earlier failure ({self.broken})", destination_intact=True)
        mine = set(self._local)
        for s in sends:
            if s.src not in mine:
                raise ValueError(f"SocketComm.exchange: send from rank {s.src}, which this process does not drive")
        for r in recvs:
            if r.dst not in mine:
                raise ValueError(f"SocketComm.exchange: receive at rank {r.dst}, which this process does not drive")
        match_and_copy([s for s in sends if s.dst in mine], [r for r in recvs if r.src in mine])
        expected: dict[tuple[int, int, int], collections.deque[RecvOp]] = {}
        waiting: dict[int, int] = collections.Counter()  # channel fd -> receives outstanding
        channels: dict[int, Channel] = {}
        for r in recvs:
            if r.src not in mine:
                ch = self._channel(r.src, "source")
                channels[ch.fileno()] = ch
                early = self._early.get((r.src, r.dst, r.tag))
                if early:
                    self._take_early(early.popleft(), r, ch)
                    continue
                expected.setdefault((r.src, r.dst, r.tag), collections.deque()).append(r)
                waiting[ch.fileno()] += 1
        for s in sends:
            if s.dst not in mine:
                ch = self._channel(s.dst, "destination")
                ch.queue_data(s.src, s.dst, s.tag, s.buffer)
                channels[ch.fileno()] = ch
        try:
            self._run(channels, expected, waiting, timeout_s)
        except (PeerError, TransferTimeoutError) as err:
            self.broken = str(err)
            raise

    @staticmethod
    def _take_early(data: bytearray, op: RecvOp, ch: Channel) -> None:
        view = memoryview(op.buffer).cast("B")
        if view.nbytes != len(data):
            raise PeerError(
                f"{ch.peer}: rank {op.src} sent rank {op.dst} {len(data)} bytes under tag {op.tag}, expected "
                f"{view.nbytes}: the two sides planned differently"
            )
        view[:] = data

    def _run(
        self,
        channels: dict[int, Channel],
        expected: dict[tuple[int, int, int], collections.deque[RecvOp]],
        waiting: dict[int, int],
        timeout_s: float,
    ) -> None:
        def matcher(ch: Channel):
            def match(src: int, dst: int, tag: int, nbytes: int) -> memoryview:
                queue = expected.get((src, dst, tag))
                if not queue:  # its receive is posted by a later exchange: keep it until then
                    if dst not in self._local:
                        raise PeerError(f"{ch.peer} sent a message for rank {dst}, which this process does not drive")
                    buf = bytearray(nbytes)
                    self._early.setdefault((src, dst, tag), collections.deque()).append(buf)
                    return memoryview(buf)
                op = queue.popleft()
                view = memoryview(op.buffer).cast("B")
                if view.nbytes != nbytes:
                    raise PeerError(
                        f"{ch.peer}: rank {src} sent rank {dst} {nbytes} bytes under tag {tag}, expected "
                        f"{view.nbytes}: the two sides planned differently"
                    )
                waiting[ch.fileno()] -= 1
                return view

            return match

        matchers = {fd: matcher(ch) for fd, ch in channels.items()}
        deadline = time.monotonic() + timeout_s
        while True:
            busy = False
            for fd, ch in channels.items():
                ch.pump(matchers[fd])
                ch.flush()
                outstanding = waiting[fd] > 0 or ch._fill is not None or ch.sending
                if outstanding and ch.eof:
                    raise ch.closed_error()
                busy = busy or outstanding
            if not busy:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                late = [ch.peer for fd, ch in channels.items() if waiting[fd] or ch._fill is not None or ch.sending]
                raise TransferTimeoutError(
                    f"SocketComm.exchange: no progress within timeout_s={timeout_s} with {', '.join(late)}: "
                    "it died or stopped answering"
                )
            reads = list(channels.values())
            writes = [ch for ch in channels.values() if ch.sending]
            select.select(reads, writes, [], min(left, 0.05))
