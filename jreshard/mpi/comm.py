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

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jreshard.engine.comm import Communicator, Posted, RecvOp, Row, SendOp, ops_of_rows
from jreshard.engine.loopback import match_and_copy
from jreshard.errors import BackendUnavailableError, PeerError, TransferTimeoutError

__all__ = ["MpiComm", "import_mpi"]

_MAX_SLEEP_S = 1e-3  # polling backs off to this: keeps 8 processes on 2 cores responsive


def import_mpi() -> Any:
    """``mpi4py.MPI``, or :class:`BackendUnavailableError` saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError as err:  # pragma: no cover - mpi4py is a dev dependency
        raise BackendUnavailableError(
            f"backend 'mpi' needs mpi4py and an MPI library: pip install 'jreshard[mpi]' ({err})"
        ) from err
    return MPI


def _key_tag(src: int, dst: int, tag: int, tag_ub: int) -> int:
    """A deterministic MPI tag for a (src rank, dst rank, tag) key (collisions are harmless, see module doc)."""
    h = (src * 1_000_003 + dst) * 1_000_033 + tag
    return h % (tag_ub + 1)


def _nbytes(buffer: Any) -> int:
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

    def __init__(self, comm: Any = None, rank_process: Mapping[int, int] | None = None):
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
        self._comm = comm.Dup()
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._me = self._comm.Get_rank()
        self._proc = {int(r): int(p) for r, p in rank_process.items()}
        self._local = tuple(sorted(r for r, p in self._proc.items() if p == self._me))
        # Cut a casting sender's messages finer (views) only where every host has a core per process:
        # with more processes than cores the casts have no idle core to overlap the copies on, and the
        # extra chunks only cost. Agreed by all, since both ends of a message must chunk it alike.
        node = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        room = int(node.Get_size() <= (os.cpu_count() or 1))
        node.Free()
        self.pipelines_packs = bool(self._comm.allreduce(room, op=MPI.MIN))
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

    def start_rows(
        self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], *, timeout_s: float
    ) -> Posted:
        """Post one group (``Isend``/``Irecv``, the local copies done) and return it; its ``wait`` polls it
        until ``timeout_s`` after this call."""
        deadline = time.monotonic() + timeout_s
        pending = self._start(*ops_of_rows(sends, recvs, buffers))
        return _MpiPosted(self, pending, timeout_s, deadline)

    def _start(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp]) -> list[tuple[Any, SendOp | RecvOp]]:
        if self._broken is not None:
            raise PeerError(
                f"MpiComm is broken since an earlier failure ({self._broken}); "
                "the fix is to form a new communicator (and group) among the surviving processes",
                destination_intact=True,
            )
        for s in sends:
            if self.process_of(s.src) != self._me:
                raise ValueError(f"MpiComm.exchange: send from rank {s.src}, which process {self._me} does not drive")
        for r in recvs:
            if self.process_of(r.dst) != self._me:
                raise ValueError(f"MpiComm.exchange: receive at rank {r.dst}, which process {self._me} does not drive")
        key = lambda op: (op.src, op.dst, op.tag)  # noqa: E731
        sends = sorted(sends, key=key)
        recvs = sorted(recvs, key=key)
        local_recvs = [r for r in recvs if self.process_of(r.src) == self._me]
        remote_recvs = [r for r in recvs if self.process_of(r.src) != self._me]
        local_sends = [s for s in sends if self.process_of(s.dst) == self._me]
        pending: list[tuple[Any, SendOp | RecvOp]] = []
        try:
            for r in remote_recvs:
                req = self._comm.Irecv(r.buffer, source=self._proc[r.src], tag=self._tag(r))
                pending.append((req, r))
            for s in sends:
                if self.process_of(s.dst) != self._me:
                    req = self._comm.Isend(s.buffer, dest=self._proc[s.dst], tag=self._tag(s))
                    pending.append((req, s))
        except self._MPI.Exception as err:
            self._abort(pending, f"MPI error while posting: {err}")
            raise PeerError(f"MpiComm.exchange: MPI error while posting the group: {err}") from err
        try:  # messages between ranks of this process: copies, matched as LocalComm matches them
            match_and_copy(local_sends, local_recvs)
        except PeerError:
            self._abort(pending, "unmatched local messages")
            raise
        return pending

    def _tag(self, op: SendOp | RecvOp) -> int:
        return _key_tag(op.src, op.dst, op.tag, self._tag_ub)

    def _wait(self, pending: list[tuple[Any, SendOp | RecvOp]], timeout_s: float, deadline: float) -> None:
        MPI = self._MPI
        sleep = 0.0
        while pending:
            reqs = [p[0] for p in pending]
            statuses = [MPI.Status() for _ in reqs]
            try:
                done = MPI.Request.Testsome(reqs, statuses)
            except MPI.Exception as err:
                self._abort(pending, f"MPI error: {err}")
                raise PeerError(
                    f"MpiComm.exchange: MPI reported a failure while waiting on ranks "
                    f"{_short([self._peer(op) for _, op in pending])}: {err}"
                ) from err
            if done:
                for i, status in zip(done, statuses, strict=False):  # statuses[k] belongs to done[k]
                    op = pending[i][1]
                    if isinstance(op, RecvOp):
                        got = status.Get_count(MPI.BYTE)
                        if got != _nbytes(op.buffer):
                            self._abort([p for j, p in enumerate(pending) if j not in done], "size mismatch")
                            raise PeerError(
                                f"MpiComm.exchange: rank {op.src} sent rank {op.dst} {got} bytes under tag "
                                f"{op.tag}, expected {_nbytes(op.buffer)}; the two sides planned differently"
                            )
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
        # Give cancels a moment to complete so receive buffers are released; never block.
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            try:
                if MPI.Request.Testall([r for r, _ in self._abandoned if r]):
                    self._abandoned.clear()
                    break
            except MPI.Exception:  # pragma: no cover
                break
            time.sleep(1e-3)

    def close(self) -> None:
        """Free the duplicate communicator (skipped when broken: a dead peer may never answer)."""
        if self._comm is None:
            return
        if self._broken is None:
            self._comm.Free()
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
