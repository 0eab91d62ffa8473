"""A communicator that flips one byte of one message in flight, for the verified-box tests.

:class:`FlipComm` wraps a transport's communicator (MPI, NIXL, ...): every group goes to the real one, and
once the ``nth`` message received from another process has landed, one byte of it is flipped before the
layers above see it, as a writer on the wire would. With ``prepared=False`` no prepared groups are made (every
group is posted afresh, so the flip sees it); with ``prepared=True`` the transport's prepared groups run as
they do (over MPI in the compiled replay), observed: the flip happens in the hook the replay calls when a
group's wait returned, before the digests above see the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jreshard.engine.comm import Communicator, Posted, PreparedGroups, RecvOp, Row, SendOp, WrappedGroups


class FlipComm(Communicator):
    """``inner``, but byte ``at`` of the ``nth`` message (1-based) received from another process is flipped (a rank
    not in ``local``: by default the ranks of ``inner``'s process)."""

    def __init__(
        self,
        inner: Communicator,
        *,
        nth: int = 1,
        at: int = 0,
        prepared: bool = False,
        local: Sequence[int] | None = None,
    ):
        self.inner, self.nth, self.at, self.prepared = inner, nth, at, prepared
        self.local = frozenset(inner.local_ranks if local is None else local)
        self.posts_ahead = inner.posts_ahead
        self.pipelines_packs = inner.pipelines_packs
        self.seen = 0
        self.flipped = 0

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.inner.local_ranks

    def _landed(self, ops: Sequence[tuple[int, Any]]) -> None:
        for src, buf in ops:
            if src in self.local or not buf.nbytes:
                continue
            self.seen += 1
            if self.seen == self.nth:
                buf[min(self.at, buf.nbytes - 1)] ^= 0x10
                self.flipped += 1

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        self.inner.exchange(sends, recvs, timeout_s=timeout_s)
        self._landed([(r.src, r.buffer) for r in recvs])

    def exchange_rows(
        self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], *, timeout_s: float
    ) -> None:
        self.inner.exchange_rows(sends, recvs, buffers, timeout_s=timeout_s)
        self._landed([(s, buffers[b][o : o + n]) for s, _, _, b, o, n in recvs])

    def start_rows(
        self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], *, timeout_s: float
    ) -> Posted:
        posted = self.inner.start_rows(sends, recvs, buffers, timeout_s=timeout_s)
        flip = self

        class _Posted(Posted):
            def wait(self) -> None:
                posted.wait()
                flip._landed([(s, buffers[b][o : o + n]) for s, _, _, b, o, n in recvs])

            def abort(self, why: str) -> None:
                posted.abort(why)

        return _Posted()

    def prepare(self, groups: Any) -> PreparedGroups | None:
        inner = self.inner.prepare(groups) if self.prepared else None
        return None if inner is None else _FlipPrepared(self, inner, groups)

    def close(self) -> None:
        self.inner.close()


class _FlipPrepared(WrappedGroups):
    """The transport's prepared groups; the nth message received from another process flipped as its group's wait
    returns (the replay calls :meth:`landed` there, compiled or not)."""

    observes = True

    def __init__(self, flip: FlipComm, inner: PreparedGroups, groups: Any):
        super().__init__(inner)
        self._flip, self._groups = flip, list(groups)
        self._buffers: Sequence[Any] = ()

    def bind(self, addresses: Any, sizes: Any, buffers: Sequence[Any]) -> None:
        self._inner.bind(addresses, sizes, buffers)
        self._buffers = buffers

    def finish(self) -> None:
        self._inner.finish()
        self._buffers = ()

    def landed(self, group: int, recvs_kept: int) -> None:
        recvs = self._groups[group][1]
        self._flip._landed([(s, self._buffers[b][o : o + n]) for s, _, _, b, o, n in recvs])


def plant(group: Any, **kw: Any) -> FlipComm:
    """Put a :class:`FlipComm` under ``group``'s digests (a :class:`~jreshard.refit.RefitGroup` whose messages are
    digested): its transport's messages flip before they are digested."""
    from jreshard.engine import replay

    digesting = group._comm
    flip = FlipComm(digesting.inner, **kw)
    digesting.inner = flip
    replay.release(digesting)  # the refits prepared on the real transport are made again, through the flip
    return flip


def unplant(group: Any, flip: FlipComm) -> None:
    from jreshard.engine import replay

    group._comm.inner = flip.inner
    replay.release(group._comm)
