"""ProcessGroup: the processes of two separately launched programs, joined over authenticated TCP.

What ``RefitGroup`` needs from MPI, without an MPI universe: every process connected to every
other, small objects exchanged all-to-all with a deadline, and a transport for the weights
(:class:`~jreshard.nixl.comm.NixlComm` over the same connections).

**Rendezvous.** Process 0 of the source side listens at the group's address (``"HOST:PORT"`` it
binds, or a file it writes its address to). Every other process connects to it, authenticates
(:mod:`jreshard.net.auth`; a wrong key, garbage or silence is refused and does not stop the
rendezvous), and says its role, its index in its side, its side's size and where it listens. Once
every process of both sides has joined, process 0 sends each the table: processes are numbered
sources first, then destinations, each side in index order. Then every pair of processes that is
not yet connected connects (the higher number to the lower), so each process holds one
authenticated :class:`~jreshard.net.channel.Channel` to each other process.

**Control.** :meth:`ProcessGroup.allgather` has the contract of the MPI control plane's
(:class:`jreshard.mpi.control.Control`): every process calls the group's operations in the same
order, the n-th carries sequence number n, every wait is bounded, and a peer whose connection
closed (it exited, was killed, or closed the group) is :class:`PeerError` at once. Objects are
JSON (dicts with string keys, lists, numbers, strings).
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jreshard.errors import PeerError, TransferTimeoutError
from jreshard.net.channel import (
    MAX_PEER_PROCESSES,
    Channel,
    accept_first,
    connect,
    format_address,
    listen,
    parse_address,
    peer_int,
)
from jreshard.nixl.agent import NixlAgent
from jreshard.nixl.comm import NixlComm
from jreshard.types import ControlObject

__all__ = ["ProcessGroup"]

_ANY = ("0.0.0.0", "::", "")


def _join_of(msg: dict, n_src: int) -> tuple[tuple[str, int] | None, int, str, int]:
    """A joining process's ``(role, index)``, its count of its role's processes and its listener's host and port,
    from its ``join`` message; ``(None, ...)`` for one no process of this group sends (its role is not one, its
    index, count or port are not ints in range: a count of a billion would have the coordinator wait for a
    billion processes)."""
    try:
        role, index, count, (host, port) = msg["role"], msg["index"], msg["count"], msg["at"]
    except (KeyError, TypeError, ValueError):
        return None, 0, "", 0
    if role not in ("source", "destination") or not isinstance(host, str) or not peer_int(port, 1, 65535):
        return None, 0, "", 0
    if not peer_int(count, 1, MAX_PEER_PROCESSES):
        return None, 0, "", 0
    first, last = (1, n_src - 1) if role == "source" else (0, count - 1)  # source 0 is the coordinator itself
    if not peer_int(index, first, last):
        return None, 0, "", 0
    return (role, index), count, host, port


def _address(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if sep and host and port.isdigit() and os.path.sep not in address:
        return parse_address(address, timeout_s=0.0)
    return None


class ProcessGroup:
    """Every process of a source program and a destination program, pairwise connected (final).

    Build it with :meth:`join`, in every process of both programs.

    Attributes:
      rank: this process's number (sources first).
      size: the number of processes of both programs.
      roles: ``{process: "source" | "destination"}``.
    """

    def __init__(self, rank: int, roles: Mapping[int, str], channels: Mapping[int, Channel], listener: socket.socket):
        self.rank = rank
        self.size = len(roles)
        self.roles = dict(roles)
        self._channels = dict(channels)
        self._listener = listener
        self._seq = 0
        self._stash: dict[tuple[int, int], Any] = {}  # (process, seq) -> an answer that came early
        self._closed: set[int] = set()
        self.describe: Callable[[int], str] = lambda p: f"process {p} ({self.roles.get(p, '?')})"

    @classmethod
    def join(
        cls,
        role: str,
        address: str,
        *,
        index: int,
        count: int,
        key: bytes | None,
        timeout_s: float,
        host: str = "127.0.0.1",
    ) -> ProcessGroup:
        """Join the group that meets at ``address`` (see the module docstring).

        Args:
          role: ``"source"`` or ``"destination"``.
          address: ``"HOST:PORT"`` (the source's process 0 binds it, the others connect), or a file
            path both programs can reach (process 0 binds ``host`` and writes its address there).
          index, count: this process's index in its program and the program's process count.
          key: the shared secret; ``None`` with a file ``address``: process 0 draws a fresh key and
            writes it into the file beside its address (readable by its owner only), so whoever can
            read the file can join (the MPI transport's rendezvous, where no secret is configured).
          timeout_s: the deadline for the whole rendezvous.
          host: this host's address to listen on: process 0's, when ``address`` is a file; every other
            process's listener for its peers, where the default (loopback) and ``"0.0.0.0"`` mean
            the interface that reaches process 0.

        Raises:
          TransferTimeoutError: not every process joined within ``timeout_s``; or the address file
            names an address where nothing listens (a stale file, left by a process 0 that is gone)
            and no fresh one replaced it within ``timeout_s`` (the message says so).
          AuthenticationError: a peer does not hold the key.
          ValueError: ``role``, ``index`` or ``count`` are inconsistent.
        """
        if role not in ("source", "destination"):
            raise ValueError(f"ProcessGroup.join: role={role!r} must be 'source' or 'destination'")
        if not (isinstance(count, int) and count >= 1 and isinstance(index, int) and 0 <= index < count):
            raise ValueError(f"ProcessGroup.join: index={index!r}, count={count!r} must satisfy 0 <= index < count")
        deadline = time.monotonic() + timeout_s
        given = _address(address)
        if key is None and given is not None:
            raise ValueError("ProcessGroup.join: key=None needs a file address (the key is written there)")
        if role == "source" and index == 0:
            listener = listen(*(given or (host, 0)))
            if given is None:
                bound = format_address(host, listener.getsockname()[1])
                if key is None:
                    key = secrets.token_bytes(32)
                    bound += "\n" + key.hex()
                fd = os.open(address + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(bound)
                os.replace(address + ".tmp", address)
            try:
                assert key is not None
                return cls._coordinate(listener, count, key, deadline, timeout_s)
            finally:
                if given is None and os.path.exists(address):
                    os.remove(address)
        if given is not None:
            assert key is not None
            ch = connect(given, "process 0 (source)", key=key, timeout_s=max(0.05, deadline - time.monotonic()))
        else:
            ch, key = _connect_file(address, key, deadline, timeout_s)
        try:
            mine = ch.sock.getsockname()[0] if host in _ANY or host == "127.0.0.1" else host
            listener = listen(mine, 0)
            at = [mine, listener.getsockname()[1]]
            hello = {"op": "join", "role": role, "index": index, "count": count, "at": at}
            ch.send_control(hello, timeout_s=timeout_s)
            table = _wait_op(ch, "table", deadline, timeout_s)
        except BaseException:
            ch.close()
            raise
        return cls._mesh(table, ch, listener, key, deadline, timeout_s)

    @classmethod
    def _coordinate(
        cls, listener: socket.socket, n_src: int, key: bytes, deadline: float, timeout_s: float
    ) -> ProcessGroup:
        """Process 0: admit every other process, then send the table."""
        pending: list[Channel] = []
        joined: dict[tuple[str, int], tuple[Channel, dict]] = {}
        n_dst: int | None = None
        while True:
            need_src = {("source", i) for i in range(1, n_src)}
            need_dst = {("destination", i) for i in range(n_dst)} if n_dst is not None else {("destination", 0)}
            if (need_src | need_dst) <= set(joined):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted((need_src | need_dst) - set(joined))
                for c in pending + [c for c, _ in joined.values()]:
                    c.close()
                listener.close()
                raise TransferTimeoutError(
                    f"ProcessGroup: processes {missing} (role, index) did not join within {timeout_s:.3g} s"
                )
            # the handshake first; a refused client is logged and dropped
            for c, msg in accept_first(listener, pending, key=key, who="a joining process", wait_s=min(left, 0.05)):
                who, count, host, port = _join_of(msg, n_src)
                if who is None or (who[0] == "destination" and n_dst is not None and count != n_dst):
                    c.close()  # not a process of this group (or one that counts the destinations otherwise)
                    continue
                if host in _ANY:
                    host = c.sock.getpeername()[0]
                if who[0] == "destination":
                    n_dst = n_dst or count
                joined[who] = (c, {"at": [host, port]})
        for c in pending:  # still authenticating or silent: not part of the group
            c.close()
        order = [("source", 0)] + [("source", i) for i in range(1, n_src)]
        order += [("destination", i) for i in range(n_dst or 0)]
        table = [[r, i, *(joined[(r, i)][1]["at"] if (r, i) in joined else ["", 0])] for r, i in order]
        channels = {}
        for p, who in enumerate(order[1:], start=1):
            c = joined[who][0]
            c.peer = f"process {p} ({who[0]})"
            c.send_control({"op": "table", "table": table, "you": p}, timeout_s=timeout_s)
            channels[p] = c
        roles = {p: r for p, (r, _) in enumerate(order)}
        return cls(0, roles, channels, listener)

    @classmethod
    def _mesh(cls, msg: dict, to_zero: Channel, listener: socket.socket, key: bytes, deadline: float, timeout_s: float):
        """Connect to every lower-numbered process but 0, and accept every higher one."""
        table, me = msg["table"], int(msg["you"])
        roles = {p: str(row[0]) for p, row in enumerate(table)}
        to_zero.peer = "process 0 (source)"
        channels = {0: to_zero}
        try:
            for q in range(1, me):
                host, port = str(table[q][2]), int(table[q][3])
                left = max(0.05, deadline - time.monotonic())
                c = connect((host, port), f"process {q} ({roles[q]})", key=key, timeout_s=left)
                c.send_control({"op": "mesh", "process": me}, timeout_s=timeout_s)
                channels[q] = c
            pending: list[Channel] = []
            while len(channels) < len(table) - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(me + 1, len(table))) - set(channels))
                    raise TransferTimeoutError(
                        f"ProcessGroup: processes {missing} did not connect to process {me} within {timeout_s:.3g} s"
                    )
                for c, m in accept_first(listener, pending, key=key, who="a peer process", wait_s=min(left, 0.05)):
                    said = m.get("process")
                    if m.get("op") != "mesh" or not isinstance(said, int) or not me < said < len(table):
                        c.close()
                        continue
                    if said in channels:
                        c.close()
                        continue
                    c.peer = f"process {said} ({roles[said]})"
                    channels[said] = c
            for c in pending:  # still authenticating or silent: not part of the group
                c.close()
        except BaseException:
            for c in channels.values():
                c.close()
            listener.close()
            raise
        return cls(me, roles, channels, listener)

    def channel(self, process: int) -> Channel:
        """The connection to ``process``."""
        return self._channels[process]

    def communicator(self, rank_process: Mapping[int, int], *, timeout_s: float, encrypt: bool = False) -> NixlComm:
        """The weights' transport: a :class:`NixlComm` over this group's connections (``encrypt``: as its)."""
        local = [r for r, p in rank_process.items() if p == self.rank]
        remote = {r: self._channels[p] for r, p in rank_process.items() if p != self.rank}
        agent = NixlAgent.shared(self._listener.getsockname()[0])  # UCX on the interface the group meets on
        return NixlComm(agent, local, remote, timeout_s=timeout_s, encrypt=encrypt)

    def allgather(
        self,
        obj: ControlObject,
        *,
        timeout_s: float,
        peers: Sequence[int] | None = None,
        stop: Callable[[int, Any], bool] | None = None,
    ) -> dict[int, Any]:
        """Send ``obj`` to every process of ``peers`` (default: all) and collect theirs.

        Args:
          obj: a small JSON-serializable object.
          timeout_s: the longest wait for any peer.
          peers: the processes taking part; this process must be one of them.
          stop: called as ``stop(process, obj)`` on each arrival; true ends the wait early.

        Returns:
          ``{process: obj}``, this process included.

        Raises:
          TransferTimeoutError: a peer did not answer within ``timeout_s`` (named).
          PeerError: a peer's connection closed before it answered.
        """
        group = list(range(self.size)) if peers is None else sorted(set(peers))
        if self.rank not in group:
            raise ValueError(f"ProcessGroup.allgather: process {self.rank} is not among peers={group}")
        seq = self._seq
        self._seq += 1
        others = [p for p in group if p != self.rank]
        for p in others:
            if p in self._closed:
                continue
            try:
                self._channels[p].send_control({"op": "ctl", "seq": seq, "obj": obj}, timeout_s=timeout_s)
            except PeerError:
                self._closed.add(p)
        out: dict[int, Any] = {self.rank: obj}
        deadline = time.monotonic() + timeout_s
        waiting = set(others)
        while waiting:
            for p in sorted(waiting):
                ch = self._channels[p]
                try:
                    ch.pump()
                except PeerError:
                    self._closed.add(p)
                for m in ch.take({"ctl", "bye"}):
                    if m["op"] == "bye":
                        self._closed.add(p)
                    elif isinstance(m.get("seq"), int):
                        self._stash[(p, m["seq"])] = m.get("obj")
                if ch.eof:
                    self._closed.add(p)
                if (p, seq) in self._stash:
                    out[p] = self._stash.pop((p, seq))
                    waiting.discard(p)
                    if stop is not None and stop(p, out[p]):
                        return out
                elif p in self._closed:
                    raise PeerError(
                        f"{self.describe(p)} closed the group while this process waited on it",
                        destination_intact=True,
                    )
            if not waiting:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(
                    f"no answer within {timeout_s:.3g} s from "
                    f"{', '.join(self.describe(p) for p in sorted(waiting))}: it died or stopped answering"
                )
            select.select([self._channels[p] for p in waiting if not self._channels[p].eof], [], [], min(left, 0.01))
        return out

    def gone(self, processes: Sequence[int]) -> list[int]:
        """Those of ``processes`` whose connection closed (they exited, were killed, or closed the group),
        read without waiting: the liveness of every peer, beside whatever carries the weights."""
        out = []
        for p in sorted(set(processes) - {self.rank}):
            ch = self._channels[p]
            if p not in self._closed:
                try:
                    ch.pump()
                except PeerError:
                    self._closed.add(p)
                if ch.eof or any(m.get("op") == "bye" for m in ch.inbox):
                    self._closed.add(p)
            if p in self._closed:
                out.append(p)
        return out

    def notify_closed(self) -> None:
        """Tell every other process that this one is closing (best effort; never blocks long)."""
        for p, ch in self._channels.items():
            if p not in self._closed and not ch.eof:
                try:
                    ch.send_control({"op": "bye"}, timeout_s=0.5)
                except (PeerError, TransferTimeoutError):
                    pass

    def close(self) -> None:
        """Close every connection and the listener."""
        for ch in self._channels.values():
            ch.close()
        self._listener.close()


def _read_file(address: str, deadline: float, timeout_s: float) -> tuple[tuple[str, int], bytes | None]:
    """The address (and the key, when process 0 drew one) in the file ``address``, waited for."""
    while True:
        try:
            with open(address) as f:
                text = f.read()
            break
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"ProcessGroup: the address file {address!r} did not appear within {timeout_s:.3g} s "
                    "(the source side's process 0 writes it)"
                ) from None
            time.sleep(0.02)
    first, _, rest = text.strip().partition("\n")
    try:
        where = _address(first.strip())
        if where is None:
            raise ValueError("no HOST:PORT")
        return where, bytes.fromhex(rest.strip()) if rest.strip() else None
    except ValueError as err:
        raise ValueError(
            f"ProcessGroup: the address file {address!r} holds {text[:200]!r}, not an address (a file of an older "
            "jreshard, or not a rendezvous file): delete it and start the source side"
        ) from err


def _connect_file(address: str, key: bytes | None, deadline: float, timeout_s: float) -> tuple[Channel, bytes]:
    """Connect to process 0 at the address in the file ``address``. Nobody listening there means the file
    is stale (its writer is gone) or about to be replaced: it is read again until ``deadline``."""
    stale = None
    while True:
        where, drawn = _read_file(address, deadline, timeout_s)
        mine = key if key is not None else drawn
        if mine is None:
            raise ValueError(
                f"ProcessGroup: the address file {address!r} holds no key and none is configured: set the "
                "same Options(secret=...) or $JRESHARD_SECRET on both sides"
            )
        try:
            left = max(0.05, deadline - time.monotonic())
            return connect(where, "process 0 (source)", key=mine, timeout_s=left, retry=False), mine
        except PeerError as err:
            if not isinstance(err.__cause__, ConnectionRefusedError):
                raise
            stale = format_address(*where)
        if time.monotonic() > deadline:
            raise TransferTimeoutError(
                f"ProcessGroup: the address file {address!r} is stale: it names {stale}, where nothing listens "
                f"(the source that wrote it is gone), and no source replaced it within {timeout_s:.3g} s. "
                "Start the source side, or delete the file"
            )
        time.sleep(0.05)


def _wait_op(ch: Channel, op: str, deadline: float, timeout_s: float) -> dict:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"{ch.peer} sent no {op!r} within {timeout_s:.3g} s")
        msg = ch.recv_control(timeout_s=left)
        if msg.get("op") == op:
            return msg
