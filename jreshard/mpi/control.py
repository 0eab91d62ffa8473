"""The control plane of multi-process transfers: small messages between MPI processes, with deadlines.

Declarations, votes and version headers are a few hundred bytes, exchanged
all-to-all among the processes of a group with non-blocking point-to-point
calls (``isend``, ``improbe`` + matched ``irecv``) polled against a deadline, so
a dead or silent peer turns into :class:`TransferTimeoutError` naming it,
never a hang. MPI's blocking collectives (``allgather``, ``barrier``) cannot
time out and are not used here.

Every process calls the operations of one :class:`Control` in the same order;
the n-th operation uses MPI tag ``n``, so a message left over from a failed
operation never matches a later one. The highest tag is reserved for the
notice :meth:`Control.notify_closed` sends: a process waiting on a peer that
closed raises :class:`PeerError` at once instead of after ``timeout_s``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from jreshard.errors import PeerError, TransferTimeoutError
from jreshard.mpi.comm import dup_within, import_mpi
from jreshard.types import ControlObject, MpiCommunicator

__all__ = ["Control"]

_GENERATIONS = itertools.count()


class Control:
    """All-to-all exchange of small Python objects among MPI processes, with a deadline (final).

    Args:
      comm: an mpi4py intracommunicator; it is duplicated, which every process of it must do (collectively).
      describe: names a process in error messages (default ``"process p"``).
      timeout_s: the longest wait for every process of ``comm`` to make its ``Control``.
      what: what the processes form, for that error's message.

    Raises:
      TransferTimeoutError: not every process of ``comm`` made its ``Control`` within ``timeout_s``.

    Example:
      >>> from mpi4py import MPI
      >>> Control(MPI.COMM_SELF).allgather({"ok": True}, timeout_s=1.0)
      {0: {'ok': True}}
    """

    def __init__(
        self,
        comm: MpiCommunicator,
        describe: Callable[[int], str] | None = None,
        *,
        timeout_s: float = 300.0,
        what: str = "forming the refit group",
    ):
        MPI = import_mpi()
        self._MPI = MPI
        self._comm = dup_within(comm, timeout_s, what)
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        ub = self._comm.Get_attr(MPI.TAG_UB)
        self._tag_ub = int(ub) if ub else 32767
        self._closed_tag = self._tag_ub  # reserved: "this process closed"; operations use tags below it
        self._closed: set[int] = set()  # peers whose notice arrived
        # Every process makes its Controls in the same (collective) order, so this numbers one group
        # alike everywhere. A close notice carries it: a notice left unreceived on a freed communicator
        # (MPI may give its context to the next duplicate) never closes a later group.
        self._generation = next(_GENERATIONS)
        self._seq = 0
        self._describe = describe or (lambda p: f"process {p}")
        self._leftover: list[Any] = []

    @property
    def comm(self) -> MpiCommunicator:
        """The private duplicate communicator."""
        return self._comm

    def allgather(
        self,
        obj: ControlObject,
        *,
        timeout_s: float,
        peers: Sequence[int] | None = None,
        stop: Callable[[int, Any], bool] | None = None,
    ) -> dict[int, Any]:
        """Send ``obj`` to every process of ``peers`` (default: all) and collect theirs.

        Args:
          obj: a small picklable object.
          timeout_s: the longest wait for any peer.
          peers: the processes taking part; this process must be one of them.
          stop: called as ``stop(process, obj)`` on each arrival; returning true
            ends the wait early (the answers gathered so far are returned).

        Returns:
          ``{process: obj}``, this process included.

        Raises:
          TransferTimeoutError: a peer did not answer within ``timeout_s``; the
            message names it.
        """
        MPI = self._MPI
        peers = list(range(self.size)) if peers is None else sorted(set(peers))
        if self.rank not in peers:
            raise ValueError(f"Control.allgather: process {self.rank} is not among peers={peers}")
        tag = self._seq % self._closed_tag
        self._seq += 1
        out: dict[int, Any] = {self.rank: obj}
        others = [p for p in peers if p != self.rank]
        sends = [self._comm.isend(obj, dest=p, tag=tag) for p in others]
        waiting: dict[int, Any] = {}  # process -> receive request once its message is matched
        unmatched = set(others)
        deadline = time.monotonic() + timeout_s
        sleep = 0.0
        try:
            while unmatched or waiting:
                progressed = False
                for p in sorted(unmatched):
                    msg = self._comm.improbe(source=p, tag=tag)
                    if msg is not None:
                        waiting[p] = msg.irecv()
                        unmatched.discard(p)
                        progressed = True
                self._check_closed(sorted(unmatched), tag)  # a peer that sent before closing is not gone
                for p in sorted(waiting):
                    done, value = waiting[p].test()
                    if done:
                        del waiting[p]
                        out[p] = value
                        progressed = True
                        if stop is not None and stop(p, value):
                            self._leftover.extend(waiting.values())
                            return out
                if progressed:
                    sleep = 0.0
                    continue
                if time.monotonic() > deadline:
                    silent = sorted(unmatched | set(waiting))
                    self._leftover.extend(waiting.values())
                    raise TransferTimeoutError(
                        f"no answer within {timeout_s:.3g} s from "
                        f"{', '.join(self._describe(p) for p in silent)}: it died or stopped answering"
                    )
                time.sleep(sleep)
                sleep = min(2 * sleep + 1e-5, 1e-3)
        except MPI.Exception as err:
            raise PeerError(f"MPI reported a failure in the control exchange: {err}") from err
        finally:
            self._finish_sends(sends)
        return out

    def _check_closed(self, peers: Sequence[int], tag: int) -> None:
        """Raise :class:`PeerError` if one of ``peers`` closed without sending its ``tag`` message."""
        for p in peers:
            while p not in self._closed and self._comm.iprobe(source=p, tag=self._closed_tag):
                if self._comm.recv(source=p, tag=self._closed_tag) == ("closed", self._generation):
                    self._closed.add(p)  # (a notice of an earlier group is dropped)
        gone = [p for p in peers if p in self._closed and not self._comm.iprobe(source=p, tag=tag)]
        if gone:
            raise PeerError(
                f"{', '.join(self._describe(p) for p in gone)} closed the group while this process waited on it",
                destination_intact=True,
            )

    def notify_closed(self) -> None:
        """Tell every other process that this one is closing (best effort; never blocks).

        Example:
          >>> from mpi4py import MPI
          >>> Control(MPI.COMM_SELF).notify_closed()  # no other process: nothing to tell
        """
        if self._comm is None:
            return
        sends = []
        for p in range(self.size):
            if p != self.rank:
                try:
                    sends.append(self._comm.isend(("closed", self._generation), dest=p, tag=self._closed_tag))
                except self._MPI.Exception:  # pragma: no cover - best effort
                    pass
        self._finish_sends(sends)

    def _finish_sends(self, sends: list[Any]) -> None:
        """Small sends complete locally (eager protocol); keep any that have not, never block."""
        for s in sends:
            try:
                if not s.Test():
                    self._leftover.append(s)
            except self._MPI.Exception:  # pragma: no cover - best effort
                pass

    def close(self) -> None:
        """Release the communicator when nothing is outstanding; after a failure keep it (a dead
        peer may never answer, and freeing it could block)."""
        if self._comm is not None and not self._leftover:
            self._comm.Free()
        self._comm = None
