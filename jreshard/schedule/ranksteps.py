"""One rank's steps held as tables: numpy columns in round order, a ``Step`` made only when asked.

A per-process schedule (:mod:`jreshard.schedule.pairsched`) of a large refit has thousands of
rounds and tens of thousands of chunks per rank. :class:`RankSteps` keeps their wires and
descriptor rows as numpy columns, in round order, and is the ``schedule.steps[rank]``
mapping. The engine reads the columns whole (:attr:`RankSteps.columns`) when it compiles
its rounds; reading ``steps[rank][round]`` builds that round's :class:`Step` (its ``Wire``
values and views of its descriptor rows), for tests and tools that look at one round.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np

from jreshard.schedule import kernels
from jreshard.schedule.steps import STAGING, Step, Wire
from jreshard.sharding.topology import Link

__all__ = ["RankColumns", "RankSteps", "WireColumns"]

_LINKS = tuple(Link)
WireColumns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # peer..offset


class RankColumns(NamedTuple):
    """:class:`RankSteps`' tables: its arguments, each an array (see there)."""

    rounds: np.ndarray
    sends: WireColumns
    recvs: WireColumns
    send_at: np.ndarray
    recv_at: np.ndarray
    pack: np.ndarray
    unpack: np.ndarray
    pack_at: np.ndarray
    unpack_at: np.ndarray


class RankSteps(Mapping[int, Step]):
    """``{round: Step}`` of one rank, built from columns when read (final).

    Args:
      rounds: the rounds the rank takes part in, increasing.
      sends, recvs: wire columns ``(peer, tag, link, nbytes, buf, offset)`` in round order.
      send_at, recv_at: ``len(rounds) + 1`` offsets: round ``rounds[i]``'s wires are rows
        ``at[i]:at[i + 1]``.
      pack, unpack: descriptor rows in round order, with offsets ``pack_at``, ``unpack_at``.
    """

    __slots__ = ("_at", "_pack", "_recvs", "_rounds", "_sends", "_unpack")

    def __init__(
        self,
        rounds: np.ndarray,
        sends: WireColumns,
        recvs: WireColumns,
        send_at: np.ndarray,
        recv_at: np.ndarray,
        pack: np.ndarray,
        unpack: np.ndarray,
        pack_at: np.ndarray,
        unpack_at: np.ndarray,
    ):
        self._rounds = rounds.tolist()
        self._sends, self._recvs = sends, recvs
        self._pack, self._unpack = pack, unpack
        self._at = (send_at.tolist(), recv_at.tolist(), pack_at.tolist(), unpack_at.tolist())

    def __len__(self) -> int:
        return len(self._rounds)

    def __iter__(self) -> Iterator[int]:
        return iter(self._rounds)

    def __contains__(self, rnd: object) -> bool:
        i = bisect.bisect_left(self._rounds, rnd)  # type: ignore[type-var]
        return i < len(self._rounds) and self._rounds[i] == rnd

    def __getitem__(self, rnd: int) -> Step:
        i = bisect.bisect_left(self._rounds, rnd)
        if i == len(self._rounds) or self._rounds[i] != rnd:
            raise KeyError(rnd)
        s, v, p, u = self._at
        return Step(
            self._pack[p[i] : p[i + 1]],
            self._unpack[u[i] : u[i + 1]],
            _wires(self._sends, s[i], s[i + 1]),
            _wires(self._recvs, v[i], v[i + 1]),
        )

    @property
    def columns(self) -> RankColumns:
        """The tables themselves (read-only numpy arrays), for a reader that takes every round at once."""
        s, v, p, u = (np.asarray(a, np.int64) for a in self._at)
        return RankColumns(np.asarray(self._rounds, np.int64), self._sends, self._recvs, s, v, self._pack,
                           self._unpack, p, u)  # fmt: skip

    def buffers(self) -> set[int]:
        """Every shard buffer index the rank's steps read or write (not the staging arena)."""
        need = set(np.unique(self._pack[:, kernels.BUF]).tolist())
        need.update(np.unique(self._unpack[:, kernels.BUF]).tolist())
        for cols in (self._sends, self._recvs):
            buf = cols[4]
            need.update(np.unique(buf[buf != STAGING]).tolist())
        return need


def _wires(cols: WireColumns, a: int, b: int) -> tuple[Wire, ...]:
    if a == b:
        return ()
    peer, tag, link, nbytes, buf, off = (c[a:b].tolist() for c in cols)
    return tuple(map(Wire, peer, tag, map(_LINKS.__getitem__, link), nbytes, buf, off))
