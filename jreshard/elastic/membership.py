"""The trainer's membership: who is connected, at which version; admitting, catching up, pushing, dropping.

Used by :class:`ElasticTrainer`'s service thread only (it owns every socket);
the caller's thread reads :attr:`Membership.members` under :attr:`Membership.cv`.
"""

from __future__ import annotations

import dataclasses
import select
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jreshard.elastic.delta import TrainerBases, delta_on, pair_report, unit_of
from jreshard.elastic.followers import Followers
from jreshard.elastic.pairs import check_pair, choose_source, pair_plan, run_pair, source_shards
from jreshard.elastic.types import CatchUp, PushReport, ReplicaInfo, ReplicaState
from jreshard.errors import JReshardError, TransferError
from jreshard.net.channel import MAX_PEER_PROCESSES, Channel, make_room, peer_int
from jreshard.options import Delta, Options
from jreshard.refit.delta import Backoff

__all__ = ["Membership"]

_ANY = ("0.0.0.0", "::", "")


@dataclasses.dataclass(slots=True)
class _Member:  # mutable bookkeeping of the service thread; the public view is ReplicaInfo
    id: int
    name: str
    channels: list[Channel]  # one per process of the replica, in process order
    decls: list[dict]
    peer_addresses: list[tuple[str, int]]  # where each process serves catch-ups
    state: ReplicaState = ReplicaState.JOINING
    version: int | None = None
    caught_up_from: str = ""
    error: str = ""
    via_peer: str = ""  # the replica it is catching up from, while it is
    have: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # version -> processes that staged it
    at: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # version -> processes that committed it
    delta: bool = False  # it takes delta refits (its hello said so)
    backoff: Backoff = dataclasses.field(default_factory=lambda: Backoff(False))  # delta="auto" stepping aside
    bases: list[int | None] = dataclasses.field(default_factory=list)  # per process, the base version it holds

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(self.name, self.id, self.state, self.version, self.caught_up_from, self.error)

    def send(self, msg: dict, timeout_s: float) -> None:
        for ch in self.channels:
            ch.send_control(msg, timeout_s=timeout_s)


def _malformed_hello(n: Any, name: Any, process: Any) -> str:
    """Why a hello's ``processes``, ``name`` and ``process`` cannot be a replica's ("": they can)."""
    if not peer_int(n, 1, MAX_PEER_PROCESSES):
        return f"processes={n!r:.40} is not an int in 1..{MAX_PEER_PROCESSES}"
    if not peer_int(process, 0, n - 1):
        return f"process={process!r:.40} is not an int in 0..{n - 1}"
    if name is not None and (not isinstance(name, str) or not name or len(name) > 256):
        return f"name={name!r:.40} is not a str of 1 to 256 characters"
    return ""


def _peer_address(ch: Channel, said: object) -> tuple[str, int]:
    """Where a replica process serves catch-ups: the host it bound (the one its trainer connection
    came from when it bound every interface) and its port."""
    if not (isinstance(said, list) and len(said) == 2 and isinstance(said[0], str)):
        raise ValueError(f"peer_address={said!r} must be [host, port]")
    host, port = said[0], int(said[1])
    if host in _ANY:
        host = ch.sock.getpeername()[0]
    return host, port


def _why(err: BaseException) -> str:
    """An error as a drop reason: jreshard's own by its message, any other with its type."""
    return str(err) if isinstance(err, TransferError) else f"{type(err).__name__}: {err}"


def _alive(ch: Channel) -> bool:
    try:
        ch.pump()
    except JReshardError:
        return False
    return not ch.eof


