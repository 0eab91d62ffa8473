"""RecordingComm: message passing in one process that logs every message.

Tests assert on communication, not only on values: every chunk a rank sends is
logged as a :class:`Record` ``(sender, receiver, bytes, link)``, so a test can
compare the bytes per link with the plan's statistics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jreshard.engine.comm import Communicator, RecvOp, SendOp
from jreshard.engine.loopback import match_and_copy
from jreshard.engine.record import Opened, Reach, TransportRecord
from jreshard.errors import PeerError
from jreshard.options import Options
from jreshard.sharding.topology import Link, Topology
from jreshard.types import Device

__all__ = ["RECORD", "Record", "RecordingComm"]


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """One message chunk: ``nbytes`` from ``sender`` to ``receiver`` over ``link``, in group ``group``."""

    sender: int
    receiver: int
    nbytes: int
    link: Link
    tag: int
    group: int


class RecordingComm(Communicator):
    """Matches sends to receives by ``(src, dst, tag)``, copies the bytes, and records each message (final).

    Args:
      ranks: the ranks this process runs (all of them, in one process).
      topology: gives each message its link kind.

    Example:
      >>> import numpy as np
      >>> comm = RecordingComm(ranks=[0, 1], topology=Topology.uniform([0, 1], domain_size=1))
      >>> send, recv = SendOp(0, 1, 0, np.ones(3, np.uint8)), RecvOp(0, 1, 0, np.zeros(3, np.uint8))
      >>> comm.exchange([send], [recv], timeout_s=1.0)
      >>> comm.records
      [Record(sender=0, receiver=1, nbytes=3, link=<Link.NETWORK: 2>, tag=0, group=0)]
      >>> comm.bytes_by_link()[Link.NETWORK]
      3
    """

    def __init__(self, ranks: Sequence[int], topology: Topology):
        self._ranks = tuple(sorted(int(r) for r in ranks))
        self._topology = topology
        self.records: list[Record] = []
        self.groups = 0

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._ranks

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        outside = sorted({s.src for s in sends} - set(self._ranks)) + sorted({r.dst for r in recvs} - set(self._ranks))
        if outside:
            raise PeerError(f"RecordingComm over ranks {self._ranks} was given ops of ranks {outside}")
        pairs = match_and_copy(sends, recvs)
        for s, _ in pairs:
            link = self._topology.link(s.src, s.dst)
            self.records.append(Record(s.src, s.dst, len(s.buffer), link, s.tag, self.groups))
        self.groups += 1

    def most_ops_in_a_group(self) -> int:
        """The most operations one rank posted in one exchange group (a send and a receive are one each;
        a message a rank sends itself is both); 0 when nothing was recorded."""
        per: dict[tuple[int, int], int] = {}
        for r in self.records:
            for rank in {r.sender, r.receiver}:
                per[(r.group, rank)] = per.get((r.group, rank), 0) + (2 if r.sender == r.receiver else 1)
        return max(per.values(), default=0)

    def bytes_by_link(self) -> dict[Link, int]:
        """Bytes recorded per link kind."""
        out = dict.fromkeys(Link, 0)
        for r in self.records:
            out[r.link] += r.nbytes
        return out

    def bytes_by_pair(self) -> dict[tuple[int, int], int]:
        """Bytes recorded per ``(sender, receiver)``."""
        out: dict[tuple[int, int], int] = {}
        for r in self.records:
            out[(r.sender, r.receiver)] = out.get((r.sender, r.receiver), 0) + r.nbytes
        return out


def _open(devices: Mapping[int, Device], single_process: bool, options: Options, topology: Topology | None) -> Opened:
    topology = topology or Topology.from_devices(list(devices.values()))
    return Opened(comm=RecordingComm(sorted(devices), topology))


RECORD: TransportRecord[None] = TransportRecord(
    name="recording",
    summary="copies between the ranks of one process that log every message (tests count them)",
    serves=frozenset({Reach.CPU_ONE_PROCESS}),
    open=_open,
)
"""The recording transport, registered like any other (it runs the engine over :class:`RecordingComm`)."""
