"""Prepared groups over NIXL: every exchange group of a schedule made once, started every step.

:meth:`NixlComm.prepare <jreshard.nixl.comm.NixlComm.prepare>` returns a :class:`NixlPrepared` for the engine's
replay (:mod:`jreshard.engine.replay`), which binds it to each step's buffers and starts and waits its groups.
What is made once, and what a step costs:

- **Batches.** A group's messages between this process and one peer process are one *batch* (a message lies in
  the same group at both ends: :mod:`jreshard.schedule.groups`). A sender WRITEs a batch as one NIXL transfer
  with one notification: a prepared local descriptor list and a prepared remote one
  (``prep_xfer_dlist``), and one WRITE handle over them (``make_prepped_xfer``), made at the first step and
  re-posted every step (``transfer(handle, notif_msg=...)``); made again only when a buffer of the batch moved or
  a registration under one, on either side, was made again (a handle holds the registrations it was made over).
- **Descriptors, once per binding.** At :meth:`~NixlPrepared.bind`, both sides find the agent's registration of
  every buffer the messages use (:meth:`NixlAgent.region <jreshard.nixl.agent.NixlAgent.region>`, the one the
  per-operation path uses: registrations never nest), again only when a buffer moved or the agent released a
  registration or saw a root collected since (its ``epoch``). A receiver sends each sender, sealed, its receives'
  descriptors for the whole schedule (``nixl.pdesc``: keys, group, address, size, the serial of the registration
  under each, with the partial metadata of registrations the sender has not seen), again only when a receive
  buffer moved or a registration under one was made again. The sender matches them to its sends by
  ``(src, dst, tag)`` in listed order, as the per-operation path does, and checks sizes and groups.
- **Every step, per batch.** The receiver starts a group by sending each of its senders a fresh receive id
  (63 random bits, bound to that sender's agent: :meth:`NixlAgent.new_id`) inside the sealed channel
  (``nixl.go``): the sender writes nothing into a buffer before the receiver's group started (its staging
  arena may still hold the round before). The sender re-posts the batch's handle notifying ``jreshard:<id>``
  and sends, sealed, the Poly1305 tag of every message of the batch (``nixl.pmac``, under a one-time key for
  ``id``, the message's index in the batch, its ranks and tag); the receiver compares each tag with the bytes
  that landed before the group returns, as the per-operation path does.

Failure is as :class:`~jreshard.nixl.comm.NixlComm`'s: every wait bounded by ``timeout_s`` from its group's start
(:class:`TransferTimeoutError` naming the ranks and peers that did not post or write), a peer whose connection
closes with work outstanding is :class:`PeerError` within a second, a ``nixl.fail``, a transfer NIXL reports
``ERR`` or descriptors that do not match are :class:`PeerError`; the communicator is then broken. A batch's
WRITE that may still run is retired (:meth:`NixlAgent.retire <jreshard.nixl.agent.NixlAgent.retire>`), with the
step's buffers and the schedule's registrations kept until NIXL is done with it.

Not covered here, so :meth:`NixlComm.prepare` returns ``None`` and the step runs per operation:
``encrypt=True`` (each message sealed under its own sequence number into a fresh landing buffer). A peer
that posts per operation while this side prepared its sends (it has ``encrypt=True``, this side not) is
:class:`TransferTimeoutError` saying so, asking for ``encrypt`` on both sides (the other way round,
:class:`PeerError` at once). Host memory (``DRAM``) only: the replay binds host arrays (their addresses
read in one call), and the descriptors made from them are ``DRAM``.
"""

from __future__ import annotations

import collections
import ctypes
import os
import secrets
import select
import time
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from jreshard.engine.comm import REGIONS, Group, PreparedGroups, ops_of_rows
from jreshard.engine.loopback import match
from jreshard.errors import PeerError, TransferError, TransferTimeoutError
from jreshard.net.channel import Channel
from jreshard.nixl.agent import NOTICE, NixlAgent, label
from jreshard.types import NixlHandle

NixlComm = Any
"""The communicator that makes these, :class:`jreshard.nixl.comm.NixlComm` (which imports this module when it
prepares, so it is not imported back here)."""

__all__ = ["NixlPrepared"]

