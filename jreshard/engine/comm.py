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

Prepared groups. A transport that can make its requests once and start them again every step (MPI's
persistent requests) implements :meth:`Communicator.prepare`: it returns the :class:`PreparedGroups` of a
schedule's every exchange group, which the engine's replay (:mod:`jreshard.engine.replay`) binds to the step's
buffers and starts, round by round, with no operation object made per chunk. Where it also gives the C
functions that start and poll them (:class:`NativeGroups`), a whole refit replays in one compiled call.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, cast

import numpy as np

from jreshard.errors import PeerError
from jreshard.types import ByteBuffer

__all__ = [
    "LANDED",
    "REGIONS",
    "STARTING",
    "WAITING",
    "Communicator",
    "NativeGroups",
    "StepGraph",
    "Posted",
    "PreparedGroups",
    "RecvOp",
    "Rendezvous",
    "Row",
    "SendOp",
    "hook_point",
    "ops_of_rows",
    "WrappedGroups",
]

Row = tuple[int, int, int, int, int, int]
"""One operation of :meth:`Communicator.exchange_rows`: ``(src, dst, tag, buffer, offset, nbytes)``."""


@dataclasses.dataclass(frozen=True, slots=True)
class SendOp:
    """Send ``buffer`` (a contiguous 1-D uint8 array: numpy, or CuPy on GPU) from
    local rank ``src`` to rank ``dst``. ``tag`` identifies the (stage, chunk)."""

    src: int
    dst: int
    tag: int
    buffer: ByteBuffer


@dataclasses.dataclass(frozen=True, slots=True)
class RecvOp:
    """Receive into ``buffer`` (contiguous 1-D uint8) at local rank ``dst`` from rank ``src``."""

    src: int
    dst: int
    tag: int
    buffer: ByteBuffer


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


class _Region:
    """Buffer ``index`` of a schedule, sliced to ``(index, offset, nbytes)``: no memory, a place."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __getitem__(self, part: slice) -> tuple[int, int, int]:
        return (self.index, part.start, part.stop - part.start)


class _Regions:
    def __getitem__(self, index: int) -> _Region:
        return _Region(index)


REGIONS: Sequence[Any] = cast(Sequence[Any], _Regions())
"""A buffer list for :func:`ops_of_rows` whose slices are places, ``(buffer, offset, nbytes)``: the operations of
rows before any buffer is given (a transport that prepares its groups matches them so)."""


Group = tuple[Sequence[Row], Sequence[Row]]
"""One exchange group of a schedule: its send rows and its receive rows."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NativeGroups:
    """What the compiled replay (``jreshard/engine/_replay.c``) needs to start and poll prepared groups itself.

    Attributes:
      groups: ``(ngroups, 4)`` int64: per group its requests ``[lo, hi)`` and its in-process copies ``[lo, hi)``.
      copies: ``(ncopies, 5)`` int64: ``(src buffer, src offset, dst buffer, dst offset, nbytes)``, the messages
        between ranks of this process, copied when their group starts (buffers index the step's buffer list).
      requests: the requests' handles, ``req_size`` bytes each, back to back (re-made handles are written here).
      expect: per request, the bytes a receive must get (``-1`` for a send).
      status: scratch for one status, ``status_size`` bytes.
      byte_type: the handle of the byte datatype, for ``count``.
      start, test, count: addresses of C functions with the signatures of ``MPI_Startall``, ``MPI_Test`` (a group's
        requests are polled one at a time, in order) and ``MPI_Get_count``.
    """

    groups: np.ndarray
    copies: np.ndarray
    requests: np.ndarray
    req_size: int
    expect: np.ndarray
    status: np.ndarray
    status_size: int
    byte_type: int
    start: int
    test: int
    count: int


STARTING, WAITING, LANDED = 0, 1, 2
"""The moments of a group at which the replay calls the hooks of prepared groups that observe it."""


def hook_point(group: int, moment: int) -> int:
    """The place of hook ``moment`` (:data:`STARTING`, :data:`WAITING`, :data:`LANDED`) of ``group`` among a step's
    hooks: the groups run one after the other in their order, each through its three moments. Bytes that "stay
    through" a point stay as they are until that hook returned; it may read them, nothing after it may.

    >>> hook_point(0, LANDED) < hook_point(1, STARTING) < hook_point(1, WAITING)
    True
    """
    return 3 * group + moment


