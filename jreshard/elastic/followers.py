"""A trainer of several processes: process 0 leads membership, every other process serves its own shards.

Each process of the trainer's jax cluster makes an :class:`~jreshard.elastic.ElasticTrainer`. Process
0 (the *leader*) listens at the trainer's address and runs the membership (:mod:`.membership`):
hellos, declarations, votes, versions. Every other process (a *follower*) connects to the leader
(authenticated, as any connection), says its declaration and the address where it serves data, and
listens there. A replica, once welcomed, connects to each follower too (``attach``), so every
refit is one plan from all the trainer processes' shards to the replica's, run by each trainer
process over its own connections: no byte passes through the leader.

For each refit or catch-up the leader tells every follower ``send`` (the replica, its
declarations, the version) before it starts its own part; each follower runs its part with the
tree its own ``push`` was given for that version (waiting for that call, up to ``timeout_s``) or
the last committed one. When a push is done the leader sends every follower its report, which the
follower's ``push`` returns. A follower that dies fails every replica's refit (each replica reports
it and is dropped); a replica that dies fails only the followers' parts for it.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from jreshard.elastic.delta import TrainerBases, unit_of
from jreshard.elastic.pairs import pair_plan, run_pair, source_shards
from jreshard.elastic.types import PushReport
from jreshard.errors import JReshardError, PeerError, TransferTimeoutError
from jreshard.net.channel import Channel, accept_first, connect, listen, make_room, peer_int
from jreshard.options import Options

__all__ = ["Followers", "FollowerService", "gather_followers"]

_ANY = ("0.0.0.0", "::", "")


class Followers:
    """The leader's connections to the followers (final; the membership thread uses it).

    Attributes:
      decls: the declarations of every trainer process, in process order (the leader's first).
      addresses: where each follower serves data, in process order (the leader's slot is ``None``).
    """

    def __init__(self, decl: dict, channels: dict[int, Channel], joins: dict[int, dict], timeout_s: float):
        self._channels = channels
        self.decls = [decl] + [joins[p]["decl"] for p in sorted(joins)]
        self.addresses: list[list[Any] | None] = [None] + [joins[p]["data"] for p in sorted(joins)]
        self._timeout_s = timeout_s

    def dispatch(
        self,
        member: int,
        name: str,
        decls: list[dict],
        version: int,
        *,
        delta: bool = False,
        bases: list[int | None] | None = None,
    ) -> None:
        """Tell every follower to run its part of the refit of ``version`` to replica ``member`` (as delta rounds
        against the replica processes' ``bases`` with ``delta``)."""
        msg = {"op": "send", "member": member, "name": name, "decls": decls, "version": version, "delta": delta}
        msg["bases"] = list(bases or [None] * len(decls))
        for p, ch in self._channels.items():
            try:
                ch.send_control(msg, timeout_s=self._timeout_s)
            except JReshardError as err:
                raise PeerError(f"trainer process {p} is gone ({err}): it cannot serve its shards") from err

    def pushed(self, report: PushReport) -> None:
        """Hand every follower the report of a push (its ``push`` returns it)."""
        msg = {"op": "pushed", "version": report.version, "committed": list(report.committed), "lost": report.lost}
        for ch in self._channels.values():
            try:
                ch.send_control(msg | {"seconds": report.seconds}, timeout_s=self._timeout_s)
            except JReshardError:
                pass  # a dead follower's push is not waited for

    def goodbye(self) -> None:
        for ch in self._channels.values():
            try:
                ch.send_control({"op": "bye"}, timeout_s=1.0)
            except JReshardError:
                pass
            ch.close()


def gather_followers(
    listener: socket.socket, decl: dict, count: int, key: bytes, options: Options
) -> tuple[Followers, list[tuple[Channel, float]]]:
    """On the leader: wait (up to ``options.timeout_s``) until the ``count - 1`` followers joined.

    Returns the followers and the other connections that arrived meanwhile (replicas, already
    authenticated or not), for the membership to take over with their deadlines.
    """
    deadline = time.monotonic() + options.timeout_s
    pending: list[Channel] = []
    early: list[tuple[Channel, float]] = []
    channels: dict[int, Channel] = {}
    joins: dict[int, dict] = {}
    while len(joins) < count - 1:
        left = deadline - time.monotonic()
        if left <= 0:
            for c in pending + list(channels.values()):
                c.close()
            missing = sorted(set(range(1, count)) - set(joins))
            raise TransferTimeoutError(
                f"ElasticTrainer: trainer processes {missing} did not join process 0 within timeout_s="
                f"{options.timeout_s}"
            )
        for c, msg in accept_first(listener, pending, key=key, who="a joining process", wait_s=min(left, 0.05)):
            if msg.get("op") != "follower":  # a replica that came early: the membership admits it
                c.inbox.appendleft(msg)
                early.append((c, time.monotonic() + options.timeout_s))
                continue
            p = msg.get("process")
            data = msg.get("data")
            if not (isinstance(p, int) and 0 < p < count and isinstance(data, list) and len(data) == 2):
                c.close()
                continue
            if data[0] in _ANY:
                data = [c.sock.getpeername()[0], data[1]]
            c.peer = f"trainer process {p}"
            channels[p], joins[p] = c, {"decl": msg.get("decl"), "data": data}
    early += [(c, deadline) for c in pending]
    followers = Followers(decl, channels, joins, options.timeout_s)
    for p, c in channels.items():  # every follower plans with every trainer process's declaration
        try:
            c.send_control({"op": "trainer", "decls": followers.decls}, timeout_s=options.timeout_s)
        except JReshardError as err:
            raise PeerError(f"ElasticTrainer: trainer process {p} left while the trainer formed ({err})") from err
    return followers, early


class FollowerService:
    """A follower process of the trainer: serves its shards to each replica the leader names (final).

    Args:
      leader: ``(host, port)`` of process 0.
      process, decl, devices: this process's number, declaration and devices.
      host: the interface to serve data on.
      key, options, links: as the trainer's.
    """

    def __init__(
        self,
        leader: tuple[str, int],
        process: int,
        decl: dict,
        devices: Sequence[Any],
        host: str,
        key: bytes,
        options: Options,
        links: dict[str, float],
    ):
        self.options, self._links, self._key = options, links, key
        self._process, self._devices = process, list(devices)
        self._deltas = TrainerBases(options)  # what this process last sent each replica (delta refits)
        self._listener = listen(host, 0)
        self._leader = connect(leader, "the trainer's process 0", key=key, timeout_s=options.timeout_s)
        bound = self._listener.getsockname()
        hello = {"op": "follower", "process": process, "decl": decl, "data": [host, bound[1]]}
        self._leader.send_control(hello, timeout_s=options.timeout_s)
        self.cv = threading.Condition()
        self.decls: list[dict] | None = None
        self._attached: dict[tuple[int, int], Channel] = {}  # (member id, replica process) -> connection
        self._pending: list[tuple[Channel, float]] = []
        self.trees: dict[int, list[tuple[str, Any]]] = {}  # version -> leaves given to push, not yet done
        self.committed: tuple[int, list[tuple[str, Any]]] | None = None
        self.reports: dict[int, PushReport] = {}
        self.gone: str | None = None
        self.trainer_decls: list[dict] | None = None

    def poll(self, wait_s: float) -> None:
        """Accept and read attaching replicas, run the leader's jobs, notice the leader's end."""
        waits: list[Any] = [self._listener, self._leader, *(c for c, _ in self._pending)]
        select.select(waits, [], [], wait_s)
        try:
            sock, _ = self._listener.accept()
        except OSError:  # nothing waiting, or out of descriptors: the next poll
            pass
        else:
            ch = Channel.server(sock, "an attaching replica", key=self._key)
            victim = make_room(self._pending, ch)
            if victim is not None:
                self._pending.remove(victim)
            self._pending.append((ch, time.monotonic() + 5))
        for c, deadline in list(self._pending):
            try:
                c.pump()
            except JReshardError:
                self._pending.remove((c, deadline))
                continue
            msg = c.pop()
            if msg is None:
                if c.eof or time.monotonic() > deadline:
                    self._pending.remove((c, deadline))
                    c.close()
                continue
            self._pending.remove((c, deadline))
            member, process = msg.get("id"), msg.get("process")
            if msg.get("op") != "attach" or not isinstance(member, int) or not isinstance(process, int):
                c.close()
                continue
            c.peer = f"replica {msg.get('name')!r} (process {process})"
            old = self._attached.pop((member, process), None)
            if old is not None:
                old.close()
            self._attached[(member, process)] = c
        for k, c in list(self._attached.items()):  # drop the connections of replicas that went
            try:
                c.pump()
            except JReshardError:
                c.close()
            if c.eof:
                del self._attached[k]
                self._deltas.forget(k[0])  # what this process kept for that replica goes with it
        try:
            self._leader.pump()
        except JReshardError as err:
            self._end(f"the connection to process 0 broke ({err})")
            return
        while (msg := self._leader.pop()) is not None:
            op = msg.get("op")
            if op == "send":
                self._serve(msg)
            elif op == "pushed":
                report = PushReport(int(msg["version"]), tuple(msg["committed"]), dict(msg["lost"]), msg["seconds"])
                with self.cv:
                    self.reports[report.version] = report
                    leaves = self.trees.pop(report.version, None)
                    if leaves is not None:
                        self.committed = (report.version, leaves)
                    self.cv.notify_all()
            elif op == "bye":
                self._end("the trainer's process 0 closed")
        if self._leader.eof:
            self._end("the trainer's process 0 closed its connection (it exited or was killed)")

    def _end(self, why: str) -> None:
        with self.cv:
            self.gone = self.gone or why
            self.cv.notify_all()

    def _leaves(self, version: int) -> list[tuple[str, Any]] | None:
        """The tree of ``version``: the one ``push`` was given (waited for), or the committed one."""
        deadline = time.monotonic() + self.options.timeout_s
        with self.cv:
            while True:
                if version in self.trees:
                    return self.trees[version]
                if self.committed is not None and self.committed[0] == version:
                    return self.committed[1]
                left = deadline - time.monotonic()
                if left <= 0 or self.gone is not None:
                    return None
                self.cv.wait(min(left, 0.05))

    def _serve(self, msg: dict) -> None:
        """Run this process's part of one refit to one replica (a failure ends only this part)."""
        try:
            member, version, decls = int(msg["member"]), int(msg["version"]), list(msg["decls"])
        except (KeyError, TypeError, ValueError, OverflowError):
            return
        leaves = self._leaves(version)
        if leaves is None or self.trainer_decls is None:
            return  # the replica's refit fails at its end and the leader drops it
        deadline = time.monotonic() + self.options.timeout_s
        while not all((member, j) in self._attached for j in range(len(decls))) and time.monotonic() < deadline:
            self.poll(0.01)  # its processes attach right after their welcome
        try:
            pair = pair_plan(self.trainer_decls, decls, self.options, self._links)
            chs = {pair.n_src + j: self._attached[(member, j)] for j in range(len(decls))}
            shards = source_shards(pair, leaves, self._devices, self._process)
            delta = None
            if msg.get("delta") is not True:  # a whole refit: what this process kept for the replica goes
                self._deltas.forget(member)
            else:  # as process 0 decided: both ends run delta rounds
                said = msg.get("bases") or []
                bases = [b if peer_int(b) else None for b in said]
                bases += [None] * (len(decls) - len(bases))
                ranks = [pair.ranks(pair.n_src + j) for j in range(len(decls))]
                delta = self._deltas.refit(member, bases[: len(decls)], ranks, unit_of(decls))
            run_pair(pair, self._process, chs, shards=shards, options=self.options, delta=delta)
            if delta is not None:
                self._deltas.sent(member, version)
        except (JReshardError, KeyError, ValueError):
            self._deltas.failed(member)
            for j in range(len(decls)):  # this replica's connections may hold stale descriptors now
                c = self._attached.pop((member, j), None)
                if c is not None:
                    c.close()

    def close(self) -> None:
        self._leader.close()
        self._listener.close()
        for c, _ in self._pending:
            c.close()
        for c in self._attached.values():
            c.close()
