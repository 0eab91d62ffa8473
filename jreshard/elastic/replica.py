"""ElasticReplica: one inference replica that joins a trainer, receives versions, serves peers, and leaves.

A replica is the processes of one inference engine (one jax cluster, one
mesh): each process constructs an :class:`ElasticReplica` with the same name
and has its own connection to the trainer, which admits the replica once
every process has said hello and drops all of it when one process goes.

In each process a background thread owns the sockets: the connection to the
trainer (pushes and catch-ups arrive there), and a listener where the
processes of a joining replica fetch the version this one holds. Every
connection, to the trainer and between replicas, is authenticated both ways
with the shared secret before anything is read (:mod:`jreshard.net.auth`); the
bytes of every version move over NIXL (:mod:`jreshard.nixl`). Each version
lands in fresh buffers, is *staged*, and is *committed* (swapped in under a
lock) only when the trainer says every process of the replica staged it, so
:meth:`ElasticReplica.pull` never returns a half-updated tree, in any process.
The trainer's end is noticed at once (its connection closes); a pull then
returns the last version held, and raises once it has nothing newer.

Publication. A replica hands out only the trainer's latest committed version
(:class:`~jreshard.elastic.types.Publication`): one that joins, re-joins, or
recovers with weights it held before (``held=``) is ``syncing`` until it has
committed the version the trainer holds, and one the trainer dropped, or whose
trainer vanished without a word, is ``stale``; :meth:`ElasticReplica.pull` hands
out neither unless asked (``allow_stale=True``).
"""

from __future__ import annotations

import math
import select
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from jreshard.elastic.delta import ReplicaBases
from jreshard.elastic.pairs import (
    check_like,
    leaves_by_name,
    pair_plan,
    run_pair,
    same_form,
    source_shards,
    target_devices,
)
from jreshard.elastic.service import stop_service
from jreshard.elastic.types import Arrival, Publication
from jreshard.engine.buffers import CpuBuffers
from jreshard.engine.driver import landed_array
from jreshard.engine.put import batched_put, put_allowed
from jreshard.errors import JReshardError, LayoutMismatchError, PeerError, TransferTimeoutError
from jreshard.net.auth import resolve_secret
from jreshard.net.channel import Channel, connect, listen, make_room, parse_address, peer_int
from jreshard.options import Options, wait_s
from jreshard.refit.background import check_cpus, check_nice, lower_priority, start_on
from jreshard.refit.decl import declare_local, problems
from jreshard.types import PyTree

__all__ = ["ElasticReplica"]