class PreparedGroups(abc.ABC):
    """A communicator's requests for every exchange group of one schedule, made once, started every step.

    :meth:`bind` makes them against the step's buffers (the first step) or re-makes those whose buffer moved
    (a later one), so no request ever points at memory the step does not hand over. ``start`` and ``wait`` run
    one group as :meth:`Communicator.start_rows` and :meth:`Posted.wait` do, bounded by ``timeout_s``.
    """

    native: NativeGroups | None = None
    """The groups as the compiled replay drives them (``None``: started and polled from Python only)."""

    observes: bool = False
    """Whether the replay must call the hooks :meth:`starting`, :meth:`waiting` and :meth:`landed` around each
    group (prepared groups that digest what crosses, :class:`~jreshard.engine.digest.DigestComm`'s): the compiled
    replay then runs its operations in parts, back in Python around every start and wait."""

    @property
    def by_message(self) -> bool:
        """Whether the replay hands every message to :meth:`packed` or :meth:`unpacked` (where :attr:`observes`;
        read every step): a send as soon as its last pack ran, a receive as soon as its last unpack ran, so that what
        observes the step reads every message while it is in the cache (the replay then cuts its packs and
        unpacks at messages). Default: no."""
        return False

    @abc.abstractmethod
    def bind(self, addresses: np.ndarray, sizes: np.ndarray, buffers: Sequence[Any]) -> None:
        """Point the requests at this step's buffers: ``addresses`` and byte ``sizes`` (``-1``: no buffer) per
        index of the step's buffer list ``buffers``. Only requests whose buffer moved are re-made. The buffers
        themselves are held until :meth:`finish`, and past it only by a group given up on a failure, until its
        transport can no longer write into them (so a late write never lands in memory given to someone else).

        Raises:
          TransferError: a message would leave its buffer (nothing was posted).
        """

    def finish(self) -> None:  # noqa: B027 - optional hook, not abstract
        """The step ended (completed or failed): let go of its buffers (default: none held)."""

    @abc.abstractmethod
    def start(self, group: int, timeout_s: float) -> None:
        """Start group ``group``; it must complete within ``timeout_s`` from now."""

    @abc.abstractmethod
    def wait(self, group: int) -> None:
        """Wait for the started group ``group`` (raises as :meth:`Communicator.exchange`)."""

    def starting(self, group: int, sends_kept: int) -> None:  # noqa: B027 - optional hook, not abstract
        """The replay is about to start group ``group`` (where :attr:`observes`): its sends hold their final bytes,
        and keep them through the hook point ``sends_kept`` (:func:`hook_point`; at least this group's
        :meth:`landed`)."""

    def waiting(self, group: int) -> None:  # noqa: B027 - optional hook, not abstract
        """The replay is about to wait for the started group ``group`` (where :attr:`observes`), having run what
        runs while it is posted (the next round's packs). A hook that raises has the group given up."""

    def landed(self, group: int, recvs_kept: int) -> None:  # noqa: B027 - optional hook, not abstract
        """The wait of group ``group`` returned (where :attr:`observes`): its receives landed, and stay as they
        landed through the hook point ``recvs_kept`` (:func:`hook_point`; at least this one)."""

    def packed(self, group: int, sends: Sequence[int]) -> None:  # noqa: B027 - optional hook, not abstract
        """(Where :attr:`by_message`.) The last pack that writes the sends ``sends`` of group ``group`` (indices of
        its send rows) just ran: their bytes are final, and stay so through the group's :meth:`landed`. Packs of
        their buffer that run before it is started are written with plain stores (they are read again now)."""

    def unpacked(self, group: int, recvs: Sequence[int]) -> None:  # noqa: B027 - optional hook, not abstract
        """(Where :attr:`by_message`.) The last unpack that reads the receives ``recvs`` of group ``group`` just ran
        (or none does, and the group just landed): they hold what landed, and nothing writes them before this
        hook returns."""

    @abc.abstractmethod
    def abort(self, group: int, why: str) -> None:
        """Give up the started group ``group`` (the communicator is then broken)."""

    @abc.abstractmethod
    def failed(self, group: int, code: int, request: int, value: int, timeout_s: float) -> NoReturn:
        """The compiled replay stopped in group ``group`` with a ``FAIL_*`` ``code`` of ``_replay.c``: give the
        group up and raise what :meth:`wait` would have raised."""

    @abc.abstractmethod
    def release(self) -> None:
        """Free the requests (none may be started)."""


class WrappedGroups(PreparedGroups):
    """Prepared groups that hand every call to the groups they wrap (``inner``, whose compiled replay they keep);
    a wrapper overrides only what it adds: a check before a start, digests at the hooks. The hooks reach ``inner``
    where it observes them."""

    def __init__(self, inner: PreparedGroups):
        self._inner = inner
        self.native = inner.native

    def bind(self, addresses: np.ndarray, sizes: np.ndarray, buffers: Sequence[Any]) -> None:
        self._inner.bind(addresses, sizes, buffers)

    def finish(self) -> None:
        self._inner.finish()

    def start(self, group: int, timeout_s: float) -> None:
        self._inner.start(group, timeout_s)

    def wait(self, group: int) -> None:
        self._inner.wait(group)

    def starting(self, group: int, sends_kept: int) -> None:
        if self._inner.observes:
            self._inner.starting(group, sends_kept)

    def waiting(self, group: int) -> None:
        if self._inner.observes:
            self._inner.waiting(group)

    def landed(self, group: int, recvs_kept: int) -> None:
        if self._inner.observes:
            self._inner.landed(group, recvs_kept)

    def packed(self, group: int, sends: Sequence[int]) -> None:
        if self._inner.observes:
            self._inner.packed(group, sends)

    def unpacked(self, group: int, recvs: Sequence[int]) -> None:
        if self._inner.observes:
            self._inner.unpacked(group, recvs)

    def abort(self, group: int, why: str) -> None:
        self._inner.abort(group, why)

    def failed(self, group: int, code: int, request: int, value: int, timeout_s: float) -> NoReturn:
        self._inner.failed(group, code, request, value, timeout_s)

    def release(self) -> None:
        self._inner.release()


