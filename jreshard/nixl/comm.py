"""NixlComm: the engine's :class:`Communicator` over NIXL, one-sided WRITEs with a notification each.

One process drives its ``local_ranks`` through one :class:`~jreshard.nixl.agent.NixlAgent`; every
other rank is reached through the authenticated :class:`~jreshard.net.channel.Channel` of the process
that drives it, which carries only small control messages (agent metadata, receive descriptors,
failures). A group (:meth:`NixlComm.exchange`) runs as:

1. **Receivers post.** Each remote receive's buffer is located in registered memory (its root
   registered once, cached) and given a receive id; the descriptors ``(src, dst, tag, id, address,
   nbytes, memory type, device)`` go to the sending process in one ``nixl.post`` message per peer,
   with the partial metadata of registrations that peer has not seen.
2. **Senders WRITE.** A send is matched to the posted receives of its ``(src, dst, tag)`` in the
   order both sides listed them (the Communicator's matching rule; posts that arrive before the
   send's group are kept, as MPI keeps unexpected messages), sizes are checked, and one WRITE from
   the registered send buffer into the posted address is started, notifying ``jreshard:<id>``
   (a zero-byte message is a notification alone).
3. **Completion.** A send is done when NIXL reports its transfer ``DONE``; a receive when its
   notification arrives (NIXL delivers it after the written bytes) from the agent it was posted to
   (receive ids are random; :class:`~jreshard.nixl.agent.NixlAgent`) and, on a sealed connection,
   its bytes match the tag the sender sent (below). The group returns when all are.

**Sized messages** (:meth:`NixlComm.exchange_sized`: the delta rounds' encodings, whose sizes only their
senders know). A receive is posted with its buffer's size as the most its message may hold; the sender
refuses a message longer than that before it writes, WRITEs its bytes alone and names their count in the
notification (``jreshard:<id>/<bytes>``); the receiver checks the count against what it posted before it
reads a byte, and the receive is its buffer's first ``count`` bytes. One group, where sizes sent first
would take two.

**Integrity.** On a connection with a session (every one between programs), unless :attr:`NixlComm.tags`
is off, the sender of each message sends, inside the sealed channel (``nixl.mac``), a Poly1305 tag of the
bytes it writes, under a one-time key derived from the session and the receive's id, ranks and tag
(:meth:`jreshard.net.auth.Session.mac`); the receiver computes the tag of what landed and compares
before the group returns. A byte altered on the wire (UCX over TCP is plain text) is
:class:`PeerError` before anything is unpacked or published. Device (CuPy) buffers are not tagged:
a message from or into GPU memory is checked by nothing but the transport. ``RefitGroup`` and elastic refits
switch these tags off: they MAC every message of a refit themselves and compare whole streams before a
version is published (:mod:`jreshard.engine.digest`), which covers what the tags did.

**Encryption** (``encrypt=True``, the receiver's ``Options.encrypt``). The receiver posts, for each
receive, a fresh landing buffer ``16`` bytes longer (registered for this exchange, released with
it); the sender encrypts its bytes with AES-256-GCM under its direction's data key
(:meth:`jreshard.net.auth.Session.seal_into`, the message's label authenticated with them) into a buffer
of its own, WRITEs that, and sends the message's sequence number inside the sealed channel; the
receiver decrypts what landed into the receive buffer. Nothing of the weights crosses the wire in
the clear, and a byte altered fails the message's tag (:class:`PeerError`). A sender with
``encrypt=True`` refuses to write a receive posted in the clear. Host buffers only.

Failure. Every wait is bounded by ``timeout_s``: :class:`TransferTimeoutError` names the ranks that
did not post (receivers) or did not write (senders). A peer whose connection closes while it still
owes this process a post or a write is :class:`PeerError` within a second (a sender that finished
may close before its last notifications are delivered: they travel apart from the connection). A
transfer NIXL reports ``ERR``, a size disagreement (both sides are told) or a peer's ``nixl.fail``
is :class:`PeerError`, and so is any exception NIXL raises at any call (registering, posting, polling,
releasing, notifying, reading notifications, introducing the agents: e.g. ``nixlRemoteDisconnectError``
when a WRITE is polled after its peer died), naming the peer and the phase; every peer of a failed
exchange is told at once. Either way the communicator is *broken* (fail-stop, like NCCL): the receives
it gave up are abandoned (their buffers kept alive until a late WRITE's notification, so no write
lands in reused memory), the WRITEs it gave up are retired (:meth:`NixlAgent.retire`: UCX cannot cancel
them, so their send buffers and registrations are kept until NIXL is done with them) and other channels
are untouched. The caller drops the failed peer's
connection (descriptors it posted may still sit on it) and goes on with the others.

Messages between two local ranks are copies (``match_and_copy``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hmac
import os
import select
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jreshard.engine.comm import Communicator, Group, PreparedGroups, RecvOp, SendOp
from jreshard.engine.loopback import match_and_copy
from jreshard.errors import JReshardError, PeerError, TransferTimeoutError
from jreshard.net.auth import TAG_BYTES
from jreshard.net.channel import Channel
from jreshard.nixl.agent import NOTICE, NixlAgent, label
from jreshard.types import ByteBuffer

__all__ = ["NixlComm"]

# Waits poll (NIXL has no descriptor to block on here): after progress, polls follow at once, then
# sleeps double from 10 us up to this. A notification is seen ~0.3 ms after it lands (at 1 ms, ~1 ms
# per exchange group: 5% of a 64 MB refit on one host); a poll costs ~10 us, so a waiting process
# takes a few percent of a core. A post wakes the wait at once (the wait selects on the channels).
_MAX_SLEEP_S = 2.5e-4
_NOTICE_GRACE_S = 1.0  # after a peer's connection closes, how long its last notifications may still take

# A posted receive as the sender holds it: (id, address, nbytes, memory type, device, sealed, sized), where sized:
# nbytes is the most the message may hold, and the sender says in the notification how many it wrote.
_Posted = tuple[int, int, int, str, int, bool, bool]
# A WRITE in flight: (transfer handle, its send, the buffer it reads, that buffer's registration descriptors).
_Write = tuple[Any, SendOp, Any, Any]


def _host(buffer: ByteBuffer) -> bool:
    return not hasattr(buffer, "__cuda_array_interface__")


def _nixl(phase: str, peer: str, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, a call into NIXL; any exception it raises (NIXL has its own types, e.g. a remote
    disconnect while a WRITE is polled) becomes :class:`PeerError` naming the peer and the phase."""
    try:
        return call(*args)
    except JReshardError:
        raise
    except Exception as err:
        raise PeerError(
            f"NixlComm.exchange: NIXL failed during the {phase} ({peer}): {type(err).__name__}: {err}",
            destination_intact=True,
        ) from err