class ElasticReplica:
    """One process of a replica that joins the trainer at ``address`` (every process of the replica makes one).

    Args:
      like: this replica's declaration: a pytree of ``jax.ShapeDtypeStruct`` (or arrays) with
        shardings over the replica's mesh. Pulled trees have its structure, dtypes and shardings. A
        leaf's dtype may differ from the trainer's (a cast: float32 trainer, bfloat16 replica, the bits
        of ``x.astype(bfloat16)``, cast where the wire is narrower).
      address: ``"HOST:PORT"`` of the trainer (``ElasticTrainer.address``), or a file that holds it.
      name: a name unique among live replicas (default: ``replica-<id>``, given by the trainer);
        required, and the same in every process, when the replica has several processes.
      devices: the jax devices this process drives (default ``jax.local_devices()``).
      options: chunking, staging, ``timeout_s`` (connecting, every wait on a peer) and ``secret``
        (default ``$JRESHARD_SECRET`` or ``$JRESHARD_SECRET_FILE``): the trainer's key.
      links: link speeds for the cost model (as the trainer's).
      host: this host's address where this process serves catch-ups to joining replicas (default:
        the address of the interface that reaches the trainer); NIXL's UCX listens on its interface only.
      recipe: how this replica's tensors are made from the trainer's, as a :class:`jreshard.RefitGroup`
        destination's: a pytree with the structure of ``like``, each leaf a view over
        :func:`jreshard.views.param` leaves naming the trainer's parameters (fused ``qkv`` with
        repeated key/value heads, stacked experts, block FP8) or ``None`` (the trainer's leaf of that
        name, cast to this leaf's dtype). The same in every process of the replica.
      held: ``(tree, version)``: weights this process holds from before (a server restarted with its
        last weights, or joining again after its trainer went away), shaped like ``like``. They are
        handed out only with ``pull(allow_stale=True)`` until the trainer's latest version is committed.
      nice: added to the nice value of this process's service thread, where every version lands (0 to
        19; Linux, that thread only, as :meth:`jreshard.RefitGroup.pull_async`): where cores are short,
        the server's own steps go first. 0 keeps the caller's priority.
      cpus: the cores of this process's service thread (a set of core numbers; Linux, that thread only, as
        :meth:`jreshard.RefitGroup.pull_async`), e.g. cores the server's steps do not use; ``None`` keeps the
        caller's.

    Raises:
      LayoutMismatchError: the trainer refused the declaration (every problem listed: names, shapes,
        dtypes that cannot cast, parameters a recipe reads that the trainer does not declare).
      AuthenticationError: the trainer refused this side's key, or did not prove it holds it.
      TransferTimeoutError: no trainer answered within ``timeout_s``.
      ValueError: no secret is set, ``recipe`` does not have the structure of ``like``, ``nice`` is not
        an int in 0..19, or ``cpus`` is not a non-empty set of cores the OS lets this process run on.
    """

    def __init__(
        self,
        like: PyTree,
        address: str,
        *,
        name: str | None = None,
        devices: Sequence[Any] | None = None,
        options: Options | None = None,
        links: dict[str, float] | None = None,
        host: str | None = None,
        recipe: PyTree = None,
        held: tuple[Any, int] | None = None,
        nice: int = 10,
        cpus: Iterable[int] | None = None,
    ):
        import jax

        from jreshard.call.routes import kit

        NixlAgent, import_nixl = kit("nixl").agent, kit("nixl").import_nixl

        if options is not None and not isinstance(options, Options):
            raise TypeError(f"ElasticReplica: options={options!r} must be a jreshard.Options")
        if name is not None and (not isinstance(name, str) or not name or len(name) > 256):
            raise ValueError(
                f"ElasticReplica: name={name!r:.80} must be a non-empty str of at most 256 characters, or None"
            )
        self._index, self._processes = jax.process_index(), jax.process_count()
        if self._processes > 1 and name is None:
            raise ValueError(
                f"ElasticReplica: this replica has {self._processes} processes; pass the same name=... in each"
            )
        self._nice = check_nice(nice, "ElasticReplica")
        self._cpus = check_cpus(cpus, "ElasticReplica")
        self.options = options or Options()
        self._key = resolve_secret(self.options.secret, who="ElasticReplica")
        timeout = self.options.timeout_s
        self._links = dict(links or {})
        self._deltas = ReplicaBases(self.options)  # the chunks of the version it holds, for delta refits
        self._devices = list(jax.local_devices() if devices is None else devices)
        self._decl = declare_local("destination", like, self._devices, None, recipe)
        if self._decl["errors"]:
            raise ValueError("ElasticReplica: " + "; ".join(self._decl["errors"]))
        self._like = leaves_by_name(like)
        self._treedef = jax.tree_util.tree_structure(like)
        if held is not None:  # checked before anything connects
            if not (isinstance(held, tuple) and len(held) == 2 and isinstance(held[1], int)):
                what = f"a tuple with version {held[1]!r}" if isinstance(held, tuple) else type(held).__name__
                raise ValueError(f"ElasticReplica: held must be (tree, version: int), not {what}")
            check_like(held[0], self._decl, "destination", self._devices, "ElasticReplica: held")
        import_nixl()  # NIXL present before anyone connects; the agent is made for the interface below
        ch = connect(parse_address(address, timeout_s=timeout), "the trainer", key=self._key, timeout_s=timeout)
        try:
            bind = ch.sock.getsockname()[0] if host is None else host
            self._listener = listen(bind, 0)
        except ValueError:
            ch.close()
            raise
        try:
            NixlAgent.shared(bind)  # UCX on the interface that reaches the trainer (or host's)
            port = self._listener.getsockname()[1]
            hello = {
                "op": "hello",
                "name": name,
                "decl": self._decl,
                "peer_address": [bind, port],
                "delta": self._deltas.on,
            }
            ch.send_control(hello | {"process": self._index, "processes": self._processes}, timeout_s=timeout)
            msg = ch.recv_control(timeout_s=timeout)
        except JReshardError:
            ch.close()
            self._listener.close()
            raise
        if msg.get("op") != "welcome":
            ch.close()
            self._listener.close()
            errors = msg.get("errors", [repr(msg)])
            raise LayoutMismatchError(
                f"ElasticReplica {name or ''}: the trainer refused to admit it ({problems(len(errors))}; "
                "nothing moved):\n  " + "\n  ".join(errors),
                what="declaration",
            )
        self.id: int = msg["id"]
        self.name: str = msg["name"]
        self._trainer = ch
        self._trainer_decls: list[dict] = msg.get("trainer_decls") or [msg["decl"]]  # one per trainer process
        self._decls: list[dict] = msg["decls"]  # every process of this replica, in process order
        self._sources = {0: ch}  # a connection to each trainer process (process 0's is the trainer's)
        try:
            for p, (host, port) in enumerate(msg.get("followers", []), start=1):
                f = connect((str(host), int(port)), f"the trainer's process {p}", key=self._key, timeout_s=timeout)
                self._sources[p] = f
                f.send_control(
                    {"op": "attach", "id": self.id, "name": self.name, "process": self._index}, timeout_s=timeout
                )
        except JReshardError:
            for c in self._sources.values():
                c.close()
            self._listener.close()
            raise
        self._staged: tuple[int, Any, list[tuple[str, Any]], Arrival] | None = None
        self._cv = threading.Condition()
        self._tree: PyTree = None if held is None else held[0]
        self._held: list[tuple[str, Any]] = [] if held is None else leaves_by_name(held[0])
        self._version: int | None = None if held is None else held[1]
        latest = msg.get("version")
        self._latest: int | None = latest if isinstance(latest, int) else None  # the trainer's, as told
        self._synced = False  # committed a version from this trainer
        self._bye = False  # the trainer closed cleanly: its last version is final
        self.arrivals: list[Arrival] = []
        self._gone: str | None = None
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name=f"jreshard-elastic-{self.name}", daemon=True)
        start_on(self._thread, self._cpus)

    @property
    def version(self) -> int | None:
        """The version this replica holds (committed), ``None`` before the first."""
        with self._cv:
            return self._version

    @property
    def publication(self) -> Publication:
        """``syncing``, ``current`` or ``stale`` (:class:`~jreshard.elastic.types.Publication`): whether the
        weights held may be handed out; a server refuses traffic unless ``current``."""
        with self._cv:
            return self._publication()

    def _publication(self) -> Publication:
        ahead = self._latest is not None and (self._version is None or self._version < self._latest)
        if self._gone is not None:
            final = self._bye and self._synced and not ahead
            return Publication.CURRENT if final else Publication.STALE
        return Publication.CURRENT if self._synced and not ahead else Publication.SYNCING

    def ready(self, *, newer_than: int | None = None) -> bool:
        """Whether :meth:`pull` would return at once with a current version newer than ``newer_than``:
        a server asks between two steps, then flips with ``pull``."""
        with self._cv:
            fresh = self._version is not None and (newer_than is None or self._version > newer_than)
            return fresh and self._publication() is Publication.CURRENT

    def pull(
        self, *, newer_than: int | None = None, timeout_s: float | None = None, allow_stale: bool = False
    ) -> tuple[Any, int]:
        """The latest committed ``(tree, version)``, once current; waits for one newer than ``newer_than``.

        The version held is handed out only when :attr:`publication` is ``current``: a replica that is
        syncing (joining, or recovered with ``held=`` weights) waits for the trainer's latest version, one
        that is stale raises. The call is the flip: the tree returned is whole, and stays so.

        Args:
          newer_than: wait for a version newer than this.
          timeout_s: how long to wait (default ``options.timeout_s``).
          allow_stale: hand out what is held even when it is not current (syncing or stale).

        Raises:
          PeerError: the replica is stale (the trainer is gone without closing, or dropped it, or it left)
            and nothing newer is held; or the trainer closed and nothing newer is held.
          TransferTimeoutError: nothing newer, or nothing current, within ``timeout_s``.
        """
        timeout = wait_s(timeout_s, self.options.timeout_s, "ElasticReplica.pull")

        def fresh() -> bool:
            return self._version is not None and (newer_than is None or self._version > newer_than)

        def good() -> bool:
            return fresh() and (allow_stale or self._publication() is Publication.CURRENT)

        with self._cv:
            self._cv.wait_for(lambda: good() or self._gone is not None, timeout)
            if good():
                return self._tree, self._version  # type: ignore[return-value]
            state = self._publication().value
            if self._gone is not None:
                raise PeerError(
                    f"replica {self.name!r}: {self._gone}; it holds version {self._version} ({state}"
                    + (", pull(allow_stale=True) hands it out)" if fresh() else ")")
                )
            raise TransferTimeoutError(
                f"replica {self.name!r}: no version newer than {newer_than} within timeout_s={timeout} "
                f"(it holds {self._version}, {state}; the trainer's latest is {self._latest})"
            )

    def leave(self) -> None:
        """Leave at once: the trainer drops this replica from its next push; the held tree stays usable."""
        stop_service(self._cv, self, self.options.timeout_s)

    close = leave

    def __enter__(self) -> ElasticReplica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    # ---- the service thread ---------------------------------------------------------------------
    def _serve(self) -> None:
        lower_priority(self._nice)  # every version lands here, beside the server's own steps
        pending: list[tuple[Channel, float]] = []
        fetches: dict[tuple[str, int], tuple[dict[int, Channel], float]] = {}
        try:
            while True:
                with self._cv:
                    if self._stop:
                        break
                live = [] if self._gone else [self._trainer]
                waits: list[Any] = [self._listener, self._wake_r, *live, *(c for c, _ in pending)]
                ready, _, _ = select.select(waits, [], [], 0.05)
                if self._wake_r in ready:
                    self._wake_r.recv(4096)
                if self._listener in ready:
                    try:
                        sock, _ = self._listener.accept()
                    except OSError:  # nothing waiting after all, or out of descriptors: the next poll
                        sock = None
                    if sock is not None:
                        ch = Channel.server(sock, "a joining peer", key=self._key)
                        victim = make_room(pending, ch)
                        if victim is not None:
                            pending.remove(victim)
                        pending.append((ch, time.monotonic() + self.options.timeout_s))
                self._peers(pending, fetches)
                if live:
                    self._from_trainer()
        except Exception as err:  # a bug, not a peer: pulls raise with it
            self._set_gone(f"its service thread failed ({type(err).__name__}: {err})")
        finally:
            with self._cv:
                self._stop = True
            if self._gone is None:
                try:
                    self._trainer.send_control({"op": "leave"}, timeout_s=1.0)
                except JReshardError:
                    pass
                self._set_gone("it left")
            for c in self._sources.values():
                c.close()
            self._listener.close()
            for ch in [c for c, _ in pending] + [c for g, _ in fetches.values() for c in g.values()]:
                ch.close()
            self._wake_r.close()
            self._wake_w.close()

    def _set_gone(self, why: str) -> None:
        with self._cv:
            self._gone = self._gone or why
            self._cv.notify_all()

    def _from_trainer(self) -> None:
        ch = self._trainer
        try:
            ch.pump()
        except JReshardError as err:
            self._set_gone(f"the connection to the trainer broke ({err})")
            return
        while self._gone is None and (msg := ch.pop()) is not None:
            op, v = msg.get("op"), msg.get("version")
            if op in ("refit", "catchup", "commit") and not peer_int(v):
                self._set_gone(f"the trainer sent a malformed message {msg!r}: not a jreshard trainer?")
                ch.close()
                return
            version = int(v or 0)
            if op == "catchup":  # the trainer's latest committed version: syncing until it is committed here
                with self._cv:
                    self._latest = max(version, self._latest or 0)
            try:
                if op == "bye":
                    with self._cv:
                        self._bye = True
                    self._set_gone("the trainer closed")
                elif op == "commit":
                    self._commit(version)
                elif op in ("refit", "catchup") and msg.get("from") != "peer":
                    delta = msg.get("delta") is True
                    self._receive(self._sources, self._trainer_decls, version, "trainer", peer=False, delta=delta)
                elif op == "catchup":
                    try:
                        self._fetch(msg, version, f"replica {msg.get('peer')!r}")
                    except JReshardError as err:
                        ch.send_control({"op": "failed", "version": v, "error": str(err)}, timeout_s=1.0)
                    except (KeyError, TypeError, ValueError, IndexError) as err:  # the trainer serves it instead
                        why = f"a malformed catch-up from a peer ({type(err).__name__}: {err})"
                        ch.send_control({"op": "failed", "version": v, "error": why}, timeout_s=1.0)
            except JReshardError as err:
                try:  # tell the trainer why, then close: it drops this replica at once
                    ch.send_control({"op": "failed", "version": v, "error": str(err)}, timeout_s=1.0)
                except JReshardError:
                    pass
                ch.close()
                self._set_gone(f"version {v} failed ({err}); this replica left the trainer")
        if ch.eof and self._gone is None:
            self._set_gone("the trainer's connection closed (it exited or was killed, or dropped this replica)")

    def _fetch(self, msg: dict, version: int, source: str) -> None:
        """Catch up from the peer replica named in ``msg`` (a connection to each of its processes)."""
        timeout = self.options.timeout_s
        if not same_form(msg["decls"], self._decls):  # the trainer then serves it
            raise PeerError(f"{source} holds other tensors than this replica declares (another like or recipe)")
        peers: dict[int, Channel] = {}
        try:
            for i, (host, port) in enumerate(msg["addresses"]):
                where = (str(host), int(port))
                peers[i] = connect(where, source, key=self._key, timeout_s=timeout, retry=False)
            fetch = {"op": "fetch", "name": self.name, "decls": self._decls, "version": version}
            for ch in peers.values():
                ch.send_control(fetch | {"process": self._index}, timeout_s=timeout)
            for ch in peers.values():
                answer = ch.recv_control(timeout_s=timeout)
                if answer.get("op") != "serving":
                    raise PeerError(f"{source} did not serve version {version}: {answer.get('error', answer)}")
            self._receive(peers, msg["decls"], version, source, peer=True)
        finally:
            for ch in peers.values():
                ch.close()

    def _receive(
        self, chs: dict[int, Channel], src_decls: list, version: int, source: str, *, peer: bool, delta: bool = False
    ) -> None:
        """Run this process's destination side of a refit from ``src_decls`` (the trainer's, or a peer's of
        this replica's form: ``peer``); stage it and say so."""
        import jax

        t0, c0 = time.monotonic(), time.thread_time()
        pair = pair_plan(src_decls, self._decls, self.options, self._links, peer=peer)
        targets = target_devices(pair, self._like, self._devices, self._index)
        costs: list = []
        refit = self._deltas.refit(delta and not peer, 1)  # the unit comes with each chunk
        # each leaf made at once over the buffers its shards landed in (plain arrays and views alike)
        shards, _ = run_pair(
            pair, pair.n_src + self._index, chs, shards=targets, options=self.options, costs=costs, delta=refit
        )
        self._deltas.staged(version)
        index = {n: t for t, n in enumerate(pair.dst_names)}
        base = pair.bases[pair.n_src + self._index]
        ranks = {d: base + i for i, d in enumerate(self._devices)}
        put = batched_put(put_allowed())
        leaves, nbytes = [], 0
        for name, a in self._like:
            t = index[name]
            weak = bool(getattr(a, "weak_type", False))  # the like's (a ShapeDtypeStruct's or an array's) type
            keys = [(t, ranks[d]) for d in a.sharding.addressable_devices]
            nbytes += sum(math.prod(shards[k][1]) * shards[k][2].itemsize for k in keys)
            made = landed_array(t, tuple(a.shape), a.dtype, a.sharding, shards, CpuBuffers(), put, weak, ranks)
            leaves.append((name, made))
        tree = jax.tree_util.tree_unflatten(self._treedef, [x for _, x in leaves])
        arrival = Arrival(version, source, time.monotonic() - t0, nbytes, time.thread_time() - c0,
                          costs[0] if costs else None)  # fmt: skip
        self._staged = (version, tree, leaves, arrival)
        self._trainer.send_control({"op": "have", "version": version}, timeout_s=self.options.timeout_s)

    def _commit(self, version: int) -> None:
        """Swap in the staged version: every process of this replica holds it (the trainer said so)."""
        if self._staged is None or self._staged[0] != version:
            raise PeerError(f"the trainer committed version {version}, which replica {self.name!r} did not stage")
        _, tree, leaves, arrival = self._staged
        self._staged = None
        with self._cv:
            self._tree, self._held, self._version = tree, leaves, version
            self._latest, self._synced = max(version, self._latest or 0), True
            self.arrivals.append(arrival)
            self._cv.notify_all()
        self._deltas.committed(version)
        at = {"op": "at", "version": version, "source": arrival.source, "base": self._deltas.version}
        self._trainer.send_control(at, timeout_s=self.options.timeout_s)

    def _peers(self, pending: list[tuple[Channel, float]], fetches: dict) -> None:
        """Read joining peers' fetches; serve a joiner once each of its processes has asked."""
        now = time.monotonic()
        for ch, deadline in list(pending):
            try:
                ch.pump()  # the handshake first (a refusal is logged by the channel)
            except JReshardError:
                ch.close()
            if not (ch.inbox or ch.eof or now > deadline):
                continue
            pending.remove((ch, deadline))
            msg = ch.inbox.popleft() if ch.inbox else {}
            decls, version, process = msg.get("decls"), msg.get("version", -1), msg.get("process", 0)
            if (
                msg.get("op") != "fetch"
                or not isinstance(decls, list)
                or not decls
                or not peer_int(version)
                or not peer_int(process)
                or not 0 <= process < len(decls)
            ):  # not a joiner's fetch: this connection only
                ch.close()
                continue
            key = (str(msg.get("name")), version)
            group = fetches.setdefault(key, ({}, deadline))[0]
            group[process] = ch
            if len(group) == len(msg["decls"]):
                del fetches[key]
                self._serve_peer(group, msg)
                for c in group.values():
                    c.close()
        for key, (group, deadline) in list(fetches.items()):
            if now > deadline:  # not every process of the joiner asked: it reports the failure
                del fetches[key]
                for c in group.values():
                    c.close()

    def _serve_peer(self, group: dict[int, Channel], msg: dict) -> None:
        """Send the version this process holds to each process of a joining replica (errors end only this)."""
        timeout = self.options.timeout_s
        try:
            for ch in group.values():
                ch.peer = f"replica {msg.get('name')!r}"
            with self._cv:
                version, held = self._version, self._held
            refused = f"it holds version {version}" if version != msg.get("version") else ""
            if not refused and not same_form(self._decls, msg["decls"]):
                refused = "it holds other tensors than the joiner declares (another like or recipe)"
            if refused:
                for ch in group.values():
                    ch.send_control({"op": "refuse", "error": refused}, timeout_s=timeout)
                return
            check_like(self._tree, self._decl, "destination", self._devices, f"replica {self.name!r}")
            for ch in group.values():
                ch.send_control({"op": "serving", "version": version}, timeout_s=timeout)
            pair = pair_plan(self._decls, msg["decls"], self.options, self._links, peer=True)
            chs = {pair.n_src + j: ch for j, ch in group.items()}
            shards = source_shards(pair, held, self._devices, self._index)
            run_pair(pair, self._index, chs, shards=shards, options=self.options)
        except Exception:  # e.g. the held arrays were deleted: ends these connections only
            pass  # the joiner reports its failure to the trainer, which serves it another way