class StepGraph(abc.ABC):
    """A schedule's steps run as one captured graph on an accelerator (``jreshard.nccl.graph``): what
    :meth:`Communicator.graph` returns."""

    @abc.abstractmethod
    def run(
        self, buffers: Any, bufs: Mapping[int, list], bases: list[Any], timeout_s: float, eager: Callable[[], Any]
    ) -> np.ndarray:
        """One step over this step's buffers (``eager()`` runs it the engine's own way); seconds per phase
        ``[pack, network, fanout, unpack, idle]``."""

    @abc.abstractmethod
    def release(self) -> None:
        """Free what the graph holds."""


class Rendezvous(abc.ABC):
    """Shares one value, made by one process, with every process of a group (abstract): how the processes of a
    transport that needs one agree on it (the NCCL unique id) before they share a communicator. Implementations:
    ``jreshard.nccl.rendezvous.KeyValueRendezvous`` (a ``jax.distributed`` cluster's store),
    ``jreshard.mpi.rendezvous.MpiRendezvous`` (an MPI launch), and a ``RefitGroup``'s own."""

    @abc.abstractmethod
    def share(self, key: str, value: bytes | None, *, timeout_s: float) -> bytes:
        """Collective: every process of the group calls it with the same ``key``.

        Args:
          key: names this exchange; unique within the group's lifetime.
          value: the value, from exactly one process; ``None`` from every other.
          timeout_s: how long to wait for the value.

        Returns:
          The value.

        Raises:
          TransferTimeoutError: the value did not arrive within ``timeout_s``.
          PeerError: no process, or more than one, supplied a value.
        """


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

    def exchange_sized(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> list[int]:
        """:meth:`exchange` for messages whose sizes only their senders know: each receive's buffer is the most
        its message may hold, a send may be shorter. Returns, per receive in the order given, the bytes that
        landed (the first bytes of its buffer; the rest is not written).

        Default: two groups through :meth:`exchange`, first every send's length (8 bytes, host memory, as the
        delta rounds' messages are), checked against its receive's buffer before anything else is received,
        then the messages at exactly those lengths: one more message latency. A transport that carries a
        message's length with the message overrides it and takes one group (NIXL: in the WRITE's
        notification; MPI: the receive's status).

        Raises:
          PeerError: a sender's message is longer than its receive's buffer (nothing of it is received);
            and what :meth:`exchange` raises.
        """
        lens = np.array([int(s.buffer.nbytes) for s in sends], "<i8")
        got = np.zeros(len(recvs), "<i8")
        self.exchange(
            [SendOp(s.src, s.dst, s.tag, lens[i : i + 1].view(np.uint8)) for i, s in enumerate(sends)],
            [RecvOp(r.src, r.dst, r.tag, got[i : i + 1].view(np.uint8)) for i, r in enumerate(recvs)],
            timeout_s=timeout_s,
        )
        sizes = got.tolist()
        for r, n in zip(recvs, sizes, strict=True):
            bound = int(r.buffer.nbytes)
            if not 0 <= n <= bound:
                raise PeerError(
                    f"exchange_sized: rank {r.src} announced a message of {n} bytes to rank {r.dst} under tag "
                    f"{r.tag}; its receive holds at most {bound}",
                    destination_intact=True,
                )
        exact = [RecvOp(r.src, r.dst, r.tag, r.buffer[:n]) for r, n in zip(recvs, sizes, strict=True)]
        self.exchange(sends, exact, timeout_s=timeout_s)
        return sizes

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

    def prepare(self, groups: Sequence[Group]) -> PreparedGroups | None:
        """The requests of every group of a schedule, to be bound and started every step (default: ``None``, the
        transport posts each group afresh through :meth:`start_rows`).

        Args:
          groups: each group's ``(sends, recvs)`` rows, in the order the schedule runs them; a row's buffer
            indexes the buffer list later given to :meth:`PreparedGroups.bind`.
        """
        return None

    def graph(self, ops: Any) -> StepGraph | None:
        """A schedule's steps captured as one graph (``ops``: its :class:`~jreshard.engine.replay.Ops`), or ``None``
        (the default): the engine runs every step itself."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release transport resources (default: nothing to release)."""