_MAX_SLEEP_S = 2.5e-4  # as NixlComm's waits
_YIELD_S = 2e-4  # a wait first polls yielding the core this long (as MpiComm's prepared groups)
_NOTICE_GRACE_S = 1.0
_OPS = {"nixl.pdesc", "nixl.go", "nixl.pmac", "nixl.fail"}
# columns of a schedule's rows: its group, then the Communicator's row
_G, _SRC, _DST, _TAG, _BUF, _OFF, _N = range(7)


def mac_id(i: int, k: int) -> int:
    """The id message ``k`` of the batch notified as receive ``i`` has in its MAC's label (``NixlComm``'s): one per
    message, never a receive id of the per-operation path (those are below ``2**63``)."""
    return (1 << 100) | (i << 32) | k


def _memory(address: int, nbytes: int) -> Any:
    """``nbytes`` of host memory at ``address``, readable as a buffer (for a MAC)."""
    if not nbytes:
        return b""
    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), np.uint8)  # type: ignore[call-overload]


class _Hub:
    """The prepared protocol's messages on one NixlComm's channels, kept until the prepared groups they name
    take them (a communicator may hold several prepared schedules)."""

    def __init__(self, comm: NixlComm):
        self.comm = weakref.proxy(comm)  # the communicator holds the hub
        # (ch, token) -> (version, entries): per receive its keys, group, address, size, device, then the serial of
        # the receiver's registration it lies in (one registered again at the same place has a new one)
        self.descs: dict[tuple[Channel, int], tuple[int, np.ndarray]] = {}
        self.gos: dict[tuple[Channel, int], collections.deque[tuple[int, int]]] = {}  # (ch, token) -> (group, id)
        self.tags: dict[int, list[bytes | None]] = {}  # receive id -> its batch's tags
        self.claimed: dict[tuple[Channel, int], Any] = {}  # (ch, token) -> the NixlPrepared that sends to it

    def pump(self, channels: Sequence[Channel]) -> None:
        for ch in channels:
            ch.pump()
            for msg in ch.take(_OPS):
                op = msg["op"]
                if op == "nixl.fail":
                    raise PeerError(f"NixlComm: {ch.peer} failed the exchange: {msg.get('error', '?')}")
                try:
                    if op == "nixl.go":
                        self.gos.setdefault((ch, int(msg["p"])), collections.deque()).append(
                            (int(msg["g"]), int(msg["id"]))
                        )
                    elif op == "nixl.pmac":
                        tags = msg["tags"]
                        if not isinstance(tags, list):
                            raise TypeError("not a list")
                        self.tags[int(msg["id"])] = [None if t is None else bytes.fromhex(t) for t in tags]
                    else:
                        md = msg["md"]
                        if not isinstance(md, list):
                            raise TypeError("not a list")
                        entries = np.asarray(msg["recvs"], np.int64).reshape(-1, 7)
                        serials = np.asarray(msg["s"], np.int64).reshape(-1, 1)
                        if len(serials) != len(entries):
                            raise ValueError("a serial per receive")
                        self.comm._agent.load(ch, [str(m) for m in md])
                        self.descs[(ch, int(msg["p"]))] = (int(msg["v"]), np.concatenate([entries, serials], 1))
                except (KeyError, TypeError, ValueError, OverflowError) as err:  # an int past int64: OverflowError
                    raise PeerError(f"NixlComm: {ch.peer} sent a malformed {op} message") from err


def hub_of(comm: NixlComm) -> _Hub:
    """The prepared protocol's messages of ``comm`` (made at its first prepare)."""
    hub = getattr(comm, "_prepared_hub", None)
    if hub is None:
        hub = _Hub(comm)
        setattr(comm, "_prepared_hub", hub)  # noqa: B010 - a communicator without prepared groups has none
    return hub


