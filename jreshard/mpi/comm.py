"""MpiComm: the :class:`Communicator` over mpi4py (CPU buffers, or CuPy buffers with a CUDA-aware MPI).

Every jreshard rank lives in exactly one MPI process (``rank_process``); a
process drives the ranks of its local devices. :meth:`MpiComm.exchange` posts
one group of non-blocking ``Isend``/``Irecv`` and polls them with ``Testsome``
until all complete or ``timeout_s`` passes.

Matching. MPI matches messages by (source process, tag, communicator) in the
order they are posted. Both sides sort the operations of a group by
``(src rank, dst rank, tag)`` (stably: equal keys keep their listed order) and
derive the MPI tag from that key, so the k-th message one process sends another
under one MPI tag is the k-th that the other receives under it. The
communicator is a private duplicate, so no other traffic can match.

Posting ahead. :meth:`MpiComm.start_rows` posts a group and returns it; its ``wait`` polls the
requests as :meth:`MpiComm.exchange` does, until ``timeout_s`` after the post, so the round loop packs
its next round while MPI moves this one.

Prepared refits. :meth:`MpiComm.prepare` makes every group of a schedule once as MPI persistent requests
(``Send_init``/``Recv_init`` over raw addresses, so no request keeps a step's buffer alive); each step
re-makes only the requests whose buffer moved, and starts and polls the rest (``Startall``, ``Testall``),
from the engine's compiled replay where the MPI library mpi4py loaded can be found (its ``MPI_Startall``,
``MPI_Testsome`` and ``MPI_Get_count``), else from Python. Matching, tags, timeouts and failures are as for
:meth:`MpiComm.exchange`.

Failure. A wait longer than ``timeout_s`` cancels the outstanding receives,
abandons the outstanding sends (their buffers are kept alive until
:meth:`close`) and raises :class:`TransferTimeoutError` naming every rank and
MPI process that did not answer. The communicator is then *broken*: like NCCL
after an error, it is fail-stop, and every later :meth:`exchange` raises
:class:`PeerError`. Build a new one (the processes that survive can) to go on.
The duplicate communicator returns MPI errors (``MPI.ERRORS_RETURN``) instead
of aborting the job; they are raised as :class:`PeerError`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import sys
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from jreshard.engine import replay
from jreshard.engine.comm import (
    REGIONS,
    Communicator,
    Group,
    NativeGroups,
    Posted,
    PreparedGroups,
    RecvOp,
    Row,
    SendOp,
    ops_of_rows,
)
from jreshard.engine.loopback import match, match_and_copy
from jreshard.errors import BackendUnavailableError, PeerError, TransferError, TransferTimeoutError
from jreshard.types import ByteBuffer, MpiCommunicator, MpiModule

__all__ = ["MpiComm", "dup_within", "import_mpi", "quiet_ucx", "room_per_process"]

_MAX_SLEEP_S = 1e-3  # polling backs off to this: keeps 8 processes on 2 cores responsive
_YIELD_S = 2e-4  # a prepared group's wait first polls yielding the core this long (the compiled replay's YIELD_NS)


UCX_LOG_LEVEL = "error"
"""UCX's log level while jreshard's import of mpi4py loads the MPI library (see :func:`import_mpi`)."""


def import_mpi() -> MpiModule:
    """``mpi4py.MPI``, or :class:`BackendUnavailableError` saying what to install.

    Where this call is the one that loads the MPI library (nothing imported ``mpi4py.MPI`` before) and
    ``UCX_LOG_LEVEL`` is not set, UCX (MPICH's transport) is loaded at log level :data:`UCX_LOG_LEVEL`:
    after a peer was killed, UCX otherwise prints warnings at ``MPI_Finalize`` about the requests the dead
    peer left behind (``mpool.c ... was not returned to mpool ucp_requests``), noise beside the
    ``PeerError`` jreshard already raised. UCX's errors still print, and jreshard's own errors are
    exceptions. UCX reads the variable once, when its library loads: it is set only for that import and
    removed after, so it reaches neither child processes nor another UCX (NIXL's). ``UCX_LOG_LEVEL=warn``
    (or any level) in the environment keeps UCX's own choice.
    """
    with quiet_ucx():
        try:
            from mpi4py import MPI
        except ImportError as err:  # pragma: no cover - mpi4py is a dev dependency
            raise BackendUnavailableError(
                f"backend 'mpi' needs mpi4py and an MPI library: pip install 'jreshard[mpi]' ({err})"
            ) from err
    return MPI


@contextlib.contextmanager
def quiet_ucx() -> Iterator[None]:
    """Around any import that may be the one to load the MPI library (:func:`import_mpi`, the registry's
    probe): ``UCX_LOG_LEVEL`` at :data:`UCX_LOG_LEVEL` while it loads, unless ``mpi4py.MPI`` was imported
    before or the variable is set; removed after."""
    quiet = "mpi4py.MPI" not in sys.modules and "UCX_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["UCX_LOG_LEVEL"] = UCX_LOG_LEVEL
    try:
        yield
    finally:
        if quiet:
            os.environ.pop("UCX_LOG_LEVEL", None)


def dup_within(comm: MpiCommunicator, timeout_s: float, what: str) -> MpiCommunicator:
    """A duplicate of ``comm``, or :class:`TransferTimeoutError` once ``timeout_s`` passes without every process
    of ``comm`` duplicating it too.

    ``MPI_Comm_dup`` is collective and cannot time out: a process whose peers failed or exited before making
    their side (an import error, a refused declaration) would wait in it forever. The non-blocking duplicate is
    polled against the deadline instead. After a timeout the duplicate stays pending inside MPI (a collective
    cannot be cancelled): end the launch (``MPI.COMM_WORLD.Abort()``) rather than use ``comm`` again.

    Args:
      comm: an mpi4py intracommunicator.
      timeout_s: the longest wait.
      what: what is being formed, for the message (``"forming the refit group"``).

    Example:
      >>> from mpi4py import MPI
      >>> dup_within(MPI.COMM_SELF, 1.0, "a group").Get_size()
      1
    """
    new, request = comm.Idup()
    _wait_within(request, comm, timeout_s, what)
    return new


def _wait_within(request: Any, comm: MpiCommunicator, timeout_s: float, what: str) -> None:
    """Poll the non-blocking collective ``request`` on ``comm`` until it completes, or raise
    :class:`TransferTimeoutError` past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    sleep = 0.0
    while not request.Test():
        if time.monotonic() > deadline:
            raise TransferTimeoutError(
                f"{what}: not every one of the communicator's {comm.Get_size()} processes joined within "
                f"{timeout_s:.3g} s (it forms collectively: each process must make its side; one that failed "
                "or exited before doing so leaves the others waiting). MPI still holds the pending join: end the "
                "launch (MPI.COMM_WORLD.Abort()) rather than use this communicator again"
            )
        time.sleep(sleep)
        sleep = min(2 * sleep + 1e-5, 1e-3)


def room_per_process(comm: MpiCommunicator, timeout_s: float, what: str) -> bool:
    """Whether every host of ``comm`` has a core for each of its processes there: one non-blocking all-gather of
    (host, cores) per process, bounded by ``timeout_s`` (:class:`TransferTimeoutError`, as :func:`dup_within`).

    Example:
      >>> from mpi4py import MPI
      >>> room_per_process(MPI.COMM_SELF, 1.0, "a group")
      True
    """
    name = import_mpi().Get_processor_name()  # MPI's name of this host
    host = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")
    mine = np.array([host, os.cpu_count() or 1], np.int64)
    every = np.zeros((comm.Get_size(), 2), np.int64)
    _wait_within(comm.Iallgather(mine, every), comm, timeout_s, what)
    hosts, counts = np.unique(every[:, 0], return_counts=True)
    per_host = dict(zip(hosts.tolist(), counts.tolist(), strict=True))
    return all(per_host[h] <= cores for h, cores in every.tolist())


def _key_tag(src: int, dst: int, tag: int, tag_ub: int) -> int:
    """A deterministic MPI tag for a (src rank, dst rank, tag) key (collisions are harmless, see module doc)."""
    h = (src * 1_000_003 + dst) * 1_000_033 + tag
    return h % (tag_ub + 1)


def _nbytes(buffer: ByteBuffer) -> int:
    return int(buffer.nbytes)


def _short(xs: Sequence[int]) -> str:
    xs = sorted(set(xs))
    return str(xs) if len(xs) <= 12 else f"{xs[:10]} ... ({len(xs)} in all)"


class MpiComm(Communicator):
    """Grouped non-blocking point-to-point messages over an MPI communicator (final).

    Args:
      comm: an ``mpi4py.MPI.Intracomm`` spanning every process that drives a rank
        (``MPI.COMM_WORLD`` by default). It is duplicated; the original is untouched.
      rank_process: ``{jreshard rank: process rank in comm}`` for every rank
        taking part; every process must pass the same mapping.
      timeout_s: the longest wait for every process of ``comm`` to make its ``MpiComm`` (collectively).

    Example:
      >>> from mpi4py import MPI
      >>> c = MpiComm(MPI.COMM_SELF, {0: 0, 1: 0})
      >>> import numpy as np
      >>> a, b = np.arange(4, dtype=np.uint8), np.zeros(4, np.uint8)
      >>> c.exchange([SendOp(0, 1, 7, a)], [RecvOp(0, 1, 7, b)], timeout_s=5.0)
      >>> b.tolist()
      [0, 1, 2, 3]
      >>> c.close()
    """

    posts_ahead = True  # a posted message moves while the host packs (MPI's progress, the peer's copy, the NIC)

    def __init__(
        self, comm: MpiCommunicator = None, rank_process: Mapping[int, int] | None = None, *, timeout_s: float = 300.0
    ):
        MPI = import_mpi()
        comm = MPI.COMM_WORLD if comm is None else comm
        if rank_process is None:
            raise ValueError("MpiComm: rank_process={jreshard rank: MPI process} is required")
        bad = {r: p for r, p in rank_process.items() if not 0 <= int(p) < comm.Get_size()}
        if bad:
            raise ValueError(
                f"MpiComm: rank_process maps ranks to processes {bad} outside the communicator's "
                f"{comm.Get_size()} processes"
            )
        self._MPI = MPI
        self._comm = dup_within(comm, timeout_s, "MpiComm")
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._me = self._comm.Get_rank()
        self._proc = {int(r): int(p) for r, p in rank_process.items()}
        self._local = tuple(sorted(r for r, p in self._proc.items() if p == self._me))
        # Cut a casting sender's messages finer (views) only where every host has a core per process:
        # with more processes than cores the casts have no idle core to overlap the copies on, and the
        # extra chunks only cost. Agreed by all, since both ends of a message must chunk it alike.
        self.pipelines_packs = room_per_process(self._comm, timeout_s, "MpiComm")
        ub = self._comm.Get_attr(MPI.TAG_UB)
        self._tag_ub = int(ub) if ub else 32767
        self._broken: str | None = None
        self._abandoned: list[Any] = []  # buffers of sends abandoned after a timeout

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._local

    @property
    def broken(self) -> str | None:
        """Why this communicator stopped (a timeout or an MPI error), or ``None``."""
        return self._broken

    def process_of(self, rank: int) -> int:
        """The MPI process (in the communicator) that drives jreshard ``rank``."""
        try:
            return self._proc[rank]
        except KeyError:
            raise ValueError(
                f"MpiComm: rank {rank} is not in rank_process (ranks {_short(list(self._proc))})"
            ) from None

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._wait(self._start(sends, recvs), timeout_s, deadline)

    def exchange_sized(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> list[int]:
        """One group: each receive is posted at its buffer's size, the most its message may hold, and its status
        gives the bytes that landed (``MPI_Get_count``); a longer message is MPI's truncation error, never a
        byte past the buffer."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, int] = {}  # per receive (by identity), the bytes that landed
        self._wait(self._start(sends, recvs, got), timeout_s, deadline, got)
        return [got[id(r)] for r in recvs]

    def start_rows(
        self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], *, timeout_s: float
    ) -> Posted:
        """Post one group (``Isend``/``Irecv``, the in-process copies done) and return it; its ``wait`` polls it
        until ``timeout_s`` after this call."""
        deadline = time.monotonic() + timeout_s
        pending = self._start(*ops_of_rows(sends, recvs, buffers))
        return _MpiPosted(self, pending, timeout_s, deadline)

    def prepare(self, groups: Sequence[Group]) -> PreparedGroups:
        """Persistent requests for every group of a schedule (bound to buffers by the engine each step)."""
        return _MpiPrepared(self, groups)

    def _check_open(self) -> None:
        if self._broken is not None:
            raise PeerError(
                f"MpiComm is broken since an earlier failure ({self._broken}); "
                "the fix is to form a new communicator (and group) among the surviving processes",
                destination_intact=True,
            )

    def _check_ends(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp]) -> None:
        for s in sends:
            if self.process_of(s.src) != self._me:
                raise ValueError(f"MpiComm.exchange: send from rank {s.src}, which process {self._me} does not drive")
        for r in recvs:
            if self.process_of(r.dst) != self._me:
                raise ValueError(f"MpiComm.exchange: receive at rank {r.dst}, which process {self._me} does not drive")

    def _start(
        self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], got: dict[int, int] | None = None
    ) -> list[tuple[Any, SendOp | RecvOp]]:
        """Post a group (``got``: sized, see :meth:`exchange_sized`; the local copies' sizes go into it)."""
        self._check_open()
        self._check_ends(sends, recvs)
        key = lambda op: (op.src, op.dst, op.tag)  # noqa: E731
        sends = sorted(sends, key=key)
        recvs = sorted(recvs, key=key)
        local_recvs = [r for r in recvs if self.process_of(r.src) == self._me]
        remote_recvs = [r for r in recvs if self.process_of(r.src) != self._me]
        local_sends = [s for s in sends if self.process_of(s.dst) == self._me]
        pending: list[tuple[Any, SendOp | RecvOp]] = []
        op: SendOp | RecvOp | None = None
        try:
            for op in remote_recvs:
                req = self._comm.Irecv(op.buffer, source=self._proc[op.src], tag=self._tag(op))
                pending.append((req, op))
            for op in sends:
                if self.process_of(op.dst) != self._me:
                    req = self._comm.Isend(op.buffer, dest=self._proc[op.dst], tag=self._tag(op))
                    pending.append((req, op))
        except self._MPI.Exception as err:
            assert op is not None
            what = "send" if isinstance(op, SendOp) else "receive"
            where = f"{what} {op.src}->{op.dst} tag {op.tag} (MPI process {self._proc[self._peer(op)]})"
            self._abort(pending, f"MPI error while posting the {where}: {err}")
            raise PeerError(f"MpiComm.exchange: MPI error while posting the {where}: {err}") from err
        try:  # messages between ranks of this process: copies, matched as LocalComm matches them
            pairs = match_and_copy(local_sends, local_recvs, bounded=got is not None)
            if got is not None:
                got.update({id(r): _nbytes(s.buffer) for s, r in pairs})
        except PeerError:
            self._abort(pending, "unmatched in-process messages")
            raise
        return pending

    def _tag(self, op: SendOp | RecvOp) -> int:
        return _key_tag(op.src, op.dst, op.tag, self._tag_ub)

    def _wait(
        self,
        pending: list[tuple[Any, SendOp | RecvOp]],
        timeout_s: float,
        deadline: float,
        got: dict[int, int] | None = None,
    ) -> None:
        """Poll ``pending`` to completion (``got``: sized receives, their landed bytes go into it)."""
        MPI = self._MPI
        sleep = 0.0
        while pending:
            reqs = [p[0] for p in pending]
            statuses = [MPI.Status() for _ in reqs]
            try:
                done = MPI.Request.Testsome(reqs, statuses)
            except MPI.Exception as err:
                self._abort(pending, f"MPI error: {err}")
                procs = sorted({self._proc[self._peer(op)] for _, op in pending})
                at = f"MPI process {procs[0]}" if len(procs) == 1 else f"MPI processes {_short(procs)}"
                raise PeerError(
                    f"MpiComm.exchange: MPI reported a failure while waiting on ranks "
                    f"{_short([self._peer(op) for _, op in pending])} ({at}): {err}"
                ) from err
            if done:
                for i, status in zip(done, statuses, strict=False):  # statuses[k] belongs to done[k]
                    op = pending[i][1]
                    if isinstance(op, RecvOp):
                        n = status.Get_count(MPI.BYTE)
                        if n != _nbytes(op.buffer) and not (got is not None and 0 <= n <= _nbytes(op.buffer)):
                            self._abort([p for j, p in enumerate(pending) if j not in done], "size mismatch")
                            raise PeerError(
                                f"MpiComm.exchange: rank {op.src} sent rank {op.dst} {n} bytes under tag "
                                f"{op.tag}, expected {_nbytes(op.buffer)}; the two sides planned differently"
                            )
                        if got is not None:
                            got[id(op)] = n
                keep = set(range(len(pending))) - set(done)
                pending = [pending[j] for j in sorted(keep)]
                sleep = 0.0
                continue
            if time.monotonic() > deadline:
                self._timeout(pending, timeout_s)
            time.sleep(sleep)
            sleep = min(2 * sleep + 1e-5, _MAX_SLEEP_S)

    def _peer(self, op: SendOp | RecvOp) -> int:
        return op.dst if isinstance(op, SendOp) else op.src

    def _timeout(self, pending: list[tuple[Any, SendOp | RecvOp]], timeout_s: float) -> None:
        silent_senders = sorted({op.src for _, op in pending if isinstance(op, RecvOp)})
        silent_receivers = sorted({op.dst for _, op in pending if isinstance(op, SendOp)})
        procs = sorted({self._proc[self._peer(op)] for _, op in pending})
        parts = []
        if silent_senders:
            parts.append(f"ranks {_short(silent_senders)} did not send")
        if silent_receivers:
            parts.append(f"ranks {_short(silent_receivers)} did not receive")
        msg = (
            f"MpiComm.exchange: no answer within timeout_s={timeout_s}: {'; '.join(parts)} "
            f"(MPI processes {_short(procs)}; {len(pending)} messages outstanding at process {self._me}). "
            "A peer died or stopped answering; this communicator is now broken"
        )
        self._abort(pending, msg)
        raise TransferTimeoutError(msg)

    def _abort(self, pending: list[tuple[Any, SendOp | RecvOp]], why: str) -> None:
        """Cancel outstanding receives, abandon outstanding sends, mark the communicator broken."""
        MPI = self._MPI
        self._broken = why
        for req, op in pending:
            if isinstance(op, RecvOp):  # cancelling sends is deprecated in MPI 4 (and unsafe in MPICH)
                try:
                    req.Cancel()
                except MPI.Exception:  # pragma: no cover - cancel is best effort
                    pass
            self._abandoned.append((req, op.buffer))
        # Give cancels a moment to complete so receive buffers are released; never block. Each request is
        # tested on its own (a send to a dead peer never completes, and must not keep a cancelled receive
        # from being freed: MPI would hold it, and UCX warn of it, until MPI_Finalize).
        end = time.monotonic() + 0.05
        while self._abandoned and time.monotonic() < end:
            left = []
            for r, buf in self._abandoned:
                try:
                    if r and not r.Test():
                        left.append((r, buf))
                except MPI.Exception:  # pragma: no cover - best effort
                    left.append((r, buf))
            self._abandoned = left
            time.sleep(1e-3)

    def close(self) -> None:
        """Free the prepared requests and the duplicate communicator (skipped when broken: a dead peer may
        never answer)."""
        if self._comm is None:
            return
        replay.release(self)
        if self._broken is None:
            try:
                self._comm.Free()
            except self._MPI.Exception as err:  # a close never raises: the communicator is given up
                self._broken = f"MPI error while freeing the communicator: {err}"
        self._comm = None


class _MpiPosted(Posted):
    """A group :meth:`MpiComm.start_rows` posted: its requests, polled by :meth:`wait`."""

    __slots__ = ("_comm", "_deadline", "_pending", "_timeout_s")

    def __init__(self, comm: MpiComm, pending: list[tuple[Any, SendOp | RecvOp]], timeout_s: float, deadline: float):
        self._comm, self._pending, self._timeout_s, self._deadline = comm, pending, timeout_s, deadline

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        self._comm._wait(pending, self._timeout_s, self._deadline)

    def abort(self, why: str) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self._comm._abort(pending, why)


@functools.cache
def _mpi_functions(version: str) -> tuple[int, int, int] | None:
    """The addresses of ``MPI_Startall``, ``MPI_Test`` and ``MPI_Get_count`` in the MPI library this process
    loaded for mpi4py (the one whose ``MPI_Get_library_version`` is ``version``), or ``None`` where it cannot be
    found (then prepared groups are started and polled from Python)."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "/libmpi" in ln and ".so" in ln})
    except OSError:  # pragma: no cover - not Linux
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            get = lib.MPI_Get_library_version
        except (OSError, AttributeError):
            continue
        text, n = ctypes.create_string_buffer(8192), ctypes.c_int(0)
        if get(text, ctypes.byref(n)) != 0 or text.value.decode(errors="replace") != version:
            continue
        return tuple(ctypes.cast(getattr(lib, f), ctypes.c_void_p).value or 0 for f in _FUNCTIONS)  # type: ignore[return-value]
    return None


_FUNCTIONS = ("MPI_Startall", "MPI_Test", "MPI_Get_count")


_SEND, _PROC, _TAG, _BUF, _OFF, _NBYTES, _SRC, _DST, _JTAG = range(9)  # columns of _MpiPrepared's requests


class _MpiPrepared(PreparedGroups):
    """The persistent requests of every group of one schedule on an :class:`MpiComm` (final)."""

    def __init__(self, comm: MpiComm, groups: Sequence[Group]):
        MPI = comm._MPI
        # The communicator weakly: the engine caches this object in a weak mapping keyed by the communicator.
        self._comm: MpiComm = weakref.proxy(comm)
        self._MPI = MPI
        meta: list[tuple[int, ...]] = []
        copies: list[tuple[int, int, int, int, int]] = []
        spans: list[tuple[int, int, int, int]] = []
        me, proc = comm._me, comm._proc
        for sends, recvs in groups:
            send_ops, recv_ops = ops_of_rows(sends, recvs, REGIONS)  # each op's buffer: (buffer, offset, nbytes)
            comm._check_ends(send_ops, recv_ops)
            key = lambda op: (op.src, op.dst, op.tag)  # noqa: E731
            send_ops.sort(key=key)
            recv_ops.sort(key=key)
            lo, copy_lo = len(meta), len(copies)
            for r in recv_ops:
                if proc[r.src] != me:
                    meta.append((0, proc[r.src], comm._tag(r), *r.buffer, r.src, r.dst, r.tag))
            for s in send_ops:
                if comm.process_of(s.dst) != me:
                    meta.append((1, proc[s.dst], comm._tag(s), *s.buffer, s.src, s.dst, s.tag))
            local_sends = [s for s in send_ops if proc[s.dst] == me]
            local_recvs = [r for r in recv_ops if proc[r.src] == me]
            for s, r in match(local_sends, local_recvs, size=lambda b: b[2]):
                copies.append((s.buffer[0], s.buffer[1], r.buffer[0], r.buffer[1], s.buffer[2]))
            spans.append((lo, len(meta), copy_lo, len(copies)))
        self._meta = np.array(meta, np.int64).reshape(-1, 9)
        self._spans = spans
        self._copies = np.array(copies, np.int64).reshape(-1, 5)
        self._reqs: list[Any] = [None] * len(meta)
        self._bound = np.full(len(meta), -1, np.int64)  # the address each request was made with
        self._addr: np.ndarray | None = None
        self._buffers: Sequence[Any] | None = None  # the step's buffers, while it runs
        self._last: tuple[np.ndarray, np.ndarray] | None = None  # the addresses and sizes last bound
        self._deadline = [0.0] * len(spans)
        self._timeout = [0.0] * len(spans)
        req_size, status_size = MPI._sizeof(MPI.Request), MPI._sizeof(MPI.Status)
        self._handles = np.zeros(len(meta) * req_size, np.uint8)
        self._handle_view = self._handles.view({4: np.uint32, 8: np.uint64}.get(req_size, np.uint8))
        self._handle_mask = (1 << (8 * req_size)) - 1
        fns = _mpi_functions(MPI.Get_library_version()) if req_size in (4, 8) else None
        if fns is not None and all(fns) and replay.compiled_replay():
            self.native = NativeGroups(
                groups=np.array(spans, np.int64).reshape(-1, 4),
                copies=self._copies,
                requests=self._handles,
                req_size=req_size,
                expect=np.where(self._meta[:, _SEND] == 1, -1, self._meta[:, _NBYTES]).astype(np.int64),
                status=np.zeros(status_size, np.uint8),
                status_size=status_size,
                byte_type=int(MPI.BYTE.handle)
                if int(MPI.BYTE.handle) < (1 << 63)
                else int(MPI.BYTE.handle) - (1 << 64),
                start=fns[0],
                test=fns[1],
                count=fns[2],
            )

    def bind(self, addresses: np.ndarray, sizes: np.ndarray, buffers: Sequence[Any]) -> None:
        self._comm._check_open()
        self._buffers = buffers  # a group given up keeps the regions of its requests (MpiComm._abort)
        last = self._last
        if last is not None and np.array_equal(addresses, last[0]) and np.array_equal(sizes, last[1]):
            self._addr = addresses
            return  # the buffers of the last step, where every request already points
        self._last = None
        meta = self._meta
        for what, buf, off, n in (
            ("message", meta[:, _BUF], meta[:, _OFF], meta[:, _NBYTES]),
            ("in-process message", self._copies[:, 0], self._copies[:, 1], self._copies[:, 4]),
            ("in-process message", self._copies[:, 2], self._copies[:, 3], self._copies[:, 4]),
        ):
            bad = np.nonzero((off < 0) | (n < 0) | (off + n > sizes[buf]) | ((n > 0) & (addresses[buf] == 0)))[0]
            if len(bad):
                i = int(bad[0])
                raise TransferError(
                    f"MpiComm: a {what} of {int(n[i])} bytes at offset {int(off[i])} would leave buffer {int(buf[i])} "
                    f"of {int(sizes[buf[i]])} bytes (-1: none given); nothing was posted",
                    destination_intact=True,
                )
        self._addr = addresses
        where = addresses[meta[:, _BUF]] + meta[:, _OFF]
        MPI, comm = self._MPI, self._comm._comm
        for i in np.nonzero(where != self._bound)[0].tolist():
            old = self._reqs[i]
            if old is not None:
                old.Free()
            m = meta[i]
            buf = MPI.buffer.fromaddress(int(where[i]), int(m[_NBYTES]), readonly=bool(m[_SEND]))
            make = comm.Send_init if m[_SEND] else comm.Recv_init
            req = make(buf, int(m[_PROC]), int(m[_TAG]))
            self._reqs[i] = req
            self._handle_view[i] = int(req.handle) & self._handle_mask
            self._bound[i] = where[i]
        self._last = (addresses.copy(), sizes.copy())

    def finish(self) -> None:
        self._buffers = None

    def _ops(self, lo: int, hi: int) -> list[tuple[Any, SendOp | RecvOp]]:
        """Requests ``lo:hi`` with the operations they carry, each over its region of the step's buffer (for the
        messages of a failure, and for MpiComm._abort, which keeps the regions of the requests it gives up)."""
        out: list[tuple[Any, SendOp | RecvOp]] = []
        for i in range(lo, hi):
            m = self._meta[i]
            row = (int(m[_SRC]), int(m[_DST]), int(m[_JTAG]), int(m[_BUF]), int(m[_OFF]), int(m[_NBYTES]))
            sends, recvs = ops_of_rows([row] if m[_SEND] else [], [] if m[_SEND] else [row], self._buffers or REGIONS)
            out.append((self._reqs[i], (sends or recvs)[0]))
        return out

    def start(self, group: int, timeout_s: float) -> None:
        self._comm._check_open()
        lo, hi, clo, chi = self._spans[group]
        self._deadline[group], self._timeout[group] = time.monotonic() + timeout_s, timeout_s
        try:
            if hi > lo:
                self._MPI.Prequest.Startall(self._reqs[lo:hi])
        except self._MPI.Exception as err:
            self._comm._abort(self._ops(lo, hi), f"MPI error while posting: {err}")
            raise PeerError(f"MpiComm.exchange: MPI error while posting the group: {err}") from err
        addr = self._addr
        assert addr is not None
        for sb, so, db, do, n in self._copies[clo:chi].tolist():  # messages between ranks of this process
            ctypes.memmove(int(addr[db]) + do, int(addr[sb]) + so, n)

    def wait(self, group: int) -> None:
        lo, hi, _, _ = self._spans[group]
        MPI, reqs = self._MPI, self._reqs[lo:hi]
        statuses = [MPI.Status() for _ in reqs]
        sleep, left, idle_from = 0.0, hi - lo, 0.0
        while left:  # as MpiComm's wait: Testsome, backing off only while nothing completes
            try:
                done = MPI.Request.Testsome(reqs, statuses)
            except MPI.Exception as err:
                self._comm._abort(self._pending(lo, hi), f"MPI error: {err}")
                raise PeerError(f"MpiComm.exchange: MPI reported a failure while waiting on a group: {err}") from err
            if done is None:  # every request inactive: all completed
                break
            if done:
                for i, status in zip(done, statuses, strict=False):  # statuses[k] belongs to done[k]
                    m = self._meta[lo + i]
                    if not m[_SEND] and status.Get_count(MPI.BYTE) != m[_NBYTES]:
                        self._size_mismatch(lo + i, status.Get_count(MPI.BYTE))
                left -= len(done)
                sleep, idle_from = 0.0, 0.0
                continue
            now = time.monotonic()
            if now > self._deadline[group]:
                self._comm._timeout(self._pending(lo, hi), self._timeout[group])
            idle_from = idle_from or now
            if now - idle_from < _YIELD_S:  # the peer is a round trip away: give the core to whoever needs it
                os.sched_yield()
                continue
            time.sleep(sleep)
            sleep = min(2 * sleep + 1e-5, _MAX_SLEEP_S)

    def _pending(self, lo: int, hi: int) -> list[tuple[Any, SendOp | RecvOp]]:
        """The requests of ``lo:hi`` that have not completed."""
        out = []
        for req, op in self._ops(lo, hi):
            try:
                if req.Test():
                    continue
            except self._MPI.Exception:
                pass
            out.append((req, op))
        return out

    def _size_mismatch(self, i: int, got: int) -> NoReturn:
        m = self._meta[i]
        self._comm._broken = "size mismatch"
        raise PeerError(
            f"MpiComm.exchange: rank {int(m[_SRC])} sent rank {int(m[_DST])} {got} bytes under tag {int(m[_JTAG])}, "
            f"expected {int(m[_NBYTES])}; the two sides planned differently"
        )

    def abort(self, group: int, why: str) -> None:
        lo, hi, _, _ = self._spans[group]
        self._comm._abort(self._pending(lo, hi), why)

    def failed(self, group: int, code: int, request: int, value: int, timeout_s: float) -> NoReturn:
        lo, hi, _, _ = self._spans[group]
        if code == _FAIL_TIMEOUT:
            self._comm._timeout(self._pending(lo, hi), timeout_s)
        if code == _FAIL_SIZE:
            self._size_mismatch(request, value)
        try:
            text = self._MPI.Get_error_string(value)
        except self._MPI.Exception:  # pragma: no cover
            text = "unknown"
        self._comm._abort(self._pending(lo, hi), f"MPI error {value}: {text}")
        raise PeerError(
            f"MpiComm.exchange: MPI reported error {value} ({text}) in a group of ranks "
            f"{_short([int(m) for m in self._meta[lo:hi, _DST]] + [int(m) for m in self._meta[lo:hi, _SRC]])}"
        )

    def release(self) -> None:
        if self._comm._broken is None and self._comm._comm is not None:
            for req in self._reqs:
                if req is not None:
                    req.Free()
        self._reqs = [None] * len(self._reqs)
        self._bound[:] = -1
        self._last = None


_FAIL_TIMEOUT, _FAIL_SIZE = 1, 3  # _replay.c's FAIL_TIMEOUT and FAIL_SIZE