class Membership:
    """The replicas of one trainer and what they hold (final; one thread calls its methods).

    Args:
      decl: the trainer's declaration.
      devices: the trainer's devices, in declaration order.
      options, catch_up, links: as for :class:`ElasticTrainer`.
      listener: the listening socket; wake: a socket whose bytes only wake :meth:`poll`.
      key: the shared secret every connection proves it holds before its hello is read.
      followers: the other processes of a trainer of several (``None``: one process).
    """

    def __init__(
        self,
        decl: dict,
        devices: Sequence[Any],
        options: Options,
        catch_up: CatchUp,
        links: Mapping[str, float],
        listener: socket.socket,
        wake: socket.socket,
        key: bytes,
        *,
        followers: Followers | None = None,
    ):
        self._decl, self._devices, self.options, self.catch_up = decl, list(devices), options, catch_up
        self._links = dict(links)
        self._listener, self._wake, self._key = listener, wake, key
        self._followers = followers
        self._decls = followers.decls if followers is not None else [decl]  # every trainer process's
        self._out_version = 0  # the version _send moves (the followers are told it)
        self.cv = threading.Condition()
        self.members: dict[int, _Member] = {}
        self.gone: list[ReplicaInfo] = []
        self._lost: dict[str, str] = {}  # departures since the last push report, for the next one
        self.committed: tuple[int, list[tuple[str, Any]]] | None = None
        self._pending: list[tuple[Channel, float]] = []
        self._forming: dict[str, tuple[dict[int, tuple[Channel, dict]], float]] = {}  # multi-process joiners
        self._next_id = 1
        self._deltas = TrainerBases(options)  # what this process last sent each replica (delta refits)

    @property
    def version(self) -> int | None:
        return None if self.committed is None else self.committed[0]

    def goodbye(self) -> None:
        """Tell every replica the trainer is done, and close every connection."""
        for m in list(self.members.values()):
            try:
                m.send({"op": "bye"}, 1.0)
            except JReshardError:
                pass
            self._drop(m, "the trainer closed")
        for ch, _ in self._pending:
            ch.close()
        for group, _ in self._forming.values():
            for ch, _ in group.values():
                ch.close()
        if self._followers is not None:
            self._followers.goodbye()

    def adopt(self, early: Sequence[tuple[Channel, float]]) -> None:
        """Take over connections that arrived while the trainer's processes gathered."""
        self._pending.extend(early)

    def poll(self, wait_s: float) -> None:
        """Admit joiners, read every replica's messages, notice closed connections."""
        forming = [ch for group, _ in self._forming.values() for ch, _ in group.values()]
        waits: list[Any] = [self._listener, self._wake, *(ch for ch, _ in self._pending), *forming]
        ready, _, _ = select.select(waits + [c for m in self.members.values() for c in m.channels], [], [], wait_s)
        if self._wake in ready:
            self._wake.recv(4096)
        if self._listener in ready:
            self._accept()
        for ch, deadline in list(self._pending):
            try:
                ch.pump()  # the handshake first: nothing from an unauthenticated peer is read as a hello
            except JReshardError:  # refused (the channel logged why) or a malformed frame: this one only
                self._pending.remove((ch, deadline))
                ch.close()
                continue
            if ch.inbox or ch.eof or time.monotonic() > deadline:
                self._pending.remove((ch, deadline))
                if ch.inbox:
                    self._hello(ch, ch.inbox.popleft(), deadline)
                else:
                    ch.close()
        for name, (group, deadline) in list(self._forming.items()):
            if time.monotonic() > deadline or not all(_alive(ch) for ch, _ in group.values()):
                del self._forming[name]
                n = next(iter(group.values()))[1].get("processes")
                why = f"only processes {sorted(group)} of the {n} of replica {name!r} joined within timeout_s"
                self._reject(list(group.values()), [why])
        for m in list(self.members.values()):
            for p, ch in enumerate(m.channels):
                try:
                    ch.pump()
                except JReshardError as err:
                    self._drop(m, str(err))
                while m.state is not ReplicaState.GONE and (msg := ch.pop()) is not None:
                    try:
                        self._message(m, p, msg)
                    except (KeyError, TypeError, ValueError, OverflowError) as err:
                        self._drop(m, f"it sent a malformed message {msg!r} ({type(err).__name__}: {err})")
                if ch.eof and m.state is not ReplicaState.GONE:
                    self._drop(m, ch.closed_error().args[0])

    def _accept(self) -> None:
        """Take every waiting connection; each starts with the trainer's challenge."""
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors: try again at the next poll
                return
            ch = Channel.server(sock, "a joining replica", key=self._key)
            victim = make_room(self._pending, ch)  # a flood of silent connections displaces only itself
            if victim is not None:
                self._pending.remove(victim)
            self._pending.append((ch, time.monotonic() + self.options.timeout_s))

    def _hello(self, ch: Channel, hello: dict, deadline: float) -> None:
        """One process's hello: a replica of several processes is admitted when all of them said hello."""
        if hello.get("op") != "hello":
            ch.close()
            return
        n, name, process = hello.get("processes", 1), hello.get("name"), hello.get("process", 0)
        why = _malformed_hello(n, name, process)
        if why:  # refused with the reason, this connection only (the trainer serves on)
            self._reject([(ch, hello)], [f"a malformed hello ({why}): not a jreshard replica?"])
            return
        if n == 1:
            self._admit([(ch, hello)])
            return
        group, _ = self._forming.setdefault(str(name), ({}, deadline))
        group[process] = (ch, hello)
        if len(group) == n:
            del self._forming[str(name)]
            self._admit([group[p] for p in sorted(group)])

    def _reject(self, hellos: Sequence[tuple[Channel, dict]], problems: list[str]) -> None:
        for ch, _ in hellos:
            try:
                ch.send_control({"op": "reject", "errors": problems}, timeout_s=self.options.timeout_s)
            except JReshardError:
                pass
            ch.close()

    def _admit(self, hellos: Sequence[tuple[Channel, dict]]) -> None:
        with self.cv:
            ident = self._next_id
            self._next_id += 1
            taken = {m.name for m in self.members.values()}
        name = hellos[0][1].get("name") or f"replica-{ident}"
        try:
            decls = [h["decl"] for _, h in hellos]
            peer_addresses = [_peer_address(ch, h["peer_address"]) for ch, h in hellos]
            problems = check_pair(self._decls, decls)
            if [h.get("process", 0) for _, h in hellos] != list(range(len(hellos))):
                problems.append(f"process numbers {[h.get('process') for _, h in hellos]} of replica {name!r}")
            if not problems:  # planned (views lowered and scheduled) before the welcome; cached for every refit
                try:
                    pair_plan(self._decls, decls, self.options, self._links)
                except (JReshardError, ValueError) as err:
                    problems.append(f"the declared layouts cannot be planned: {type(err).__name__}: {err}")
        except (KeyError, TypeError, ValueError, IndexError) as err:
            problems, peer_addresses = [f"a malformed hello ({type(err).__name__}: {err}): not a jreshard replica?"], []
        if name in taken:
            problems.append(f"the name {name!r} is taken by a live replica")
        if problems:
            self._reject(hellos, problems)
            return
        for p, (ch, _) in enumerate(hellos):
            ch.peer = f"replica {name!r}" + (f" (process {p})" if len(hellos) > 1 else "")
        m = _Member(ident, name, [ch for ch, _ in hellos], decls, peer_addresses)
        m.delta, m.bases = all(bool(h.get("delta")) for _, h in hellos), [None] * len(hellos)
        m.backoff = Backoff(self.options.delta is Delta.AUTO)
        with self.cv:  # a member before its welcome: a wait that returns after the replica's join counts it
            v = None if self.committed is None else self.committed[0]
            m.state = ReplicaState.JOINING if v is not None else ReplicaState.READY
            self.members[ident] = m
            self.cv.notify_all()
        try:
            welcome = {"op": "welcome", "id": ident, "name": name, "decl": self._decl, "decls": decls, "version": v}
            if self._followers is not None:  # the replica attaches to every trainer process
                welcome |= {"trainer_decls": self._decls, "followers": self._followers.addresses[1:]}
            m.send(welcome, self.options.timeout_s)
        except JReshardError as err:
            self._drop(m, f"joining: {err}")
            return
        if v is not None:
            self._catch_up(m)

    def _trainer_can_serve(self) -> bool:
        return self.committed is not None and not any(a.is_deleted() for _, a in self.committed[1])

    def _catch_up(self, m: _Member, *, forbid_peer: bool = False) -> None:
        assert self.committed is not None
        v, leaves = self.committed
        peers = {
            p.name: p
            for p in self.members.values()
            if p is not m and p.state is ReplicaState.READY and p.version == v and not forbid_peer
        }
        trainer = self._decls if self._trainer_can_serve() else None
        decls = {n: p.decls for n, p in peers.items()}
        chosen = choose_source(self.catch_up, trainer, decls, m.decls, self.options, self._links)
        try:
            if chosen is not None:
                p = peers[chosen]
                m.via_peer = p.name
                addresses = [list(a) for a in p.peer_addresses]
                msg = {"op": "catchup", "version": v, "from": "peer", "peer": p.name, "addresses": addresses}
                m.send(msg | {"decls": p.decls}, self.options.timeout_s)
                return
            if not self._trainer_can_serve():
                self._drop(
                    m,
                    f"no live replica of its declaration holds version {v} and the trainer's copy was deleted "
                    "(donated)",
                )
                return
            m.via_peer = ""
            use = self._use_delta(m)
            m.send({"op": "catchup", "version": v, "from": "trainer", "delta": use}, self.options.timeout_s)
            self._out_version = v
            self._send(m, leaves, use)
        except Exception as err:  # any failure (the transport's included) drops this replica only
            self._drop(m, f"catching up to version {v}: {_why(err)}")

    def _use_delta(self, m: _Member) -> bool:
        """Whether the next refit of ``m`` runs as delta rounds: both ends have deltas on, and (``auto``)
        this process's last deltas to it paid (:class:`jreshard.refit.delta.Backoff`)."""
        return delta_on(self.options) and m.delta and not m.backoff.whole

    def _send(self, m: _Member, leaves: list[tuple[str, Any]], use: bool) -> Any:
        """Refit ``m`` to ``self._out_version``, as delta rounds where ``use`` (what the replica was told):
        every follower its shards, this process its own; the report of this process's part
        (:func:`jreshard.elastic.delta.pair_report`). A whole refit drops what this process kept for ``m``."""
        t0 = time.monotonic()
        pair = pair_plan(self._decls, m.decls, self.options, self._links)
        why = ""
        if not use:
            why = (
                "the trainer has delta off"
                if not delta_on(self.options)
                else "the replica has delta off"
                if not m.delta
                else f"the trainer sends whole for now (delta='auto': {m.backoff.why()})"
            )
            self._deltas.forget(m.id)
        m.backoff.started()
        bases = list(m.bases)
        if self._followers is not None:
            self._followers.dispatch(m.id, m.name, m.decls, self._out_version, delta=use, bases=bases)
        shards = source_shards(pair, leaves, self._devices, 0)
        chs = {pair.n_src + p: ch for p, ch in enumerate(m.channels)}
        ranks = [pair.ranks(pair.n_src + j) for j in range(len(m.channels))]
        delta = self._deltas.refit(m.id, bases, ranks, unit_of(m.decls)) if use else None
        before = None if delta is None else delta.bases.version
        try:
            _, stats = run_pair(pair, 0, chs, shards=shards, options=self.options, delta=delta)
        except BaseException:
            self._deltas.failed(m.id)
            raise
        if delta is not None:
            self._deltas.sent(m.id, self._out_version)
            m.backoff.judge(delta.stats)
        full = sum(stats.sent_bytes.values())
        return pair_report(self._out_version, m.name, delta, before, bases, why, time.monotonic() - t0, full)

    def _message(self, m: _Member, process: int, msg: dict) -> None:
        op = msg.get("op")
        if op in ("have", "at"):  # the replica's processes swap a version in only when all of them hold it
            v = int(msg["version"])
            seen = m.have if op == "have" else m.at
            if op == "at":  # the version its kept chunks are of (None: none): what the next refit encodes against
                base = msg.get("base")
                m.bases[process] = base if peer_int(base) else None
            seen.setdefault(v, set()).add(process)
            if len(seen[v]) < len(m.channels):
                return
            del seen[v]
            if op == "have":
                m.send({"op": "commit", "version": v}, self.options.timeout_s)
                return
            with self.cv:
                if m.version is None:
                    m.caught_up_from = msg.get("source", "")
                m.version = v
                m.state = ReplicaState.READY
                m.via_peer = ""
                self.cv.notify_all()
            if self.committed is not None and v < self.committed[0]:
                with self.cv:  # it caught up to a version pushed meanwhile: bring it to the latest
                    m.state = ReplicaState.JOINING
                self._catch_up(m)
        elif op == "leave":
            self._drop(m, "left")
        elif op == "failed" and m.state is ReplicaState.JOINING and m.via_peer:
            if self._trainer_can_serve():
                self._catch_up(m, forbid_peer=True)  # the peer failed: serve it from here
            else:
                self._drop(m, f"catching up from replica {m.via_peer!r} failed: {msg.get('error')}")
        elif op == "failed":
            self._drop(m, f"it reported: {msg.get('error')}")

    def _drop(self, m: _Member, why: str) -> None:
        with self.cv:
            if self.members.pop(m.id, None) is None:
                return
            self._deltas.forget(m.id)
            m.state, m.error = ReplicaState.GONE, why
            self.gone = [*self.gone[-1023:], m.info()]  # the last 1024 departures
            before = self._lost.get(m.name)  # a name that left twice since the last report: both reasons
            self._lost[m.name] = why if before is None else f"{before}; then (rejoined) {why}"
            self.cv.notify_all()
        for ch in m.channels:
            ch.close()

    def push(self, version: int, leaves: list[tuple[str, Any]]) -> PushReport:
        t0 = time.monotonic()
        deadline = t0 + self.options.timeout_s
        while any(m.state is ReplicaState.JOINING for m in self.members.values()) and time.monotonic() < deadline:
            self.poll(0.02)
        for m in [m for m in self.members.values() if m.state is ReplicaState.JOINING]:
            self._drop(m, f"did not catch up within timeout_s={self.options.timeout_s}")
        targets = list(self.members.values())
        deltas = {}
        for m in targets:
            try:
                use = self._use_delta(m)
                m.send({"op": "refit", "version": version, "delta": use}, self.options.timeout_s)
                self._out_version = version
                deltas[m.name] = self._send(m, leaves, use)
            except Exception as err:  # any failure (the transport's included) drops this replica only
                self._drop(m, f"during version {version}: {_why(err)}")
            self.poll(0.0)  # register the replicas done so far ("any k at v" sees them early)
        with self.cv:
            self.committed = (version, leaves)
        sent = {m.id for m in targets}
        for m in [m for m in self.members.values() if m.id not in sent and m.state is ReplicaState.READY]:
            with self.cv:  # admitted during this push, already at an older version: bring it to this one
                m.state = ReplicaState.JOINING
            self._catch_up(m)
        deadline = time.monotonic() + self.options.timeout_s
        while time.monotonic() < deadline:
            missing = [m for m in targets if m.state is not ReplicaState.GONE and m.version != version]
            if not missing:
                break
            self.poll(0.02)
        for m in targets:
            if m.state is not ReplicaState.GONE and m.version != version:
                self._drop(m, f"did not report version {version} within timeout_s={self.options.timeout_s}")
        done = tuple(m.name for m in targets if m.version == version)  # (one may have left since: it did commit)
        with self.cv:  # every departure since the previous report: during this push, or between the two
            lost, self._lost = self._lost, {}
        report = PushReport(version, done, lost, time.monotonic() - t0, deltas)
        if self._followers is not None:
            self._followers.pushed(report)
        return report