class _Batch:
    """A group's sends to one peer process: one WRITE handle, re-posted every step."""

    __slots__ = ("flying", "group", "handle", "made", "posted", "rows")

    def __init__(self, group: int, rows: np.ndarray):
        self.group, self.rows = group, rows  # rows: indices into the channel's send rows, in the receiver's order
        self.handle: NixlHandle = None  # the handle posted last
        # the handles made, by (local addresses, remote addresses, registrations): the last two (a loop whose
        # buffers alternate between two sets, as pools that keep the last version alive do, makes none after)
        self.made: collections.OrderedDict[tuple, tuple[Any, ...]] = collections.OrderedDict()
        self.posted = -1  # the step it was last posted in
        self.flying = False

    def drop(self, keep: int = 0) -> None:
        """Release the handles made, but the last ``keep``."""
        while len(self.made) > keep:
            _, hs = self.made.popitem(last=False)
            for h in hs:
                try:
                    h.release()
                except Exception:  # nixl raises its own types; a transfer that cannot be cancelled stays queued
                    pass
        if not self.made:
            self.handle, self.flying = None, False

    def retire(self, agent: NixlAgent, keep: tuple[Any, ...], descs: tuple[Any, ...]) -> None:
        """Hand the WRITE posted last, which may still run, to ``agent`` with the memory it reads
        (:meth:`NixlAgent.retire`: UCX cannot cancel it), then release the other handles."""
        for key, made in list(self.made.items()):
            if made[0] is self.handle:
                del self.made[key]
                agent.retire(made[0], keep=keep, dlists=made[1:], descs=descs)
        self.drop()


