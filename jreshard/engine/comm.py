"""Communicator: NCCL-like point-to-point groups, abstract.

The engine talks to every transport through this one interface, so the
in-process, MPI and NCCL paths share every line of planning, chunking, packing
order and bookkeeping. A communicator serves the jreshard ranks that one
process drives (``local_ranks``); a transfer between two of them is still a
send/recv pair, and a transport may satisfy it with a copy.

Semantics follow NCCL's grouped point-to-point calls: :meth:`exchange` posts
every send and receive of a group at once (``ncclGroupStart``/``ncclGroupEnd``)
and returns when all have completed. Within one group, the messages between one
ordered pair of ranks are matched in the order they are listed, by ``tag``.

A transport whose posted messages move while the host does other work (``posts_ahead``:
MPI, whose library, peer or network card moves them) also splits a group into
:meth:`Communicator.start_rows` and the :class:`Posted` group's ``wait``, so the
round loop packs the next round while this one is on the wire.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["Communicator", "Posted", "RecvOp", "Row", "SendOp", "ops_of_rows"]

Row = tuple[int, int, int, int, int, int]
"""One operation of :meth:`Communicator.exchange_rows`: ``(src, dst, tag, buffer, offset, nbytes)``."""


@dataclasses.dataclass(frozen=True, slots=True)
class SendOp:
    """Send ``buffer`` (a contiguous 1-D uint8 array: numpy, or CuPy on GPU) from
    local rank ``src`` to rank ``dst``. ``tag`` identifies the (stage, chunk)."""

    src: int
    dst: int
    tag: int
    buffer: Any


@dataclasses.dataclass(frozen=True, slots=True)
class RecvOp:
    """Receive into ``buffer`` (contiguous 1-D uint8) at local rank ``dst`` from rank ``src``."""

    src: int
    dst: int
    tag: int
    buffer: Any


class Posted:
    """A group :meth:`Communicator.start_rows` posted: :meth:`wait` completes it, :meth:`abort` gives it up.

    This one is a group that already completed (what a transport that cannot post ahead returns).
    """

    __slots__ = ()

    def wait(self) -> None:
        """Return once every operation of the group completed, within the ``timeout_s`` it was posted with.

        Raises:
          TransferTimeoutError, PeerError: as :meth:`Communicator.exchange`.
        """

    def abort(self, why: str) -> None:
        """Give up the group's outstanding operations (the host failed between posting and waiting);
        the communicator is then broken, as after a timeout."""


_DONE = Posted()


def ops_of_rows(
    sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any]
) -> tuple[list[SendOp], list[RecvOp]]:
    """The operations of a group's rows, each a slice of its buffer (for a transport that takes buffer objects)."""
    return (
        [SendOp(s, d, t, buffers[b][o : o + n]) for s, d, t, b, o, n in sends],
        [RecvOp(s, d, t, buffers[b][o : o + n]) for s, d, t, b, o, n in recvs],
    )


class Communicator(abc.ABC):
    """Grouped, non-blocking point-to-point messages between jreshard ranks (abstract).

    Implementations are final: ``LocalComm`` and ``RecordingComm`` (one process),
    ``MpiComm`` (mpi4py), ``NcclComm`` (cupy.cuda.nccl).
    """

    posts_ahead: bool = False
    """Whether :meth:`start_rows` returns before the group's bytes moved, so the host can pack the next
    round meanwhile (the round loop then does, where two staging arenas fit)."""

    pipelines_packs: bool = False
    """Whether it pays to cut a casting sender's messages into more chunks, so that its casts overlap the
    wire (the views schedule, :func:`~jreshard.schedule.viewsched.view_schedule`): the transport posts ahead
    and every process has a core for its packs. The same on every process of the communicator."""

    @property
    @abc.abstractmethod
    def local_ranks(self) -> tuple[int, ...]:
        """The jreshard ranks whose buffers live in this process."""

    @abc.abstractmethod
    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        """Post all ``sends`` and ``recvs`` as one group and wait until every one completes.

        Raises:
          TransferTimeoutError: some peer did not complete within ``timeout_s``;
            the message names the peers still outstanding.
          PeerError: the transport reported a failure.
        """

    def exchange_rows(
        self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], *, timeout_s: float
    ) -> None:
        """:meth:`exchange` with each operation given as a row ``(src, dst, tag, buffer, offset, nbytes)``:
        its bytes are ``buffers[buffer][offset : offset + nbytes]``.

        The engine's round loop calls this, so a transport that can post a message from a base
        pointer and an offset (NCCL) makes no slice per chunk. Default: the slices, then :meth:`exchange`.
        """
        self.exchange(*ops_of_rows(sends, recvs, buffers), timeout_s=timeout_s)

    def start_rows(
        self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], *, timeout_s: float
    ) -> Posted:
        """Post one group of rows, as :meth:`exchange_rows`, and return it for a later ``wait``.

        Until that wait returns, the group's send buffers must not be written and its receive buffers
        neither read nor written. Default: the whole exchange now, and a group that is already complete.
        """
        self.exchange_rows(sends, recvs, buffers, timeout_s=timeout_s)
        return _DONE

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release transport resources (default: nothing to release)."""
