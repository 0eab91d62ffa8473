"""Box digests: what each sender sent and each receiver landed, compared before a version is published.

A refit between programs moves every destination box as messages between ranks; the bytes of each
message are those its sender packed and those its receiver unpacks into the box. :class:`DigestComm`
wraps a process's :class:`Communicator` and digests, message by message, the bytes of every message
that crosses to or from another process: a send's bytes once packed (they do not change until its group
completes), a receive's once it landed (before anything writes over them). Per
stream ``(src rank, dst rank)`` the messages' digests, in the order the two ranks matched them, fold
into one :func:`stream digest <Digests.streams>`; the sending and the receiving process each hold
theirs, the caller exchanges them (the commit vote of a group, the staging answer of an elastic
replica) and :func:`mismatches` compares them. Every destination box is the union of the streams
into its rank, so two equal digests for every stream mean every destination box holds what its
sources sent; a message altered on the wire, dropped or written by someone else makes its stream
differ, and the version is refused everywhere before it is published.

Two digests share this machinery (``digest`` of :class:`Digests`, one call per message):

- **a keyed MAC**, when the programs share a secret: the caller's function (an AES-GMAC tag under a
  key derived from the connection's session and the refit's nonce, each message under its own GCM nonce,
  its label: :meth:`jreshard.net.auth.Session.box_macs`); nobody without the secret can make a stream match;
- **a plain fast hash** for ``Options(verify=True)`` (:func:`plain`: XXH3-128 from the ``xxhash``
  package), which catches corruption (a flipped bit, a short or misplaced write), not an attacker.

Copies between two ranks of one process cross no wire and are not digested. Device (CuPy)
buffers are digested from a host copy of their bytes (not run on GPU).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import struct
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.engine.comm import (
    LANDED,
    STARTING,
    WAITING,
    Communicator,
    Group,
    Posted,
    PreparedGroups,
    RecvOp,
    Row,
    SendOp,
    WrappedGroups,
    hook_point,
)
from jreshard.errors import BackendUnavailableError
from jreshard.types import ByteBuffer

__all__ = ["DigestComm", "DigestCost", "Digester", "Digests", "mismatches", "plain", "stream_key"]

Digester = Callable[[int, bytes, Any], bytes]
"""``digest(peer rank, label, bytes) -> digest`` of one message; ``label`` names the message (its ranks, tag and
occurrence) and the peer is the rank at the other end (a keyed digest uses the key it shares with that peer)."""


def plain() -> Digester:
    """The digest of ``Options(verify=True)`` without a secret: XXH3-128 (``xxhash``, about 30 GB/s on one core).

    Raises:
      BackendUnavailableError: ``xxhash`` is not installed (``pip install 'jreshard[verify]'``).

    Example:
      >>> d = plain()
      >>> d(0, b"m", b"weights") == d(1, b"m", b"weights"), d(0, b"m", b"weights") == d(0, b"m", b"weightz")
      (True, False)
    """
    try:
        import xxhash
    except ImportError:
        raise BackendUnavailableError(
            "Options(verify=True) hashes with the xxhash package, which is not installed: "
            "pip install 'jreshard[verify]' (or xxhash)"
        ) from None
    h = xxhash.xxh3_128_digest

    def digest(peer: int, label: bytes, data: Any) -> bytes:
        return h(label) + h(data)

    return digest


def _host(buffer: ByteBuffer) -> Any:
    """The bytes of ``buffer`` in host memory: itself, or a host copy of a device (CuPy) array (not run on GPU)."""
    if hasattr(buffer, "__cuda_array_interface__"):
        return np.ascontiguousarray(buffer.get())  # not run on GPU
    return buffer


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DigestCost:
    """What digesting one refit cost one process.

    Attributes:
      kind: ``"mac"`` (keyed, a shared secret) or ``"hash"`` (``verify=True``).
      seconds: time spent computing digests (on :class:`DigestComm`'s worker thread, overlapped with the
        transfer where it can be).
      waited_s: the part of it the refit waited for (on its critical path).
      nbytes: bytes digested (sent and received across processes).
      messages: messages digested.
    """

    kind: str
    seconds: float
    waited_s: float
    nbytes: int
    messages: int


def stream_key(src: int, dst: int) -> str:
    """The name of the stream from rank ``src`` to rank ``dst`` in a vote (a JSON object key)."""
    return f"{src}>{dst}"


class Digests:
    """The running digests of one refit on one process (final).

    Args:
      local: the ranks this process drives (messages between two of them are not digested).
      digest: the digest of one message (:data:`Digester`).
      kind: ``"mac"`` or ``"hash"`` (reported).

    Example:
      >>> a, b = Digests((0,), plain(), "hash"), Digests((1,), plain(), "hash")
      >>> msg = np.arange(8, dtype=np.uint8)
      >>> a.add(0, 1, 7, msg); b.add(0, 1, 7, msg.copy())
      >>> mismatches(a.streams()["sent"], b.streams()["landed"])
      []
      >>> msg[3] ^= 1; b.add(0, 1, 8, msg); a.add(0, 1, 8, np.arange(8, dtype=np.uint8))
      >>> mismatches(a.streams()["sent"], b.streams()["landed"])
      [(0, 1, 'differ')]
    """

    __slots__ = ("_count", "_digest", "_local", "_parts", "kind", "messages", "nbytes", "seconds", "waited")

    def __init__(self, local: Sequence[int], digest: Digester, kind: str):
        self._local = frozenset(local)
        self._digest = digest
        self.kind = kind
        self._parts: dict[tuple[int, int], list[tuple[int, int, bytes]]] = {}
        self._count: dict[tuple[int, int, int], int] = {}
        self.seconds = 0.0
        self.waited = 0.0
        self.nbytes = 0
        self.messages = 0

    def add(self, src: int, dst: int, tag: int, buffer: ByteBuffer) -> None:
        """Digest one message ``src -> dst`` under ``tag`` (its ``n``-th under that key in this refit)."""
        t0 = time.perf_counter()
        key = (src, dst, tag)
        n = self._count.get(key, 0)
        self._count[key] = n + 1
        peer = dst if src in self._local else src
        data = _host(buffer)
        d = self._digest(peer, struct.pack("!qqqq", src, dst, tag, n), data)
        self._parts.setdefault((src, dst), []).append((tag, n, d))
        self.nbytes += int(data.nbytes) if hasattr(data, "nbytes") else len(data)
        self.messages += 1
        self.seconds += time.perf_counter() - t0

    def streams(self) -> dict[str, dict[str, str]]:
        """``{"sent": {stream: digest}, "landed": {stream: digest}}`` (hex; streams by :func:`stream_key`): per
        stream, the digests of its messages folded in the order ``(tag, occurrence)``."""
        out: dict[str, dict[str, str]] = {"sent": {}, "landed": {}}
        for (src, dst), parts in self._parts.items():
            h = hashlib.blake2b(digest_size=16, person=b"jreshard boxes")
            for tag, n, d in sorted(parts):
                h.update(struct.pack("!qqH", tag, n, len(d)) + d)
            out["sent" if src in self._local else "landed"][stream_key(src, dst)] = h.hexdigest()
        return out

    def cost(self) -> DigestCost:
        return DigestCost(
            kind=self.kind, seconds=self.seconds, waited_s=self.waited, nbytes=self.nbytes, messages=self.messages
        )


def mismatches(sent: Mapping[str, str], landed: Mapping[str, str]) -> list[tuple[int, int, str]]:
    """The streams whose two digests disagree: ``(src, dst, why)``, why ``"differ"``, ``"not received"``
    (the sender digested it, no receiver did) or ``"not sent"``; sorted.

    Raises:
      ValueError: a stream name that is not ``"src>dst"`` (a malformed vote).
    """
    out = []
    for k in set(sent) | set(landed):
        try:
            src, dst = (int(x) for x in str(k).split(">"))
        except ValueError:
            raise ValueError(f"mismatches: {k!r} is not a stream name 'src>dst'") from None
        if k not in landed:
            out.append((src, dst, "not received"))
        elif k not in sent:
            out.append((src, dst, "not sent"))
        elif sent[k] != landed[k]:
            out.append((src, dst, "differ"))
    return sorted(out)


class DigestComm(Communicator):
    """A communicator that digests every message crossing processes (final); see the module docstring.

    Between refits it passes messages through undigested; :meth:`begin` starts a refit's digests, :meth:`finish`
    waits for the last ones (raising a digest's failure) and :meth:`end` stops. Made once per group and kept
    (replays are cached per communicator).

    Where the digests run. By default in the caller's thread. In a prepared refit (the transport's prepared groups,
    replayed in the compiled loop where it has one, see ``_DigestPrepared``), message by message while each is in
    the cache: a send right after the pack that wrote it last (written with plain stores for that), a receive right
    after the unpack that read it last (a message of 2 MiB at most, as a digested refit cuts them:
    ``jreshard.refit.boxes``). Each group posted afresh: its sends just before it is posted, its receives as it
    completed. With :attr:`overlap` set, on a worker thread instead (the MAC and the hash release the GIL), each
    started at the same place and joined before anything may write it again. On the 2-core development machine the
    worker made the refit slower than inline (``benchmarks/nixl_bench.py``, rows ``nixl-overlap`` and
    ``mpi-verify-overlap``), so inline is the default; the worker may pay where a core is free for it (not
    measured). The time the caller waited for digests is :attr:`DigestCost.waited_s` (inline: all of it).

    Args:
      inner: the transport's communicator.
    """

    def __init__(self, inner: Communicator):
        self.inner = inner
        self.posts_ahead = inner.posts_ahead
        self.pipelines_packs = inner.pipelines_packs
        self._mine = frozenset(inner.local_ranks)
        self.digests: Digests | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None  # the last group's receives, being digested
        self.overlap = False  # digest on a worker thread beside the transfer (False: in the caller's thread)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self.inner.local_ranks

    def begin(self, digests: Digests) -> None:
        """Digest every message from now on into ``digests``."""
        self.end()
        self.digests = digests
        if self.overlap:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jreshard-digest")

    def finish(self) -> None:
        """Wait until every message so far is digested.

        Raises:
          whatever a digest raised (e.g. ``BackendUnavailableError``, or a malformed nonce's ``PeerError``).
        """
        self._join(self._pending)
        self._pending = None

    def end(self) -> Digests | None:
        """Stop digesting (never raises: a failed refit ends here too); the refit's digests (``None`` if none)."""
        d, self.digests = self.digests, None
        pool, self._pool, self._pending = self._pool, None, None
        if pool is not None:
            pool.shutdown(wait=True)  # a digest still running reads buffers the caller is about to let go
        return d

    def _submit(self, ops: list[tuple[int, int, int, Any]]) -> concurrent.futures.Future | None:
        d, pool = self.digests, self._pool
        if d is None or not ops:
            return None
        if pool is None:  # not overlapped: now, and all of it waited for
            t0 = time.perf_counter()
            _add(d, ops)
            d.waited += time.perf_counter() - t0
            return None
        return pool.submit(_add, d, ops)

    def _join(self, fut: concurrent.futures.Future | None) -> None:
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            if self.digests is not None:
                self.digests.waited += time.perf_counter() - t0

    def _sends(self, ops: Sequence[tuple[int, int, int, Any]]) -> concurrent.futures.Future | None:
        """Start digesting a group's sends to other processes (after the last group's receives are digested)."""
        self.finish()
        return self._submit([o for o in ops if o[1] not in self._mine])

    def _recvs(self, ops: Sequence[tuple[int, int, int, Any]]) -> None:
        """Start digesting a group's receives from other processes (joined by the next group, or :meth:`finish`)."""
        self._pending = self._submit([o for o in ops if o[0] not in self._mine])

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        fut = self._sends([(s.src, s.dst, s.tag, s.buffer) for s in sends])
        self.inner.exchange(sends, recvs, timeout_s=timeout_s)
        self._join(fut)
        self._recvs([(r.src, r.dst, r.tag, r.buffer) for r in recvs])

    def exchange_sized(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> list[int]:
        """The inner transport's :meth:`~Communicator.exchange_sized`; a receive is digested as the bytes that
        landed (the first ``size`` of its buffer), as its sender digested what it sent."""
        fut = self._sends([(s.src, s.dst, s.tag, s.buffer) for s in sends])
        sizes = self.inner.exchange_sized(sends, recvs, timeout_s=timeout_s)
        self._join(fut)
        self._recvs([(r.src, r.dst, r.tag, r.buffer[:n]) for r, n in zip(recvs, sizes, strict=True)])
        return sizes

    def exchange_rows(
        self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], *, timeout_s: float
    ) -> None:
        fut = self._sends(_ops(sends, buffers))
        self.inner.exchange_rows(sends, recvs, buffers, timeout_s=timeout_s)
        self._join(fut)
        self._recvs(_ops(recvs, buffers))

    def start_rows(
        self, sends: Sequence[Row], recvs: Sequence[Row], buffers: Sequence[Any], *, timeout_s: float
    ) -> Posted:
        fut = self._sends(_ops(sends, buffers))
        posted = self.inner.start_rows(sends, recvs, buffers, timeout_s=timeout_s)
        return _DigestPosted(self, posted, fut, recvs, buffers)

    def prepare(self, groups: Sequence[Group]) -> PreparedGroups | None:
        inner = self.inner.prepare(groups)
        return None if inner is None else _DigestPrepared(self, inner, groups)

    def close(self) -> None:
        from jreshard.engine import replay

        self.end()
        replay.release(self)
        self.inner.close()


def _add(d: Digests, ops: Sequence[tuple[int, int, int, Any]]) -> None:
    for src, dst, tag, b in ops:
        d.add(src, dst, tag, b)


def _ops(rows: Sequence[Row], buffers: Sequence[Any]) -> list[tuple[int, int, int, Any]]:
    return [(s, d, t, buffers[b][o : o + n]) for s, d, t, b, o, n in rows]


class _DigestPosted(Posted):
    __slots__ = ("_buffers", "_comm", "_fut", "_inner", "_recvs")

    def __init__(
        self,
        comm: DigestComm,
        inner: Posted,
        fut: concurrent.futures.Future | None,
        recvs: Sequence[Row],
        buffers: Sequence[Any],
    ):
        self._comm, self._inner, self._fut, self._recvs, self._buffers = comm, inner, fut, recvs, buffers

    def wait(self) -> None:
        self._inner.wait()
        self._comm._join(self._fut)
        self._comm._recvs(_ops(self._recvs, self._buffers))

    def abort(self, why: str) -> None:
        self._inner.abort(why)


class _DigestPrepared(WrappedGroups):
    """The transport's prepared groups, observed (:attr:`PreparedGroups.observes`) message by message
    (:attr:`PreparedGroups.by_message`): the replay, compiled or from Python, hands each send over as soon as its
    last pack ran (that pack then writes with plain stores, so the digest reads the bytes from the cache, not from
    memory), each receive as soon as its last unpack ran (which read it into the cache); a message with no pack
    (a forward from landed staging) as its group starts, one with no unpack as its group landed.

    Inline (the default) each is digested there. With :attr:`DigestComm.overlap`, each is started there on the
    worker thread and joined at the last hook before anything may write it (``sends_kept``, ``recvs_kept``). It
    holds its communicator weakly: the replays are cached per communicator, which must be free to go."""

    observes = True
    by_message = True

    def __init__(self, comm: DigestComm, inner: PreparedGroups, groups: Sequence[Group]):
        super().__init__(inner)
        self._ref, self._groups = weakref.ref(comm), list(groups)
        self._buffers: Sequence[Any] = ()
        self._running: dict[int, list[concurrent.futures.Future]] = {}  # hook point -> digests to join there
        self._sends: dict[int, list[concurrent.futures.Future]] = {}  # group -> its send digests, until it starts
        self._recvs_kept: dict[int, int] = {}  # group -> the hook point through which its receives stay as landed
        self._point = -1  # the last hook point passed this step

    @property
    def _comm(self) -> DigestComm:
        comm = self._ref()
        assert comm is not None  # a replay runs only on a live communicator
        return comm

    def bind(self, addresses: np.ndarray, sizes: np.ndarray, buffers: Sequence[Any]) -> None:
        self._inner.bind(addresses, sizes, buffers)
        self._buffers = buffers
        self._point = -1

    def finish(self) -> None:
        self._inner.finish()
        self._buffers = ()
        running = [f for fs in (*self._running.values(), *self._sends.values()) for f in fs]
        self._running.clear()
        self._sends.clear()
        self._recvs_kept.clear()
        concurrent.futures.wait(running)  # a failed step's digests read its buffers no longer (their errors dropped)

    def packed(self, group: int, sends: Sequence[int]) -> None:
        super().packed(group, sends)
        fut = self._digest(group, 0, sends)
        if fut is not None:  # on the worker: joined where the group's start says its sends stay
            self._sends.setdefault(group, []).append(fut)

    def unpacked(self, group: int, recvs: Sequence[int]) -> None:
        super().unpacked(group, recvs)
        self._keep(self._digest(group, 1, recvs), self._recvs_kept.get(group, self._point))

    def _digest(self, group: int, side: int, which: Sequence[int]) -> concurrent.futures.Future | None:
        """Digest the messages ``which`` of group ``group`` (``side`` 0: its sends, 1: its receives) that cross to
        or from another process: now, or started on the worker (its future)."""
        comm = self._comm
        if comm.digests is None:
            return None
        rows = self._groups[group][side]
        other = 1 - side  # a send's peer is its destination, a receive's its source
        return comm._submit([o for o in _ops([rows[k] for k in which], self._buffers) if o[other] not in comm._mine])

    def starting(self, group: int, sends_kept: int) -> None:
        super().starting(group, sends_kept)
        self._passed(hook_point(group, STARTING))
        for fut in self._sends.pop(group, ()):
            self._keep(fut, sends_kept)

    def waiting(self, group: int) -> None:
        super().waiting(group)
        self._passed(hook_point(group, WAITING))

    def landed(self, group: int, recvs_kept: int) -> None:
        super().landed(group, recvs_kept)
        self._passed(hook_point(group, LANDED))
        self._recvs_kept[group] = recvs_kept

    def _passed(self, point: int) -> None:
        """Hook ``point`` is here: join what must end by it."""
        self._point = point
        for fut in self._running.pop(point, ()):
            self._comm._join(fut)

    def _keep(self, fut: concurrent.futures.Future | None, point: int) -> None:
        """Join ``fut`` (a worker's digest, or ``None``) at hook ``point``, or now where that has passed."""
        if fut is None:
            return
        if point <= self._point:
            self._comm._join(fut)
        else:
            self._running.setdefault(point, []).append(fut)
