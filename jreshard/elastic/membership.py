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

from jreshard.elastic.pairs import check_pair, choose_source, pair_plan, run_pair, source_shards
from jreshard.elastic.types import CatchUp, PushReport, ReplicaInfo, ReplicaState
from jreshard.elastic.wire import Channel
from jreshard.errors import JReshardError, TransferError
from jreshard.options import Options

__all__ = ["Membership"]


@dataclasses.dataclass(slots=True)
class _Member:  # mutable bookkeeping of the service thread; the public view is ReplicaInfo
    id: int
    name: str
    channel: Channel
    decl: dict
    peer_port: int
    state: ReplicaState = ReplicaState.JOINING
    version: int | None = None
    caught_up_from: str = ""
    error: str = ""
    via_peer: str = ""  # the replica it is catching up from, while it is

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(self.name, self.id, self.state, self.version, self.caught_up_from, self.error)


class Membership:
    """The replicas of one trainer and what they hold (final; one thread calls its methods).

    Args:
      decl: the trainer's declaration.
      devices: the trainer's devices, in declaration order.
      options, catch_up, links: as for :class:`ElasticTrainer`.
      listener: the listening socket; wake: a socket whose bytes only wake :meth:`poll`.
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
    ):
        self._decl, self._devices, self.options, self.catch_up = decl, list(devices), options, catch_up
        self._links = dict(links)
        self._listener, self._wake = listener, wake
        self.cv = threading.Condition()
        self.members: dict[int, _Member] = {}
        self.gone: list[ReplicaInfo] = []
        self.committed: tuple[int, list[tuple[str, Any]]] | None = None
        self._pending: list[tuple[Channel, float]] = []
        self._next_id = 1

    @property
    def version(self) -> int | None:
        return None if self.committed is None else self.committed[0]

    def goodbye(self) -> None:
        """Tell every replica the trainer is done, and close every connection."""
        for m in list(self.members.values()):
            try:
                m.channel.send_control({"op": "bye"}, timeout_s=1.0)
            except JReshardError:
                pass
            self._drop(m, "the trainer closed")
        for ch, _ in self._pending:
            ch.close()

    def poll(self, wait_s: float) -> None:
        """Admit joiners, read every replica's messages, notice closed connections."""
        waits: list[Any] = [self._listener, self._wake, *(ch for ch, _ in self._pending)]
        ready, _, _ = select.select(waits + [m.channel for m in self.members.values()], [], [], wait_s)
        if self._wake in ready:
            self._wake.recv(4096)
        if self._listener in ready:
            try:
                sock, _ = self._listener.accept()
                self._pending.append((Channel(sock, "a joining replica"), time.monotonic() + self.options.timeout_s))
            except BlockingIOError:
                pass
        for ch, deadline in list(self._pending):
            ch.pump()
            if ch.inbox or ch.eof or time.monotonic() > deadline:
                self._pending.remove((ch, deadline))
                if ch.inbox:
                    self._admit(ch, ch.inbox.popleft())
                else:
                    ch.close()
        for m in list(self.members.values()):
            try:
                m.channel.pump()
            except JReshardError as err:
                self._drop(m, str(err))
                continue
            while m.channel.inbox and m.state is not ReplicaState.GONE:
                msg = m.channel.inbox.popleft()
                try:
                    self._message(m, msg)
                except (KeyError, TypeError, ValueError) as err:
                    self._drop(m, f"it sent a malformed message {msg!r} ({type(err).__name__}: {err})")
            if m.channel.eof and m.state is not ReplicaState.GONE:
                self._drop(m, m.channel.closed_error().args[0])

    def _admit(self, ch: Channel, hello: dict) -> None:
        if hello.get("op") != "hello":
            ch.close()
            return
        with self.cv:
            ident = self._next_id
            self._next_id += 1
            taken = {m.name for m in self.members.values()}
        name = hello.get("name") or f"replica-{ident}"
        try:
            problems = check_pair(self._decl, hello["decl"])
            peer_port = int(hello["peer_port"])
        except (KeyError, TypeError, ValueError, IndexError) as err:
            problems, peer_port = [f"a malformed hello ({type(err).__name__}: {err}): not a jreshard replica?"], 0
        if name in taken:
            problems.append(f"the name {name!r} is taken by a live replica")
        if problems:
            try:
                ch.send_control({"op": "reject", "errors": problems}, timeout_s=self.options.timeout_s)
            except JReshardError:
                pass
            ch.close()
            return
        ch.peer = f"replica {name!r}"
        m = _Member(ident, name, ch, hello["decl"], peer_port)
        with self.cv:  # a member before its welcome: a wait that returns after the replica's join counts it
            v = None if self.committed is None else self.committed[0]
            m.state = ReplicaState.JOINING if v is not None else ReplicaState.READY
            self.members[ident] = m
            self.cv.notify_all()
        try:
            welcome = {"op": "welcome", "id": ident, "name": name, "decl": self._decl, "version": v}
            ch.send_control(welcome, timeout_s=self.options.timeout_s)
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
        trainer = self._decl if self._trainer_can_serve() else None
        decls = {n: p.decl for n, p in peers.items()}
        chosen = choose_source(self.catch_up, trainer, decls, m.decl, self.options, self._links)
        use_peer, peer_list = chosen is not None, [peers[chosen]] if chosen is not None else []
        try:
            if use_peer:
                p = peer_list[0]
                m.via_peer = p.name
                msg = {"op": "catchup", "version": v, "from": "peer", "peer": p.name, "port": p.peer_port}
                m.channel.send_control(msg | {"decl": p.decl}, timeout_s=self.options.timeout_s)
                return
            if not self._trainer_can_serve():
                self._drop(m, f"no live replica holds version {v} and the trainer's copy was deleted (donated)")
                return
            m.via_peer = ""
            m.channel.send_control({"op": "catchup", "version": v, "from": "trainer"}, timeout_s=self.options.timeout_s)
            self._send(m, leaves)
        except TransferError as err:
            self._drop(m, f"catching up to version {v}: {err}")

    def _send(self, m: _Member, leaves: list[tuple[str, Any]]) -> None:
        pair = pair_plan(self._decl, m.decl, self.options, self._links)
        run_pair(pair, m.channel, source=True, shards=source_shards(pair, leaves, self._devices), options=self.options)

    def _message(self, m: _Member, msg: dict) -> None:
        op = msg.get("op")
        if op == "at":
            with self.cv:
                if m.version is None:
                    m.caught_up_from = msg.get("source", "")
                m.version = int(msg["version"])
                m.state = ReplicaState.READY
                m.via_peer = ""
                self.cv.notify_all()
            if self.committed is not None and m.version < self.committed[0]:
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
            m.state, m.error = ReplicaState.GONE, why
            self.gone = [*self.gone[-1023:], m.info()]  # the last 1024 departures
            self.cv.notify_all()
        m.channel.close()

    def push(self, version: int, leaves: list[tuple[str, Any]]) -> PushReport:
        t0 = time.monotonic()
        deadline = t0 + self.options.timeout_s
        while any(m.state is ReplicaState.JOINING for m in self.members.values()) and time.monotonic() < deadline:
            self.poll(0.02)
        for m in [m for m in self.members.values() if m.state is ReplicaState.JOINING]:
            self._drop(m, f"did not catch up within timeout_s={self.options.timeout_s}")
        targets = list(self.members.values())
        for m in targets:
            try:
                m.channel.send_control({"op": "refit", "version": version}, timeout_s=self.options.timeout_s)
                self._send(m, leaves)
            except TransferError as err:
                self._drop(m, f"during version {version}: {err}")
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
        lost = {m.name: m.error for m in targets if m.state is ReplicaState.GONE}
        done = tuple(m.name for m in targets if m.state is not ReplicaState.GONE)
        return PushReport(version, done, lost, time.monotonic() - t0)