class _Out:
    """This schedule's sends to one peer process."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows  # (k, 7): group and row, in schedule order
        self.token: int | None = None  # the receiving schedule's token it was matched to
        self.version = -1
        self.remote: np.ndarray | None = None  # per row, the matched receive's address
        self.pair: np.ndarray | None = None  # per row, the matched receive's index in the receiver's descriptors
        self.serial: np.ndarray | None = None  # per row, the serial of the receiver's registration under it
        self.shape: np.ndarray | None = None  # the receiver's descriptors but their addresses, when matched
        self.by_group: dict[int, _Batch] = {}  # the receiver's group -> batch
        self.mine: dict[int, list[_Batch]] = {}  # this schedule's group -> batches


class NixlPrepared(PreparedGroups):
    """The prepared WRITEs and receives of every group of one schedule on a :class:`NixlComm` (final)."""

    def __init__(self, comm: NixlComm, groups: Sequence[Group]):
        # not the communicator itself: the engine's replays are cached per communicator (weakly) and hold this
        self._comm: NixlComm = weakref.proxy(comm)  # type: ignore[assignment]
        self._agent, self._hub = comm._agent, hub_of(comm)
        self._token = secrets.randbits(63) | 1  # names this schedule's receives to their senders
        mine = set(comm.local_ranks)
        recv: dict[Channel, list[tuple[int, ...]]] = {}
        send: dict[Channel, list[tuple[int, ...]]] = {}
        self._rgroups: list[dict[Channel, np.ndarray]] = []  # per group: channel -> indices of its receives
        self._sgroups: list[list[Channel]] = []  # per group: the channels it sends to
        self._copies: list[list[tuple[int, int, int, int, int]]] = []  # per group: in-process messages
        for g, (sends, recvs) in enumerate(groups):
            for r in recvs:
                if r[1] not in mine:
                    raise ValueError(f"NixlComm.prepare: receive at rank {r[1]}, which this process does not drive")
            for s in sends:
                if s[0] not in mine:
                    raise ValueError(f"NixlComm.prepare: send from rank {s[0]}, which this process does not drive")
            rg: dict[Channel, list[int]] = {}
            for r in recvs:
                if r[0] in mine:
                    continue
                ch = comm._channel(r[0], "source")
                rg.setdefault(ch, []).append(len(recv.setdefault(ch, [])))
                recv[ch].append((g, *r))
            self._rgroups.append({ch: np.array(ix, np.int64) for ch, ix in rg.items()})
            sg: dict[Channel, None] = {}
            for s in sends:
                if s[1] in mine:
                    continue
                ch = comm._channel(s[1], "destination")
                sg[ch] = None
                send.setdefault(ch, []).append((g, *s))
            self._sgroups.append(list(sg))
            local = ops_of_rows([s for s in sends if s[1] in mine], [r for r in recvs if r[0] in mine], REGIONS)
            pairs = match(*local, size=lambda b: b[2])
            self._copies.append([(s.buffer[0], s.buffer[1], r.buffer[0], r.buffer[1], s.buffer[2]) for s, r in pairs])
        self._recv = {ch: np.array(rows, np.int64).reshape(-1, 7) for ch, rows in recv.items()}
        self._out = {ch: _Out(np.array(rows, np.int64).reshape(-1, 7)) for ch, rows in send.items()}
        # the receive addresses (and the registrations under them) each sender has
        self._posted: dict[Channel, tuple[np.ndarray, np.ndarray]] = {}
        self._version = 0
        # per buffer: the agent's registration it lies in (its key and serial; the serial 0 for none), from the last
        # bind, and the agent's epoch then (a registration released or a root collected since: bound again)
        self._keys: list[Any] = []
        self._serial = np.zeros(0, np.int64)
        self._epoch = -1
        used = [r[:, _BUF] for r in (*self._recv.values(), *(o.rows for o in self._out.values()))]
        self._used = np.unique(np.concatenate(used)) if used else np.zeros(0, np.int64)
        self._addr: np.ndarray | None = None
        self._last: tuple[np.ndarray, np.ndarray] | None = None
        self._step = 0
        self._deadline = [0.0] * len(groups)
        self._timeout = [0.0] * len(groups)
        self._waiting: dict[int, tuple[Channel, np.ndarray]] = {}  # receive id -> its channel and receives
        self._landed: dict[int, tuple[Channel, np.ndarray]] = {}  # notified, tags not yet come
        self._rids: list[list[int]] = [[] for _ in groups]  # per group: its receive ids this step
        self._started = np.full(len(groups), -1, np.int64)  # the step each group was last started in
        self._buffers: Sequence[Any] | None = None  # the step's buffers, while it runs
        self.posts = self.prepped = 0  # descriptor lists posted to senders; WRITE handles made

    # ---- binding --------------------------------------------------------------------------------
    def bind(self, addresses: np.ndarray, sizes: np.ndarray, buffers: Sequence[Any]) -> None:
        self._comm._check_open()
        self._buffers = buffers  # receives given up keep their buffers until their late WRITEs are told (_break)
        self._step += 1
        last = self._last
        if (
            last is not None
            and self._epoch == self._agent.epoch
            and np.array_equal(addresses, last[0])
            and np.array_equal(sizes, last[1])
        ):
            return  # the buffers of the last step, their registrations untouched: every descriptor still holds
        self._last = None
        for rows in (*self._recv.values(), *(o.rows for o in self._out.values())):
            buf, off, n = rows[:, _BUF], rows[:, _OFF], rows[:, _N]
            bad = np.nonzero((off < 0) | (n < 0) | (off + n > sizes[buf]) | ((n > 0) & (addresses[buf] == 0)))[0]
            if len(bad):
                i = int(bad[0])
                raise TransferError(
                    f"NixlComm: a message of {int(n[i])} bytes at offset {int(off[i])} would leave buffer "
                    f"{int(buf[i])} of {int(sizes[buf[i]])} bytes (-1: none given); nothing was posted",
                    destination_intact=True,
                )
        for copies in self._copies:
            for sb, so, db, do, nb in copies:
                if so + nb > sizes[sb] or do + nb > sizes[db] or min(so, do) < 0:
                    raise TransferError(
                        f"NixlComm: an in-process message of {nb} bytes would leave buffer {sb} or {db}; "
                        "nothing was posted",
                        destination_intact=True,
                    )
        self._addr = addresses.copy()
        self._register(buffers, sizes)
        self._version += 1
        for ch, rows in self._recv.items():  # descriptors to each sender, where one moved
            where = addresses[rows[:, _BUF]] + rows[:, _OFF]
            used = np.unique(rows[:, _BUF])
            serials = self._serial[used]
            before = self._posted.get(ch)
            if before is not None and np.array_equal(where, before[0]) and np.array_equal(serials, before[1]):
                continue
            md = self._agent.unannounced(ch, {self._keys[b] for b in used.tolist() if self._keys[b] is not None})
            entries = np.stack([rows[:, _SRC], rows[:, _DST], rows[:, _TAG], rows[:, _G], where, rows[:, _N]], 1)
            entries = np.concatenate([entries, np.zeros((len(rows), 1), np.int64)], 1)  # device
            try:
                ch.queue_control(
                    {
                        **{"op": "nixl.pdesc", "p": self._token, "v": self._version, "md": md},
                        **{"recvs": entries.tolist(), "s": self._serial[rows[:, _BUF]].tolist()},
                    }
                )
                ch.flush()
            except PeerError as err:
                self._break(err)
                raise
            self._posted[ch] = (where, serials)
            self.posts += 1
        self._last = (addresses.copy(), sizes.copy())

    def _register(self, buffers: Sequence[Any], sizes: np.ndarray) -> None:
        """The agent's registration of every buffer the messages use (:meth:`NixlAgent.region`: its root's, the
        one the per-operation path uses too, so no registration nests in another)."""
        agent = self._agent
        epoch = agent.epoch  # read first: whatever goes while these are made is seen at the next bind
        n = len(buffers)
        keys: list[Any] = [None] * n
        serial = np.zeros(n, np.int64)
        for b in self._used.tolist():
            if b < n and sizes[b] > 0:
                region = agent.region(_bytes_of(buffers[b]))
                keys[b], serial[b] = region.key, region.serial
        self._keys, self._serial, self._epoch = keys, serial, epoch

    # ---- the sending side -------------------------------------------------------------------------
    def _claim(self, ch: Channel, out: _Out) -> None:
        """Match ``out``'s sends to a receiving schedule's descriptors (the latest ``ch`` posted for it).

        The receiving schedule is the one ``ch``'s peer prepared for these messages; where it prepared another
        since (a new schedule on its side only) and started groups under it, ``out`` follows it.
        """
        hub = self._hub
        if out.token is None or not hub.gos.get((ch, out.token)):
            for (c, token), (_, entries) in list(hub.descs.items()):
                if c is not ch or token == out.token or hub.claimed.get((c, token), self) is not self:
                    continue
                if out.token is not None and not hub.gos.get((c, token)):
                    continue  # another schedule of the peer's, not running now
                if self._match_batches(ch, out, entries, check=False):
                    if out.token is not None:
                        hub.claimed.pop((ch, out.token), None)
                    out.token, out.version, out.shape = token, -1, None
                    hub.claimed[(ch, token)] = self
                    break
            if out.token is None:
                return
        version, entries = hub.descs[(ch, out.token)]
        if version != out.version:
            shape = np.delete(entries, [4, 7], axis=1)
            if out.pair is not None and out.shape is not None and np.array_equal(shape, out.shape):
                out.remote = entries[out.pair, 4].copy()  # the same receives, moved
                out.serial = entries[out.pair, 7].copy()
            else:
                self._match_batches(ch, out, entries, check=True)
                out.shape = shape
            out.version = version

    def _match_batches(self, ch: Channel, out: _Out, entries: np.ndarray, *, check: bool) -> bool:
        """Whether ``entries`` (a receiving schedule's descriptors) match ``out``'s sends; with ``check``, they
        must (else :class:`PeerError`), and ``out`` takes their addresses and batches."""
        rows = out.rows
        queues: dict[tuple[int, int, int], collections.deque[int]] = {}
        for j, key in enumerate(map(tuple, entries[:, :3].tolist())):
            queues.setdefault(key, collections.deque()).append(j)  # type: ignore[arg-type]
        pair = np.zeros(len(rows), np.int64)
        why = None
        for i, key in enumerate(map(tuple, rows[:, _SRC : _TAG + 1].tolist())):
            q = queues.get(key)  # type: ignore[call-overload]
            if not q:
                why = f"send {key[0]}->{key[1]} tag {key[2]} has no receive posted for it"
                break
            pair[i] = q.popleft()
        if why is None and any(queues.values()):
            why = "receives were posted that no send of this schedule matches"
        if why is None:
            bad = np.nonzero(entries[pair, 5] != rows[:, _N])[0]
            if len(bad):
                i = int(bad[0])
                why = (
                    f"rank {int(rows[i, _SRC])} sends rank {int(rows[i, _DST])} {int(rows[i, _N])} bytes under tag "
                    f"{int(rows[i, _TAG])}, but the receive expects {int(entries[pair[i], 5])}"
                )
        by: dict[int, list[int]] = {}
        if why is None:
            for i, rg in enumerate(entries[pair, 3].tolist()):
                by.setdefault(rg, []).append(i)
            for rg, ix in by.items():
                if len(set(rows[ix, _G].tolist())) != 1:
                    why = f"the receiver's group {rg} spans several of this side's groups"
                    break
        if why is not None:
            if check:
                raise self._comm._fail(ch, f"the two sides planned differently: {why}")
            return False
        if not check:
            return True
        for batch in out.by_group.values():
            batch.drop()
        out.remote, out.serial, out.pair = entries[pair, 4].copy(), entries[pair, 7].copy(), pair
        out.by_group, out.mine = {}, {}
        for rg, ix in by.items():
            ix.sort(key=lambda i: pair[i])  # in the receiver's order: a tag's index is the receive's in its group
            batch = out.by_group[rg] = _Batch(int(rows[ix[0], _G]), np.array(ix, np.int64))
            out.mine.setdefault(batch.group, []).append(batch)
        return True

    def _post(self, ch: Channel, out: _Out, batch: _Batch, i: int) -> None:
        """WRITE ``batch`` notifying receive ``i``, then send its tags."""
        agent = self._agent.nixl
        addr = self._addr
        assert addr is not None and out.remote is not None and out.serial is not None
        rows = out.rows[batch.rows]
        local = addr[rows[:, _BUF]] + rows[:, _OFF]
        sizes = rows[:, _N]
        peer = self._agent.peer(ch)
        remote = out.remote[batch.rows]
        # the handles hold the registrations they were made over: one made again, at the same place or not, is new
        key = (
            local.tobytes(),
            remote.tobytes(),
            self._serial[rows[:, _BUF]].tobytes(),
            out.serial[batch.rows].tobytes(),
        )
        notice = NOTICE + str(i).encode()
        try:
            if sizes.any():
                made = batch.made.get(key)
                if made is None:
                    some = np.nonzero(sizes)[0]
                    zeros = np.zeros(len(some), np.int64)
                    ld = agent.prep_xfer_dlist(
                        "NIXL_INIT_AGENT", np.stack([local[some], sizes[some], zeros], 1), "DRAM"
                    )
                    rd = agent.prep_xfer_dlist(peer, np.stack([remote[some], sizes[some], zeros], 1), "DRAM")
                    ix = np.arange(len(some), dtype=np.int32)
                    made = batch.made[key] = (agent.make_prepped_xfer("WRITE", ld, ix, rd, ix, notice), ld, rd)
                    self.prepped += 1
                    batch.drop(keep=2)
                else:
                    batch.made.move_to_end(key)
                batch.handle = made[0]
                state = agent.transfer(batch.handle, notice)
                if state == "ERR":
                    raise self._comm._fail(ch, f"NIXL reported an error posting the WRITEs of a group to {ch.peer}")
                batch.flying = state == "PROC"
            else:
                agent.send_notif(peer, notice)
        except (PeerError, TransferTimeoutError):
            raise
        except Exception as err:  # nixl raises its own exception types
            self._retire(batch)  # a part may have started
            raise self._comm._fail(ch, f"NIXL refused the WRITEs of a group to {ch.peer}: {err}") from err
        batch.posted = self._step
        session = ch.session
        if session is not None and self._comm.tags:  # while the WRITE flies (its send buffers do not change)
            tags = [
                session.mac(label(mac_id(i, k), r[_SRC], r[_DST], r[_TAG]), _memory(a, r[_N])).hex()
                for k, (r, a) in enumerate(zip(rows.tolist(), local.tolist(), strict=True))
            ]
            ch.queue_control({"op": "nixl.pmac", "id": i, "tags": tags})
            ch.flush()

    def _send_ready(self, g: int) -> None:
        """Post every batch of group ``g`` whose receiver started its group this step."""
        for ch in self._sgroups[g]:
            out = self._out[ch]
            self._claim(ch, out)
            if out.token is None:
                continue
            gos = self._hub.gos.get((ch, out.token))
            if not gos:
                continue
            keep: collections.deque[tuple[int, int]] = collections.deque()
            while gos:
                rg, i = gos.popleft()
                batch = out.by_group.get(rg)
                if batch is None:
                    raise self._comm._fail(ch, f"{ch.peer} started group {rg}, which holds no message of this side")
                if self._started[batch.group] == self._step and batch.posted < self._step:
                    self._post(ch, out, batch, i)
                else:
                    keep.append((rg, i))
            gos.extend(keep)

    # ---- groups ---------------------------------------------------------------------------------
    def start(self, group: int, timeout_s: float) -> None:
        self._comm._check_open()
        self._deadline[group], self._timeout[group] = time.monotonic() + timeout_s, timeout_s
        self._started[group] = self._step
        addr = self._addr
        assert addr is not None, "NixlPrepared.start before bind"
        for sb, so, db, do, n in self._copies[group]:  # messages between ranks of this process
            ctypes.memmove(int(addr[db]) + do, int(addr[sb]) + so, n)
        ids = self._rids[group]
        ids.clear()
        try:
            for ch, ix in self._rgroups[group].items():
                i = self._agent.new_id(self._agent.peer(ch))
                self._waiting[i] = (ch, ix)
                ids.append(i)
                ch.queue_control({"op": "nixl.go", "p": self._token, "g": group, "id": i})
                ch.flush()
            if self._sgroups[group]:
                self._hub.pump(self._sgroups[group])
                self._send_ready(group)
        except (PeerError, TransferTimeoutError) as err:
            self._break(err)
            raise

    def wait(self, group: int) -> None:
        try:
            self._wait(group)
        except (PeerError, TransferTimeoutError) as err:
            self._break(err)
            raise

    def _wait(self, g: int) -> None:
        agent = self._agent.nixl
        ids = self._rids[g]
        senders = self._sgroups[g]
        channels = list(dict.fromkeys([*senders, *self._rgroups[g]]))
        closed: dict[Channel, float] = {}
        sleep, idle_from = 0.0, 0.0
        while True:
            progress = False
            self._hub.pump(channels)
            if senders:
                self._send_ready(g)
            unsent, flying = [], []
            for ch in senders:
                out = self._out[ch]
                batches = out.mine.get(g, []) if out.token is not None else []
                if out.token is None:
                    unsent.append(ch)
                for batch in batches:
                    if batch.posted < self._step:
                        unsent.append(ch)
                    elif batch.flying:
                        try:
                            state = agent.check_xfer_state(batch.handle)
                        except Exception as err:  # nixl raises its own types (a peer that disconnected)
                            raise PeerError(f"NixlComm: the WRITEs of a group to {ch.peer} failed: {err!r}") from err
                        if state == "PROC":
                            flying.append(ch)
                            continue
                        batch.flying = False
                        progress = True
                        if state != "DONE":
                            raise self._comm._fail(ch, f"NIXL reported the WRITEs of a group to {ch.peer} failed")
            waiting = [i for i in ids if i in self._waiting]
            if waiting:
                for i in self._agent.arrived(set(waiting)):
                    self._landed[i] = self._waiting.pop(i)
                    progress = True
            landed = [i for i in ids if i in self._landed]
            for i in landed:
                ch, _ = self._landed[i]
                if ch.session is None or not self._comm.tags or i in self._hub.tags:
                    self._check(i, *self._landed.pop(i))
            left = [i for i in ids if i in self._waiting or i in self._landed]
            if not unsent and not flying and not left and not any(ch.sending for ch in channels):
                return
            for ch in channels:
                if ch.sending:
                    ch.flush()
            now = time.monotonic()
            owing = set(unsent) | {self._waiting.get(i, self._landed.get(i, (None,)))[0] for i in left}
            for ch in channels:  # a peer that closed with work outstanding is gone (after its last notices)
                if ch.eof and ch in owing:
                    closed.setdefault(ch, now)
                    if now - closed[ch] > min(_NOTICE_GRACE_S, self._timeout[g]):
                        raise ch.closed_error()
            if progress:
                sleep, idle_from = 0.0, 0.0
                continue
            if now > self._deadline[g]:
                raise self._timeout_error(g, unsent, flying, left)
            idle_from = idle_from or now
            if now - idle_from < _YIELD_S:  # the peer is a round trip away: give the core to whoever needs it
                os.sched_yield()
                continue
            if sleep:
                live = [ch for ch in channels if not ch.eof]
                if live:
                    select.select(live, [], [], sleep)
                else:
                    time.sleep(sleep)
            sleep = min(2 * sleep + 1e-5, _MAX_SLEEP_S)

    def _check(self, i: int, ch: Channel, ix: np.ndarray) -> None:
        """Compare the bytes that landed for receive ``i`` with the tags its sender sent, message by message, as
        the per-operation path compares one (:meth:`NixlComm._check`)."""
        tags = self._hub.tags.pop(i, None)
        if ch.session is None or not self._comm.tags:
            return
        addr = self._addr
        assert addr is not None
        rows = self._recv[ch][ix]
        if tags is None or len(tags) != len(rows) or None in tags:
            raise self._comm._fail(ch, f"{ch.peer} sent no tag for some of the {len(rows)} messages of a group")
        comm = self._comm
        for k, (r, want) in enumerate(zip(rows.tolist(), tags, strict=True)):
            _, src, dst, tag, buf, off, n = r
            m = mac_id(i, k)
            comm._tags[m] = (want, None)
            landed = _memory(int(addr[buf]) + off, n) if n else np.zeros(0, np.uint8)
            (_, (op,)) = ops_of_rows([], [(src, dst, tag, 0, 0, n)], [landed])
            comm._check(m, op)

    def _timeout_error(self, g: int, unsent: list, flying: list, left: list[int]) -> TransferTimeoutError:
        parts = []
        if left:
            chans = {(self._waiting.get(i) or self._landed[i])[0] for i in left}
            ranks = sorted({int(r) for ch in chans for r in self._recv[ch][self._rgroups[g][ch], _SRC]})
            parts.append(f"ranks {ranks} did not send ({', '.join(sorted(ch.peer for ch in chans))})")
        if unsent:
            ranks = sorted({int(r) for ch in set(unsent) for r in self._out[ch].rows[:, _DST]})
            peers = ", ".join(sorted({ch.peer for ch in unsent}))
            parts.append(f"ranks {ranks} did not post their receives ({peers})")
            if any(m.get("op") == "nixl.post" for ch in set(unsent) for m in ch.inbox):
                parts.append(
                    "they post one exchange at a time, as a receiver with Options(encrypt=True) or "
                    "JRESHARD_NIXL_PREPARED=0 does, while this side sends from prepared groups: set both the same on "
                    "both sides"
                )
        if flying:
            parts.append(f"the WRITEs to {', '.join(sorted({ch.peer for ch in flying}))} did not complete")
        return TransferTimeoutError(
            f"NixlComm.exchange: no answer within timeout_s={self._timeout[g]}: {'; '.join(parts)}. A peer died or "
            "stopped answering; this communicator is now broken"
        )

    def _break(self, err: Exception) -> None:
        """Fail-stop: the communicator is broken, receives given up, WRITEs in flight cancelled."""
        if self._comm.broken is None:
            self._comm.broken = str(err)
        held = self._buffers or ()
        gone = {**self._waiting, **self._landed}
        self._agent.abandon(
            {
                i: [held[b] for b in np.unique(self._recv[ch][ix, _BUF]).tolist() if b < len(held)]
                for i, (ch, ix) in gone.items()
            }
        )
        self._waiting.clear()
        self._landed.clear()
        for out in self._out.values():
            for batch in out.by_group.values():
                if batch.flying:
                    self._retire(batch)

    def _retire(self, batch: _Batch) -> None:
        """Retire ``batch``'s WRITE, keeping this step's buffers and every registration of this schedule until NIXL
        is done with it."""
        held = {k for k in self._keys if k is not None}
        batch.retire(self._agent, tuple(self._buffers or ()), tuple(self._agent.descs_of(k) for k in held))

    def finish(self) -> None:
        self._buffers = None

    def abort(self, group: int, why: str) -> None:
        self._break(PeerError(f"NixlComm: gave up a posted group: {why}"))

    def failed(self, group: int, code: int, request: int, value: int, timeout_s: float) -> NoReturn:
        raise AssertionError("NixlPrepared has no compiled replay")  # pragma: no cover - native is None

    def release(self) -> None:
        for out in self._out.values():
            for batch in out.by_group.values():
                if batch.flying:
                    self._retire(batch)
                batch.drop()
        for ch, out in self._out.items():
            if out.token is not None:
                self._hub.claimed.pop((ch, out.token), None)
        self._posted.clear()
        self._last = None


def _bytes_of(buffer: Any) -> np.ndarray:
    """``buffer`` (a host array) as the contiguous 1-D uint8 view :meth:`NixlAgent.region` takes."""
    if buffer.dtype == np.uint8 and buffer.ndim == 1:
        return buffer
    if not buffer.flags.c_contiguous:
        raise TransferError(f"NixlComm: a {buffer.dtype}{list(buffer.shape)} buffer is not contiguous")
    return buffer.reshape(-1).view(np.uint8)
