"""Verified boxes of one elastic refit (a source process and a destination process of a pair).

Every connection of elastic refit is authenticated and sealed, so every refit's messages are MACed on both
sides (:mod:`jreshard.refit.boxes`, :mod:`jreshard.engine.digest`):

1. the source process draws a nonce for each connection to a destination process and sends it, sealed,
   as its first word of the refit (``nixl.box.nonce``); the destination process waits for it (bounded by
   ``timeout_s``) before it posts its receives: the refit's MAC key derives from it;
2. both sides MAC every message that crosses between them as it is sent or lands;
3. when its rounds are done the source sends, sealed, the digest of each stream into that destination
   process (``nixl.box.digests``); the destination compares them with what landed before the version is
   staged. A mismatch is :class:`~jreshard.errors.IntegrityError` on the destination, which tells the
   trainer (``failed``, naming the streams and boxes) and keeps its previous version; the trainer names
   it among the replicas lost in its :class:`~jreshard.elastic.PushReport`.

The ops start with ``nixl.`` so the loops that read these connections leave them for the refit.
"""

from __future__ import annotations

import select
import time
from collections.abc import Mapping
from typing import Any

from jreshard.engine.digest import DigestComm, DigestCost, Digests
from jreshard.errors import PeerError, TransferTimeoutError
from jreshard.net.channel import Channel
from jreshard.options import Options
from jreshard.refit import boxes

__all__ = ["PairDigests"]

NONCE_OP = "nixl.box.nonce"
DIGESTS_OP = "nixl.box.digests"


def _wait(ch: Channel, op: str, timeout_s: float) -> dict:
    """The first message ``op`` on ``ch`` (removed), waiting up to ``timeout_s``.

    Raises:
      PeerError: the peer failed the refit (``nixl.fail``) or closed the connection.
      TransferTimeoutError: nothing came in time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        ch.pump()
        for i, m in enumerate(ch.inbox):
            if m.get("op") == "nixl.fail":
                raise PeerError(f"{ch.peer} failed the refit: {m.get('error', '?')}")
            if m.get("op") == op:
                del ch.inbox[i]
                return m
        if ch.eof:
            raise ch.closed_error()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"{ch.peer} sent no {op} within timeout_s={timeout_s}")
        select.select([ch], [], [], min(left, 0.05))


class PairDigests:
    """The digests of one process's side of a pair refit (final): :meth:`start` before the rounds,
    :attr:`comm` for them, :meth:`finish` after. Without a digest (no session and no ``verify``) ``comm``
    is the transport itself and nothing is done."""

    def __init__(
        self,
        comm: Any,
        digests: Digests | None,
        channels: Mapping[int, Channel],
        ranks: Mapping[int, range],
        source: bool,
        timeout_s: float,
    ):
        self.comm = comm
        self.digests = digests
        self._channels, self._ranks, self._source, self._timeout_s = dict(channels), ranks, source, timeout_s
        self._boxes: Any = lambda src, dst: "(unknown)"

    @classmethod
    def start(cls, pair: Any, process: int, channels: Mapping[int, Channel], comm: Any, options: Options) -> Any:
        """Agree the nonces (the destination waits for them), and wrap ``comm`` so every message is digested."""
        ranks = {p: pair.ranks(p) for p in channels}
        source = process < pair.n_src
        kind = boxes.mode(options, [ch.session for ch in channels.values()], always=True)
        if kind is None:
            return cls(comm, None, channels, ranks, source, options.timeout_s)
        nonces: dict[int, str] = {}
        if kind == "mac":
            for p, ch in channels.items():  # the source's first word of the refit, then the destination's wait
                if source:
                    nonces[p] = boxes.new_nonce()
                    ch.send_control({"op": NONCE_OP, "nonce": nonces[p]}, timeout_s=options.timeout_s)
            for p, ch in channels.items() if not source else ():
                nonces[p] = str(_wait(ch, NONCE_OP, options.timeout_s).get("nonce"))
        process_of = {r: p for p, rs in ranks.items() for r in rs}

        def mac_of(rank: int) -> Any:
            p = process_of[rank]
            return boxes.keyed(channels[p].session, nonces[p])

        digests = boxes.digests_for(kind, pair.ranks(process), mac_of)
        wrapped = DigestComm(comm)
        wrapped.begin(digests)
        out = cls(wrapped, digests, channels, ranks, source, options.timeout_s)
        if pair.views is not None:
            gv = pair.views.group
            names, layouts = list(gv.dst_names), [(None, d) for d in gv.dsts]
        else:
            names, layouts = list(pair.names), [(t.src, t.dst) for t in pair.plan.tensors]
        out._boxes = lambda src, dst: boxes.boxes_at(src, dst, names, layouts)
        return out

    def abandon(self) -> None:
        """The rounds failed: stop digesting (the worker let go of the buffers)."""
        if self.digests is not None:
            self.comm.end()

    def finish(self) -> DigestCost | None:
        """After the rounds: the source sends its streams' digests; the destination compares (its cost, or None).

        Raises:
          IntegrityError: on the destination, a stream's digests differ (the version must not be staged).
          PeerError, TransferTimeoutError: a source sent no digests, or malformed ones.
        """
        d = self.digests
        if d is None:
            return None
        try:
            self.comm.finish()
        finally:
            self.comm.end()
        mine = d.streams()
        if self._source:
            for p, ch in self._channels.items():
                theirs = {k: v for k, v in mine["sent"].items() if int(k.split(">")[1]) in self._ranks[p]}
                ch.send_control({"op": DIGESTS_OP, "sent": theirs}, timeout_s=self._timeout_s)
            return d.cost()
        sent: dict[str, str] = {}
        for ch in self._channels.values():
            msg = _wait(ch, DIGESTS_OP, self._timeout_s)
            got, _ = boxes.streams_of({"digests": {"sent": msg.get("sent"), "landed": {}}}, ch.peer)
            sent.update(got)
        process_of = {r: p for p, rs in self._ranks.items() for r in rs}
        peer = {r: self._channels[p].peer for r, p in process_of.items()}

        def describe(r: int) -> str:
            return f"rank {r} ({peer[r]})" if r in peer else f"rank {r} (this process)"

        boxes.check(sent, mine["landed"], describe=describe, boxes=self._boxes, kind=d.kind)
        return d.cost()