def _short(xs: Sequence[int]) -> str:
    xs = sorted(set(xs))
    return str(xs) if len(xs) <= 12 else f"{xs[:10]} ... ({len(xs)} in all)"


class NixlComm(Communicator):
    """Grouped point-to-point messages as NIXL WRITEs between processes (final).

    Args:
      agent: this process's agent (:meth:`NixlAgent.shared`).
      local: the ranks this process drives.
      remote: ``{rank: channel of the process that drives it}`` for every other rank; each
        channel's peer is authenticated.
      timeout_s: the deadline for introducing the agents on channels that are new to ``agent``.
      encrypt: receive every message encrypted, and send only encrypted (see the module docstring).

    Raises:
      ValueError: a rank is both local and remote; or ``encrypt`` over a connection without a session.
      PeerError, TransferTimeoutError: a peer did not introduce its agent.
    """

    def __init__(
        self,
        agent: NixlAgent,
        local: Sequence[int],
        remote: Mapping[int, Channel],
        *,
        timeout_s: float,
        encrypt: bool = False,
    ):
        self._local = tuple(sorted(int(r) for r in local))
        clash = sorted(set(self._local) & set(remote))
        if clash:
            raise ValueError(f"NixlComm: ranks {clash} are both local and remote")
        self._agent = agent
        self._remote = dict(remote)
        self.broken: str | None = None
        self._told: set[Channel] = set()  # peers sent this communicator's failure
        self._posted: dict[tuple[int, int, int], collections.deque[_Posted]] = {}  # posts not yet written to
        self._tags: dict[int, tuple[bytes | None, int | None]] = {}  # receive id -> its sender's tag, sequence
        self.verified = 0  # messages whose bytes were checked against their sender's tag (or opened)
        self.tags = True  # tag every message (off where the caller digests the whole refit: jreshard.engine.digest)
        self.encrypt = bool(encrypt)
        if self.encrypt and any(ch.session is None for ch in self._remote.values()):
            raise ValueError("NixlComm: encrypt=True needs authenticated connections (with a session) to every peer")
        self._landing: dict[int, np.ndarray] = {}  # receive id -> where its encrypted bytes land
        self._outbound: list[np.ndarray] = []  # encrypted copies being written
        channels = list(dict.fromkeys(self._remote.values()))
        who = ", ".join(ch.peer for ch in channels) or "no peer"
        _nixl("introduction of the agents", who, functools.partial(agent.introduce, channels, timeout_s=timeout_s))

    prepares: bool = os.environ.get("JRESHARD_NIXL_PREPARED", "1") != "0"
    """Whether :meth:`prepare` makes prepared groups (:mod:`jreshard.nixl.prepared`): on unless
    ``JRESHARD_NIXL_PREPARED=0`` (or set off on the class or a communicator); off, every group runs per operation.
    Both sides of a transfer must agree (a side that does not prepare refuses a peer's prepared descriptors)."""

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return self._local

    def prepare(self, groups: Sequence[Group]) -> PreparedGroups | None:
        """Prepared WRITE handles and receives for every group of a schedule (:mod:`jreshard.nixl.prepared`);
        ``None`` (per operation) with ``encrypt=True`` or :attr:`prepares` off."""
        if not self._prepares():
            return None
        from jreshard.nixl.prepared import NixlPrepared

        return NixlPrepared(self, groups)

    def _prepares(self) -> bool:
        """Whether :meth:`prepare` makes prepared groups (``encrypt=True`` runs per operation)."""
        return self.prepares and not self.encrypt

    def _check_open(self) -> None:
        if self.broken is not None:
            raise PeerError(f"NixlComm is broken since an earlier failure ({self.broken})", destination_intact=True)

    def close(self) -> None:
        """Release the prepared groups' handles and registrations."""
        from jreshard.engine import replay

        replay.release(self)

    def _channel(self, rank: int, what: str) -> Channel:
        try:
            return self._remote[rank]
        except KeyError:
            raise ValueError(f"NixlComm.exchange: {what} rank {rank} is neither local nor reachable") from None

    def exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> None:
        self._exchange(sends, recvs, timeout_s, sized=False)

    def exchange_sized(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], *, timeout_s: float) -> list[int]:
        """One group, as :meth:`exchange`, where each receive is posted with its buffer's size as the most its
        message may hold: a sender refuses to write more (before it writes anything), WRITEs its bytes alone
        and puts their count in the WRITE's notification, and the receiver checks that count against what it
        posted before it takes a byte of the message. Encrypted, the sealed bytes (``16`` more) land and are
        opened at that size."""
        return self._exchange(sends, recvs, timeout_s, sized=True)

    def _exchange(self, sends: Sequence[SendOp], recvs: Sequence[RecvOp], timeout_s: float, sized: bool) -> list[int]:
        """:meth:`exchange` (``sized``: :meth:`exchange_sized`, and the bytes that landed per receive, else ``[]``)."""
        if self.broken is not None:
            raise PeerError(f"NixlComm is broken since an earlier failure ({self.broken})", destination_intact=True)
        mine = set(self._local)
        for s in sends:
            if s.src not in mine:
                raise ValueError(f"NixlComm.exchange: send from rank {s.src}, which this process does not drive")
        for r in recvs:
            if r.dst not in mine:
                raise ValueError(f"NixlComm.exchange: receive at rank {r.dst}, which this process does not drive")
        pairs = match_and_copy([s for s in sends if s.dst in mine], [r for r in recvs if r.src in mine], bounded=sized)
        landed = {id(r): int(s.buffer.nbytes) for s, r in pairs}  # per receive (by identity): its bytes
        remote_sends = [s for s in sends if s.dst not in mine]
        remote_recvs = [r for r in recvs if r.src not in mine]
        waiting: dict[int, RecvOp] = {}
        got: dict[int, int] | None = {} if sized else None  # receive id -> the bytes its sender wrote
        try:
            if remote_sends or remote_recvs:
                self._post(remote_recvs, waiting, sized)
                which = {i: id(r) for i, r in waiting.items()}
                self._run(remote_sends, waiting, timeout_s, got)
                landed.update({which[i]: n for i, n in (got or {}).items()})
        except Exception as err:  # fail-stop on any failure; NIXL's own errors arrive here as PeerError
            self.broken = f"{type(err).__name__}: {err}"
            self._agent.abandon({i: self._landing.pop(i, r.buffer) for i, r in waiting.items()})
            involved = [self._remote[s.dst] for s in remote_sends] + [self._remote[r.src] for r in remote_recvs]
            for ch in dict.fromkeys(involved):  # a peer still waiting on this process hears of it at once
                if ch not in self._told and not ch.eof:
                    self._fail(ch, self.broken)
            raise
        return [landed[id(r)] for r in recvs] if sized else []

    def _post(self, recvs: Sequence[RecvOp], waiting: dict[int, RecvOp], sized: bool) -> None:
        """Send each peer the descriptors of the receives it writes into (``sized``: each buffer the most its
        message may hold)."""
        by: dict[Channel, list[list[Any]]] = {}
        keys: dict[Channel, set[tuple[str, int, int, int]]] = {}
        for r in recvs:
            ch = self._channel(r.src, "source")
            i = self._agent.new_id(self._agent.peer(ch))
            landing = r.buffer
            if self.encrypt:
                if not _host(r.buffer):
                    raise ValueError("NixlComm: encrypt=True covers host buffers only (a GPU receive buffer)")
                landing = self._landing[i] = np.empty(int(r.buffer.nbytes) + TAG_BYTES, np.uint8)
            what = f"registration of the receive {r.src}->{r.dst} tag {r.tag}"
            region = _nixl(what, ch.peer, self._agent.region, landing)
            waiting[i] = r
            by.setdefault(ch, []).append(
                [
                    *(r.src, r.dst, r.tag, i, region.address, region.nbytes, region.mem, region.device),
                    *(int(self.encrypt), int(sized)),
                ]
            )
            keys.setdefault(ch, set()).add(region.key)
        for ch, entries in by.items():
            md = self._agent.unannounced(ch, keys[ch])
            ch.queue_control({"op": "nixl.post", "md": md, "recvs": entries})
            ch.flush()

    def _collect(self, ch: Channel) -> None:
        """Read ``ch``: posted receives into the queues, a peer's failure raised (a closed connection
        is judged by the caller: a peer may close once it has written everything)."""
        ch.pump()
        # A peer's prepared descriptors (nixl.pdesc) are posted when its prepared schedule starts, which may be
        # while this side still runs the per-operation exchanges before its own prepared schedule (the scheduling
        # mail): where this side prepares too they are left for its schedule; where it never does, they are a
        # mismatch.
        ops = (
            {"nixl.post", "nixl.fail", "nixl.mac"}
            if self._prepares()
            else {"nixl.post", "nixl.fail", "nixl.mac", "nixl.pdesc"}
        )
        for msg in ch.take(ops):
            if msg["op"] == "nixl.pdesc":  # a receiver that prepared its groups (in the clear)
                raise self._fail(
                    ch,
                    f"{ch.peer} posted its receives in the clear, but this side has Options(encrypt=True): set "
                    "encrypt=True on both sides"
                    if self.encrypt
                    else f"{ch.peer} prepared its groups and this side did not (JRESHARD_NIXL_PREPARED=0 on this side "
                    "only): set it the same on both sides",
                )
            if msg["op"] == "nixl.fail":
                raise PeerError(f"NixlComm: {ch.peer} failed the exchange: {msg.get('error', '?')}")
            if msg["op"] == "nixl.mac":
                tags = msg.get("tags")
                try:
                    if not isinstance(tags, list):
                        raise TypeError("not a list")
                    for i, t, seq in tags:
                        tag = None if t is None else bytes.fromhex(t)
                        self._tags[int(i)] = (tag, None if seq is None else int(seq))
                except (TypeError, ValueError, OverflowError) as err:
                    raise PeerError(f"NixlComm: {ch.peer} sent malformed tags {tags!r:.200}") from err
                continue
            md, entries = msg.get("md", []), msg.get("recvs")
            if not isinstance(md, list) or not isinstance(entries, list):
                raise PeerError(f"NixlComm: {ch.peer} sent a malformed post")
            self._agent.load(ch, [str(m) for m in md])
            for e in entries:
                try:
                    src, dst, tag, i, addr, n, mem, dev, *flags = e
                    sealed, sized = (bool(flags[k]) if len(flags) > k else False for k in (0, 1))
                    post = (int(i), int(addr), int(n), str(mem), int(dev), sealed, sized)
                    key = (int(src), int(dst), int(tag))
                except (TypeError, ValueError, OverflowError) as err:
                    raise PeerError(f"NixlComm: {ch.peer} sent a malformed receive descriptor {e!r}") from err
                if post[3] not in ("DRAM", "VRAM") or post[2] < 0:
                    raise PeerError(f"NixlComm: {ch.peer} sent a receive descriptor {e!r} of no known memory")
                self._posted.setdefault(key, collections.deque()).append(post)

    def _fail(self, ch: Channel, error: str) -> PeerError:
        """Tell the peer on ``ch`` this exchange failed (best effort, bounded); the error to raise here."""
        self._told.add(ch)
        try:
            ch.send_control({"op": "nixl.fail", "error": error}, timeout_s=1.0)
        except (PeerError, TransferTimeoutError):
            pass
        return PeerError(f"NixlComm.exchange: {error}")

    def _start(self, s: SendOp, post: _Posted, ch: Channel, tags: dict[Channel, list[list[Any]]]) -> _Write | None:
        """Start the WRITE of ``s`` into ``post`` (its tag added to ``tags``); the WRITE in flight, or
        ``None`` when already done."""
        i, addr, n, mem, dev, sealed, sized = post
        if self.encrypt and not sealed:
            raise self._fail(
                ch,
                f"rank {s.dst} posted its receive from rank {s.src} (tag {s.tag}) in the clear, but this side has "
                "Options(encrypt=True): set encrypt=True on both sides",
            )
        buffer = s.buffer
        if sealed:
            if not _host(s.buffer) or ch.session is None:
                raise self._fail(ch, f"rank {s.src} cannot encrypt to rank {s.dst} (GPU memory, or no session)")
            buffer = np.empty(int(s.buffer.nbytes) + TAG_BYTES, np.uint8)
            seq = ch.session.seal_into(label(i, s.src, s.dst, s.tag), s.buffer, buffer)
            self._outbound.append(buffer)
            tags.setdefault(ch, []).append([i, None, seq])
        nbytes = int(buffer.nbytes)
        if n != nbytes and not (sized and nbytes < n):
            seal = TAG_BYTES if sealed else 0  # the message's sizes, not the sealed ones
            expects = f"holds at most {n - seal}" if sized else f"expects {n - seal}"
            raise self._fail(
                ch,
                f"rank {s.src} sends rank {s.dst} {nbytes - seal} bytes under tag {s.tag}, but the receive "
                f"{expects}: the two sides planned differently",
            )
        agent = self._agent.nixl
        peer = self._agent.peer(ch)
        notice = NOTICE + str(i).encode() + (b"/" + str(nbytes).encode() if sized else b"")
        what = f"WRITE {s.src}->{s.dst} tag {s.tag}"
        if nbytes == 0:
            if not sealed and self.tags:
                self._tag(s, i, ch, tags)
            _nixl(f"notification of the empty {what}", ch.peer, agent.send_notif, peer, notice)
            return None
        local = _nixl(f"registration of the {what}", ch.peer, self._agent.region, buffer)
        write = None
        try:
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs([(local.address, nbytes, local.device)], local.mem),
                agent.get_xfer_descs([(addr, nbytes, dev)], mem),
                peer,
                notice,
            )
            write = (handle, s, buffer, self._agent.descs_of(local.key))
            state = agent.transfer(handle)
        except Exception as err:  # nixl raises its own exception types
            if write is not None:
                self._retire(write)  # a part may have started: released when NIXL is done with it
            raise self._fail(
                ch, f"NIXL failed during the post of the {what} ({ch.peer}): {type(err).__name__}: {err}"
            ) from err
        if state == "ERR":
            self._retire(write)
            raise self._fail(ch, f"NIXL reported an error posting the {what} to {ch.peer}")
        if not sealed and self.tags:
            self._tag(s, i, ch, tags)  # while the WRITE flies (the send buffer does not change until it is done)
        return write

    @staticmethod
    def _tag(s: SendOp, i: int, ch: Channel, tags: dict[Channel, list[list[Any]]]) -> None:
        """Add the tag of ``s``'s bytes, for receive ``i``, to what goes to ``ch`` (sealed connections only)."""
        if ch.session is not None:
            tag = ch.session.mac(label(i, s.src, s.dst, s.tag), s.buffer) if _host(s.buffer) else None
            tags.setdefault(ch, []).append([i, None if tag is None else tag.hex(), None])

    def _run(
        self, sends: Sequence[SendOp], waiting: dict[int, RecvOp], timeout_s: float, got: dict[int, int] | None
    ) -> None:
        agent = self._agent.nixl
        unsent = collections.deque(sends)
        flying: list[_Write] = []
        channels = list(
            dict.fromkeys(
                [self._channel(s.dst, "destination") for s in sends] + [self._remote[r.src] for r in waiting.values()]
            )
        )
        deadline = time.monotonic() + timeout_s
        sleep = 0.0
        closed: dict[Channel, float] = {}  # when each closed connection was first seen with work left
        landed: dict[int, RecvOp] = {}  # receives notified whose sender's tag has not come yet
        try:
            while True:
                progress = False
                for ch in channels:
                    self._collect(ch)
                    ch.flush()
                blocked = []
                tags: dict[Channel, list[list[Any]]] = {}
                while unsent:  # start every send whose receive is posted, in listed order per key
                    s = unsent.popleft()
                    queue = self._posted.get((s.src, s.dst, s.tag))
                    if not queue:
                        blocked.append(s)
                        continue
                    write = self._start(s, queue.popleft(), self._remote[s.dst], tags)
                    if write is not None:
                        flying.append(write)
                    progress = True
                unsent.extend(blocked)
                for ch, entries in tags.items():  # sealed, beside the WRITEs: the receiver checks what landed
                    ch.queue_control({"op": "nixl.mac", "tags": entries})
                    ch.flush()
                still: list[_Write] = []
                for n, (handle, s, *_) in enumerate(flying):
                    ch = self._remote[s.dst]
                    what = f"WRITE {s.src}->{s.dst} tag {s.tag}"
                    try:
                        state = _nixl(f"poll of the {what}", ch.peer, agent.check_xfer_state, handle)
                    except PeerError as err:  # e.g. the peer died with the bytes in flight
                        flying = still + flying[n:]  # retired on the way out
                        self._fail(ch, str(err))
                        raise
                    if state == "PROC":
                        still.append(flying[n])
                        continue
                    _nixl(f"release of the {what}", ch.peer, handle.release)
                    progress = True
                    if state != "DONE":
                        flying = still + flying[n + 1 :]
                        raise self._fail(ch, f"NIXL reported the {what} to {ch.peer} failed (state {state!r})")
                flying = still
                if waiting:
                    ids = set(waiting)
                    peers = ", ".join(sorted({self._remote[r.src].peer for r in waiting.values()}))
                    told: dict[int, int] = {}  # the bytes a sized message's notification says were written
                    for i in _nixl("reading of notifications", peers, self._agent.arrived, ids, told):
                        landed[i] = self._landed(i, waiting.pop(i), told.get(i), got)
                        progress = True
                for i in [i for i in landed if self._tagged(i, landed[i])]:
                    self._check(i, landed.pop(i))
                if not unsent and not flying and not waiting and not landed and not any(ch.sending for ch in channels):
                    self._outbound.clear()  # every encrypted copy was written
                    return
                now = time.monotonic()
                for ch in channels:  # a peer that closed with messages outstanding is gone
                    if ch.eof and self._outstanding(ch, unsent, {**waiting, **landed}):
                        # its last notifications may still be on their way (they travel apart from the
                        # connection): give them _NOTICE_GRACE_S, then it is gone
                        closed.setdefault(ch, now)
                        if now - closed[ch] > min(_NOTICE_GRACE_S, timeout_s):
                            raise ch.closed_error()
                if progress:
                    sleep = 0.0
                    continue
                if time.monotonic() > deadline:
                    raise self._timeout(list(unsent), flying, {**waiting, **landed}, timeout_s)
                if sleep:
                    live = [ch for ch in channels if not ch.eof]
                    if live:
                        select.select(live, [], [], sleep)
                    else:
                        time.sleep(sleep)
                sleep = min(2 * sleep + 1e-5, _MAX_SLEEP_S)
        finally:
            for write in flying:  # a failed group: each WRITE still running is retired, not released under UCX
                self._retire(write)

    def _landed(self, i: int, r: RecvOp, written: int | None, got: dict[int, int] | None) -> RecvOp:
        """Receive ``i`` as it landed. In a sized exchange (``got``) its sender's notification said how many bytes
        it wrote: that count is checked against what was posted before a byte is read, the receive is cut to
        the message and ``got[i]`` set. Elsewhere a count is refused (the receive was posted at its size)."""
        ch = self._remote[r.src]
        what = f"rank {r.src}'s message to rank {r.dst} under tag {r.tag}"
        landing = self._landing.get(i)
        posted = int((r.buffer if landing is None else landing).nbytes)
        if got is None:
            if written is None:
                return r
            raise self._fail(ch, f"{what} gives its size ({written} bytes), but it was posted at exactly {posted}")
        seal = 0 if landing is None else TAG_BYTES
        if written is None:
            raise self._fail(ch, f"{what} came without its size; its receive was posted to take up to {posted} bytes")
        if not seal <= written <= posted:
            raise self._fail(
                ch, f"{what} says {written} bytes were written; its receive takes {seal} to {posted}: refused unread"
            )
        if landing is not None:
            self._landing[i] = landing[:written]
        got[i] = written - seal
        return dataclasses.replace(r, buffer=r.buffer[: written - seal])

    def _retire(self, write: _Write) -> None:
        """Hand a WRITE given up to the agent, with the buffer it reads (:meth:`NixlAgent.retire`)."""
        handle, _, buffer, descs = write
        self._agent.retire(handle, keep=(buffer,), descs=(descs,))

    def _tagged(self, i: int, r: RecvOp) -> bool:
        """Whether receive ``i`` can be checked now: its sender's tag (or sequence) came, or none will."""
        return i in self._tags or self._remote[r.src].session is None or (not self.tags and i not in self._landing)

    def _check(self, i: int, r: RecvOp) -> None:
        """Compare the bytes that landed for receive ``i`` with the tag its sender sent."""
        ch = self._remote[r.src]
        want, seq = self._tags.pop(i, (None, None))
        landing = self._landing.pop(i, None)
        if landing is not None:
            assert ch.session is not None  # encrypt needs sessions (checked when made)
            if seq is None or not ch.session.open_into(seq, label(i, r.src, r.dst, r.tag), landing, r.buffer):
                raise self._fail(
                    ch,
                    f"the encrypted message rank {r.dst} received from rank {r.src} under tag {r.tag} does not open "
                    "(altered on the way, or not sealed by the sender); nothing is published",
                )
            self.verified += 1
            return
        if ch.session is None or want is None or not _host(r.buffer):
            return
        if not hmac.compare_digest(ch.session.mac(label(i, r.src, r.dst, r.tag), r.buffer), want):
            raise self._fail(
                ch,
                f"the {int(r.buffer.nbytes)} bytes rank {r.dst} received from rank {r.src} under tag {r.tag} are not "
                "the bytes the sender wrote (its tag does not match): altered on the way; nothing is published",
            )
        self.verified += 1

    def _outstanding(self, ch: Channel, unsent: Sequence[SendOp], waiting: dict[int, RecvOp]) -> bool:
        """Whether ``ch``'s peer still has to post or to write (a WRITE in flight reports its own end)."""
        return any(self._remote[s.dst] is ch for s in unsent) or any(
            self._remote[r.src] is ch for r in waiting.values()
        )

    def _timeout(
        self, unsent: list[SendOp], flying: list[_Write], waiting: dict[int, RecvOp], timeout_s: float
    ) -> TransferTimeoutError:
        parts = []
        if waiting:
            silent = sorted({r.src for r in waiting.values()})
            peers = sorted({self._remote[r.src].peer for r in waiting.values()})
            parts.append(f"ranks {_short(silent)} did not send ({', '.join(peers)})")
        if unsent:
            silent = sorted({s.dst for s in unsent})
            peers = sorted({self._remote[s.dst].peer for s in unsent})
            parts.append(f"ranks {_short(silent)} did not post their receives ({', '.join(peers)})")
        if flying:
            parts.append(f"{len(flying)} WRITEs to ranks {_short([w[1].dst for w in flying])} did not complete")
        return TransferTimeoutError(
            f"NixlComm.exchange: no answer within timeout_s={timeout_s}: {'; '.join(parts)}. A peer died or "
            "stopped answering; this communicator is now broken"
        )
