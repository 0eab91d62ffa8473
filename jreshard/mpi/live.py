"""LiveComm: MPI between two launches, never posting to a peer known dead.

Between two MPI launches a process that posts a message to a peer that died may crash inside MPICH
(seen with UCX over TCP: SIGSEGV at the first send to the dead peer). :class:`LiveComm` wraps the
:class:`~jreshard.mpi.comm.MpiComm` that carries a :class:`~jreshard.RefitGroup`'s weights between
launches and asks a side channel (the group's TCP connections, which the kernel closes when a
process dies) before each group is posted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jreshard.engine.comm import Communicator, Posted, PreparedGroups, RecvOp, SendOp, WrappedGroups
from jreshard.errors import PeerError
from jreshard.mpi.comm import MpiComm

__all__ = ["LiveComm"]


class LiveComm(Communicator):
    """An :class:`~jreshard.mpi.comm.MpiComm` whose peers' liveness is read over a side channel (final).

    Between two MPI launches a process that posts a message to a peer that died may crash inside
    MPICH (seen with UCX over TCP: SIGSEGV at the first send to the dead peer). Before each group is
    posted, ``gone`` (the TCP connections of :class:`~jreshard.nixl.group.ProcessGroup`, closed by the
    kernel when a process dies) is asked whether a peer of the group is gone; if one is, the group
    raises :class:`PeerError` naming it and nothing is posted. Prepared groups (MPI's persistent requests,
    replayed by the engine) are checked the same way when a step binds them and when Python starts one; a
    step the compiled replay runs starts its groups in C, so a peer that dies during that step is seen by
    the replay's bounded waits, and by this check at the next step. Everything else is the wrapped
    communicator's.

    Args:
      comm: the data communicator.
      gone: ``gone(processes)``: those of ``processes`` known dead or closed.
      describe: names a process in error messages.
    """

    def __init__(self, comm: MpiComm, gone: Callable[[Sequence[int]], list[int]], describe: Callable[[int], str]):
        self._inner = comm
        self._gone = gone
        self._describe = describe
        self.dead: list[int] = []  # the peers found gone (nothing was posted to them since)

    @property
    def inner(self) -> MpiComm:
        """The wrapped communicator."""
        return self._inner

    @property
    def posts_ahead(self) -> bool:  # type: ignore[override]
        return bool(self._inner.posts_ahead)

    @property
    def pipelines_packs(self) -> bool:  # type: ignore[override]
        return bool(self._inner.pipelines_packs)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return tuple(self._inner.local_ranks)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _check(self, ranks: Sequence[int]) -> None:
        mine = set(self._inner.local_ranks)
        processes = sorted({self._inner.process_of(r) for r in set(ranks) - mine})
        dead = self._gone(processes) if processes else []
        if dead:
            self.dead = sorted(set(self.dead) | set(dead))
            raise PeerError(
                f"{', '.join(self._describe(p) for p in dead)} is gone (its connection closed: it exited, was "
                "killed, or closed the group); nothing was sent to it",
                destination_intact=True,
            )

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        self._check([s.dst for s in sends] + [r.src for r in recvs])
        self._inner.exchange(sends, recvs, timeout_s=timeout_s)

    def exchange_sized(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> list[int]:
        self._check([s.dst for s in sends] + [r.src for r in recvs])
        return self._inner.exchange_sized(sends, recvs, timeout_s=timeout_s)

    def exchange_rows(
        self, sends: Sequence[Any], recvs: Sequence[Any], buffers: Sequence[Any], *, timeout_s: float
    ) -> None:
        self._check([row[1] for row in sends] + [row[0] for row in recvs])
        self._inner.exchange_rows(sends, recvs, buffers, timeout_s=timeout_s)

    def start_rows(
        self, sends: Sequence[Any], recvs: Sequence[Any], buffers: Sequence[Any], *, timeout_s: float
    ) -> Posted:
        self._check([row[1] for row in sends] + [row[0] for row in recvs])
        return self._inner.start_rows(sends, recvs, buffers, timeout_s=timeout_s)

    def prepare(self, groups: Sequence[Any]) -> PreparedGroups | None:
        inner = self._inner.prepare(groups)
        if inner is None:
            return None
        ranks = [[row[1] for row in sends] + [row[0] for row in recvs] for sends, recvs in groups]
        return _LivePrepared(inner, self._check, ranks)

    def close(self) -> None:
        self._inner.close()


class _LivePrepared(WrappedGroups):
    """Prepared groups whose peers are checked (``check(ranks)``) before a step binds them and before a group
    is started from Python; everything else is the wrapped groups' (final)."""

    def __init__(self, inner: PreparedGroups, check: Callable[[Sequence[int]], None], ranks: list[list[int]]):
        super().__init__(inner)
        self._check_ranks, self._ranks = check, ranks
        self._all = sorted({r for rs in ranks for r in rs})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def bind(self, addresses: np.ndarray, sizes: np.ndarray, buffers: Sequence[Any]) -> None:
        self._check_ranks(self._all)
        self._inner.bind(addresses, sizes, buffers)

    def start(self, group: int, timeout_s: float) -> None:
        self._check_ranks(self._ranks[group])
        self._inner.start(group, timeout_s)
