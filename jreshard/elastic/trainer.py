"""ElasticTrainer: serves versioned refits to inference replicas that join, leave and fail at any time.

The trainer listens on ``127.0.0.1:port``. A replica connects, sends its
declaration (names, shapes, dtypes, the boxes of its devices) and is checked
against the trainer's; a mismatch is refused with every problem listed. Each
replica has its own connection, so one replica joining, leaving or dying
touches no other. A background thread owns every socket: it admits joiners,
serves their catch-up, notices leaves and deaths (a closed connection is seen
at once), and runs the pushes handed to it by :meth:`ElasticTrainer.push`.

A push is one refit per replica (trainer -> that replica, its own plan): a
replica that fails or dies is dropped, named in the :class:`PushReport`, and
the others complete the version. A replica that joins while a version is
committed first catches up to it, from the trainer or from a replica that
holds it (:class:`CatchUp`); a push waits (up to ``timeout_s``) for catch-ups
in flight, so a joiner holds the latest version before the next one arrives.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jreshard.elastic.pairs import check_like, check_pair, leaves_by_name, pair_plan, run_pair, source_shards
from jreshard.elastic.types import CatchUp, PushReport, ReplicaInfo, ReplicaState
from jreshard.elastic.wire import Channel, listen
from jreshard.errors import JReshardError, PeerError, TransferError, TransferTimeoutError
from jreshard.options import Options
from jreshard.refit_decl import declare_local

__all__ = ["ElasticTrainer"]

_TIE = 0.01  # predicted times within 1% are a tie, and a tie goes to the peer (keeps the trainer's links free)


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


class ElasticTrainer:
    """The trainer side of elastic refit: one process that pushes versions to any number of replicas.

    Args:
      params: the parameter declaration: a pytree of ``jax.Array`` or
        ``jax.ShapeDtypeStruct`` with shardings on this process's devices.
      port: the loopback port to listen on (0: a free one; see :attr:`address`).
      address_file: if given, ``"127.0.0.1:PORT"`` is written there (atomically) for replicas to read.
      devices: the jax devices this process drives (default ``jax.local_devices()``).
      options: chunking, staging, and ``timeout_s``: the longest this process waits on any replica.
      catch_up: where joiners take the latest version from (:class:`CatchUp`).
      links: link speeds for the cost model (``Topology.from_domains`` keywords).

    Raises:
      ValueError: the declaration is malformed, or this is one process of several
        (elastic refit runs one process per side).
    """

    def __init__(
        self,
        params: Any,
        *,
        port: int = 0,
        address_file: str | None = None,
        devices: Sequence[Any] | None = None,
        options: Options | None = None,
        catch_up: CatchUp | str = CatchUp.AUTO,
        links: dict[str, float] | None = None,
    ):
        import jax

        if jax.process_count() > 1:
            raise ValueError(
                f"ElasticTrainer: this jax cluster has {jax.process_count()} processes; elastic refit runs one "
                "process per side (use RefitGroup for multi-process sides)"
            )
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"ElasticTrainer: options={options!r} must be a jreshard.Options")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"ElasticTrainer: port={port!r} must be an int in [0, 65535] (0: any free port)")
        self.options = options or Options()
        self.catch_up = CatchUp(catch_up)
        self._links = dict(links or {})
        self._devices = list(jax.local_devices() if devices is None else devices)
        self._decl = declare_local("source", params, self._devices, None)
        if self._decl["errors"]:
            raise ValueError("ElasticTrainer: " + "; ".join(self._decl["errors"]))
        self._listener = listen(port)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        if address_file is not None:
            with open(address_file + ".tmp", "w") as f:
                f.write(self.address)
            os.replace(address_file + ".tmp", address_file)
        self._cv = threading.Condition()
        self._members: dict[int, _Member] = {}
        self._gone: list[ReplicaInfo] = []
        self._pending: list[tuple[Channel, float]] = []
        self._jobs: collections.deque[tuple[Callable[[], Any], dict]] = collections.deque()
        self._committed: tuple[int, list[tuple[str, Any]]] | None = None
        self._next_id = 1
        self._stop = False
        self._fatal = "it was closed"
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="jreshard-elastic-trainer", daemon=True)
        self._thread.start()

    # ---- the caller's side ----------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The latest version pushed (``None`` before the first push)."""
        with self._cv:
            return None if self._committed is None else self._committed[0]

    def replicas(self, *, include_gone: bool = False) -> dict[str, ReplicaInfo]:
        """``{name: ReplicaInfo}`` of the live replicas (and, with ``include_gone``, the departed)."""
        with self._cv:
            live = {m.name: m.info() for m in self._members.values()}
            gone = {i.name: i for i in self._gone} if include_gone else {}
        return gone | live

    def push(self, params: Any, *, version: int, block: bool = True) -> PushReport | None:
        """Send ``params`` as ``version`` to every live replica (each on its own; failures are dropped).

        Args:
          params: a tree matching the declaration. Keep it alive (not donated) until the push is
            done; after it, it serves catch-ups until the next push (a deleted tree is not served:
            joiners then take the version from a replica).
          version: an int greater than the last one pushed.
          block: wait for the push to finish and return its report; with ``False`` return at once
            (use :meth:`wait` for "any k replicas at v").

        Raises:
          ValueError: ``params`` does not match the declaration, or ``version`` does not increase.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"ElasticTrainer.push: version={version!r} must be an int")
        check_like(params, self._decl, "source", self._devices, "ElasticTrainer.push")
        with self._cv:
            if self._stop:
                raise PeerError(f"ElasticTrainer.push: the trainer stopped serving ({self._fatal})")
            last = max([self._committed[0]] if self._committed else [], default=None)
            queued = [j[1]["version"] for j in self._jobs]
            if queued:
                last = queued[-1]
            if last is not None and version <= last:
                raise ValueError(f"ElasticTrainer.push: version={version} must be greater than {last}")
            box: dict = {"version": version, "done": False}
            leaves = leaves_by_name(params)
            self._jobs.append((lambda: self._push(version, leaves), box))
            self._wake_w.send(b"x")
        if not block:
            return None
        with self._cv:
            self._cv.wait_for(lambda: box["done"])
        if "error" in box:
            raise box["error"]
        return box["report"]

    def wait(self, *, version: int | None = None, count: int | None = None, timeout_s: float | None = None) -> tuple:
        """Wait until replicas hold ``version`` (or a later one); returns their names.

        Args:
          version: the version to wait for; ``None``: only membership (replicas connected).
          count: ``None``: every live replica, and at least one ("all at v"); ``k``: any ``k``.
          timeout_s: default ``options.timeout_s``.

        Raises:
          TransferTimeoutError: not reached in time; the message names the replicas and their versions.
        """
        if count is not None and (not isinstance(count, int) or count < 1):
            raise ValueError(f"ElasticTrainer.wait: count={count!r} must be None (all) or an int >= 1")
        timeout = self.options.timeout_s if timeout_s is None else timeout_s

        def at() -> list[str]:
            return [
                m.name
                for m in self._members.values()
                if version is None or (m.version is not None and m.version >= version)
            ]

        def ready() -> bool:
            names = at()
            if count is None:
                return bool(self._members) and len(names) == len(self._members)
            return len(names) >= count

        with self._cv:
            if not self._cv.wait_for(ready, timeout):
                have = {m.name: m.version for m in self._members.values()}
                want = "every replica" if count is None else f"{count} replicas"
                raise TransferTimeoutError(
                    f"ElasticTrainer.wait: {want} at version {version} not reached within timeout_s={timeout}; "
                    f"replicas and their versions: {have or 'none connected'}"
                )
            return tuple(sorted(at()))

    def close(self) -> None:
        """Tell every replica the trainer is done (their pulls return what they hold, then raise) and stop."""
        with self._cv:
            if self._stop:
                return
            self._stop = True
            self._wake_w.send(b"x")
        self._thread.join(self.options.timeout_s)

    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the service thread ---------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop and not self._jobs:
                        break
                    job = self._jobs.popleft() if self._jobs else None
                if job is None:
                    try:
                        self._poll(0.05)
                    except Exception as err:  # a bug, not a replica: stop serving and say so to the caller
                        self._fatal = f"{type(err).__name__}: {err}"
                        break
                    continue
                run, box = job
                try:
                    box["report"] = run()
                except Exception as err:  # handed to the caller of push
                    box["error"] = err
                with self._cv:
                    box["done"] = True
                    self._cv.notify_all()
        finally:
            with self._cv:
                self._stop = True
                for _, box in self._jobs:
                    box["error"], box["done"] = PeerError(f"the trainer stopped serving ({self._fatal})"), True
                self._jobs.clear()
                self._cv.notify_all()
            for m in list(self._members.values()):
                try:
                    m.channel.send_control({"op": "bye"}, timeout_s=1.0)
                except JReshardError:
                    pass
                self._drop(m, "the trainer closed")
            for ch, _ in self._pending:
                ch.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    def _poll(self, wait_s: float) -> None:
        """Admit joiners, read every replica's messages, notice closed connections."""
        chans = [ch for ch, _ in self._pending] + [m.channel for m in self._members.values()]
        ready, _, _ = select.select([self._listener, self._wake_r, *chans], [], [], wait_s)
        if self._wake_r in ready:
            self._wake_r.recv(4096)
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
        for m in list(self._members.values()):
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
        with self._cv:
            ident = self._next_id
            self._next_id += 1
            taken = {m.name for m in self._members.values()}
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
        with self._cv:  # a member before its welcome: a wait that returns after the replica's join counts it
            v = None if self._committed is None else self._committed[0]
            m.state = ReplicaState.JOINING if v is not None else ReplicaState.READY
            self._members[ident] = m
            self._cv.notify_all()
        try:
            welcome = {"op": "welcome", "id": ident, "name": name, "decl": self._decl, "version": v}
            ch.send_control(welcome, timeout_s=self.options.timeout_s)
        except JReshardError as err:
            self._drop(m, f"joining: {err}")
            return
        if v is not None:
            self._catch_up(m)

    def _trainer_can_serve(self) -> bool:
        return self._committed is not None and not any(a.is_deleted() for _, a in self._committed[1])

    def _catch_up(self, m: _Member, *, forbid_peer: bool = False) -> None:
        assert self._committed is not None
        v, leaves = self._committed
        peers = [
            p
            for p in self._members.values()
            if p is not m and p.state is ReplicaState.READY and p.version == v and not forbid_peer
        ]
        use_peer = bool(peers) and (self.catch_up is not CatchUp.TRAINER or not self._trainer_can_serve())
        if use_peer and self.catch_up is CatchUp.AUTO and self._trainer_can_serve():
            cost = {p.name: pair_plan(p.decl, m.decl, self.options, self._links).predicted_seconds() for p in peers}
            best = min(peers, key=lambda p: cost[p.name])
            mine = pair_plan(self._decl, m.decl, self.options, self._links).predicted_seconds()
            use_peer, peers = cost[best.name] <= mine * (1 + _TIE), [best]
        try:
            if use_peer:
                p = peers[0]
                m.via_peer = p.name
                m.channel.send_control(
                    {
                        "op": "catchup",
                        "version": v,
                        "from": "peer",
                        "peer": p.name,
                        "port": p.peer_port,
                        "decl": p.decl,
                    },
                    timeout_s=self.options.timeout_s,
                )
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
            with self._cv:
                if m.version is None:
                    m.caught_up_from = msg.get("source", "")
                m.version = int(msg["version"])
                m.state = ReplicaState.READY
                m.via_peer = ""
                self._cv.notify_all()
            if self._committed is not None and m.version < self._committed[0]:
                with self._cv:  # it caught up to a version pushed meanwhile: bring it to the latest
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
        with self._cv:
            if self._members.pop(m.id, None) is None:
                return
            m.state, m.error = ReplicaState.GONE, why
            self._gone = [*self._gone[-1023:], m.info()]  # the last 1024 departures
            self._cv.notify_all()
        m.channel.close()

    def _push(self, version: int, leaves: list[tuple[str, Any]]) -> PushReport:
        t0 = time.monotonic()
        deadline = t0 + self.options.timeout_s
        while any(m.state is ReplicaState.JOINING for m in self._members.values()) and time.monotonic() < deadline:
            self._poll(0.02)
        for m in [m for m in self._members.values() if m.state is ReplicaState.JOINING]:
            self._drop(m, f"did not catch up within timeout_s={self.options.timeout_s}")
        targets = list(self._members.values())
        for m in targets:
            try:
                m.channel.send_control({"op": "refit", "version": version}, timeout_s=self.options.timeout_s)
                self._send(m, leaves)
            except TransferError as err:
                self._drop(m, f"during version {version}: {err}")
            self._poll(0.0)  # register the replicas done so far ("any k at v" sees them early)
        with self._cv:
            self._committed = (version, leaves)
        sent = {m.id for m in targets}
        for m in [m for m in self._members.values() if m.id not in sent and m.state is ReplicaState.READY]:
            with self._cv:  # admitted during this push, already at an older version: bring it to this one
                m.state = ReplicaState.JOINING
            self._catch_up(m)
        deadline = time.monotonic() + self.options.timeout_s
        while time.monotonic() < deadline:
            missing = [m for m in targets if m.state is not ReplicaState.GONE and m.version != version]
            if not missing:
                break
            self._poll(0.02)
        for m in targets:
            if m.state is not ReplicaState.GONE and m.version != version:
                self._drop(m, f"did not report version {version} within timeout_s={self.options.timeout_s}")
        lost = {m.name: m.error for m in targets if m.state is ReplicaState.GONE}
        done = tuple(m.name for m in targets if m.state is not ReplicaState.GONE)
        return PushReport(version, done, lost, time.monotonic() - t0)
