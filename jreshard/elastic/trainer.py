"""ElasticTrainer: serves versioned refits to inference replicas that join, leave and fail at any time.

The trainer listens on ``host:port`` (any interface). A replica connects, proves
it holds the shared secret (and checks the trainer does; :mod:`jreshard.net.auth`), sends its
declaration (names, shapes, dtypes, the boxes of its devices) and is checked
against the trainer's; a mismatch is refused with every problem listed. Each
replica has its own connection, so one replica joining, leaving or dying
touches no other. A background thread owns every socket: it admits joiners,
serves their catch-up, notices leaves and deaths (a closed connection is seen
at once), and runs the pushes handed to it by :meth:`ElasticTrainer.push`.

The bytes of every refit move over NIXL (one-sided WRITEs into the replica's
registered buffers, :mod:`jreshard.nixl`); the connection carries only small
control messages. A trainer may be several processes (one jax cluster): every process makes an
``ElasticTrainer`` and calls ``push``; process 0 leads membership and every
other process serves its own shards to each replica (:mod:`.followers`).

A push is one refit per replica (trainer -> that replica, its own plan): a
replica that fails or dies is dropped, named in the :class:`PushReport`, and
the others complete the version. A replica that joins while a version is
committed first catches up to it, from the trainer or from a replica that
holds it (:class:`CatchUp`); a push waits (up to ``timeout_s``) for catch-ups
in flight, so a joiner holds the latest version before the next one arrives.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jreshard.elastic.followers import Followers, FollowerService, gather_followers
from jreshard.elastic.membership import Membership
from jreshard.elastic.pairs import check_like
from jreshard.elastic.service import stop_service
from jreshard.elastic.types import CatchUp, PushReport, ReplicaInfo
from jreshard.errors import PeerError, TransferTimeoutError
from jreshard.net.auth import resolve_secret
from jreshard.net.channel import Channel, format_address, listen, parse_address
from jreshard.options import Options, as_int, wait_s
from jreshard.refit.background import check_cpus, start_on
from jreshard.refit.decl import declare_local, deleted_leaf
from jreshard.types import PyTree

__all__ = ["ElasticTrainer"]


class ElasticTrainer:
    """The trainer side of elastic refit: one process that pushes versions to any number of replicas.

    Args:
      params: the parameter declaration: a pytree of ``jax.Array`` or
        ``jax.ShapeDtypeStruct`` with shardings on this process's devices.
      host: this host's address to listen on: an interface's address (``"10.0.0.1"``), ``"0.0.0.0"``
        for every IPv4 interface, default loopback. NIXL's UCX listens on that interface only (a
        wildcard: on every one).
      port: the port to listen on (0: a free one; see :attr:`address`).
      address_file: if given, :attr:`address` is written there (atomically) for replicas to read.
      devices: the jax devices this process drives (default ``jax.local_devices()``).
      options: chunking, staging, ``timeout_s`` (the longest this process waits on any replica) and
        ``secret``, the key every replica must hold (default ``$JRESHARD_SECRET`` or
        ``$JRESHARD_SECRET_FILE``).
      catch_up: where joiners take the latest version from (:class:`CatchUp`).
      links: link speeds for the cost model (``Topology.from_domains`` keywords).
      cpus: the cores of this process's service thread, which sends every version to the replicas (a set of
        core numbers; Linux, that thread and the threads it starts), e.g. cores the training steps do not use;
        ``None`` keeps the caller's.

    Raises:
      ValueError: the declaration is malformed, no secret is set, ``host`` cannot be bound, or ``cpus`` is not
        a non-empty set of cores the OS lets this process run on.
      BackendUnavailableError: NIXL is not installed.
    """

    def __init__(
        self,
        params: PyTree,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        address_file: str | None = None,
        devices: Sequence[Any] | None = None,
        options: Options | None = None,
        catch_up: CatchUp | str = CatchUp.AUTO,
        links: dict[str, float] | None = None,
        cpus: Iterable[int] | None = None,
    ):
        import jax

        if options is not None and not isinstance(options, Options):
            raise TypeError(f"ElasticTrainer: options={options!r} must be a jreshard.Options")
        self._cpus = check_cpus(cpus, "ElasticTrainer")
        number = as_int(port)
        if number is None or not 0 <= number <= 65535:
            raise ValueError(f"ElasticTrainer: port={port!r} must be an int in [0, 65535] (0: any free port)")
        port = number
        self.options = options or Options()
        key = resolve_secret(self.options.secret, who="ElasticTrainer")
        self.catch_up = CatchUp(catch_up)
        self._links = dict(links or {})
        self._devices = list(jax.local_devices() if devices is None else devices)
        self._decl = declare_local("source", params, self._devices, None)
        self._checked: dict = {}  # check_like's memo of the last tree push matched against the declaration
        if self._decl["errors"]:
            raise ValueError("ElasticTrainer: " + "; ".join(self._decl["errors"]))
        from jreshard.call.routes import kit

        NixlAgent = kit("nixl").agent

        NixlAgent.shared(host)  # NIXL present and its agent made (UCX on host's interface) before anyone connects
        self._process, processes = jax.process_index(), jax.process_count()
        self._follower: FollowerService | None = None
        self._stop = False
        self._fatal = "it was closed"
        if self._process > 0:  # a follower: serves its shards; process 0 leads membership
            self._start_follower(host, port, address_file, key)
            return
        self._listener = listen(host, port)
        self.address = format_address(host, self._listener.getsockname()[1])
        if address_file is not None:
            with open(address_file + ".tmp", "w") as f:
                f.write(self.address)
            os.replace(address_file + ".tmp", address_file)
        followers: Followers | None = None
        early: list[tuple[Channel, float]] = []
        if processes > 1:
            try:
                followers, early = gather_followers(self._listener, self._decl, processes, key, self.options)
            except BaseException:
                self._listener.close()
                raise
        self._wake_r, self._wake_w = socket.socketpair()
        self._m = Membership(
            self._decl,
            self._devices,
            self.options,
            self.catch_up,
            self._links,
            self._listener,
            self._wake_r,
            key,
            followers=followers,
        )
        self._m.adopt(early)
        self._cv = self._m.cv
        self._jobs: collections.deque[tuple[Callable[[], Any], dict]] = collections.deque()
        self._thread = threading.Thread(target=self._serve, name="jreshard-elastic-trainer", daemon=True)
        start_on(self._thread, self._cpus)

    def _start_follower(self, host: str, port: int, address_file: str | None, key: bytes) -> None:
        """This process is not process 0: join process 0 and serve this process's shards."""
        if address_file is not None:
            leader = parse_address(address_file, timeout_s=self.options.timeout_s)
        elif port:
            leader = (host, port)
        else:
            raise ValueError(
                "ElasticTrainer: a trainer of several processes needs address_file=... (or port=...) in every "
                "process, so they find process 0"
            )
        self._follower = f = FollowerService(
            leader, self._process, self._decl, self._devices, host, key, self.options, self._links
        )
        self.address = format_address(*leader)
        self._cv = f.cv
        deadline = time.monotonic() + self.options.timeout_s
        while f.trainer_decls is None:
            f._leader.pump()
            msg = f._leader.pop()
            if msg is not None and msg.get("op") == "trainer":
                f.trainer_decls = list(msg["decls"])
            elif f._leader.eof or time.monotonic() > deadline:
                f.close()
                raise TransferTimeoutError(f"ElasticTrainer: process 0 did not answer within {self.options.timeout_s}")
            else:
                time.sleep(0.005)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._follow, name="jreshard-elastic-follower", daemon=True)
        start_on(self._thread, self._cpus)

    def _follow(self) -> None:
        f = self._follower
        assert f is not None
        try:
            while True:
                with self._cv:
                    if self._stop or f.gone is not None:
                        break
                f.poll(0.02)
        finally:
            with self._cv:
                self._stop = True
                f.gone = f.gone or "it was closed"
                self._cv.notify_all()
            f.close()
            self._wake_r.close()
            self._wake_w.close()

    def _follower_push(self, f: FollowerService, version: int, leaves: list, block: bool) -> PushReport | None:
        with self._cv:
            if f.gone is not None:
                raise PeerError(f"ElasticTrainer.push: this trainer process stopped serving ({f.gone})")
            last = max([*f.trees, *f.reports, -1])
            if version <= last:
                raise ValueError(f"ElasticTrainer.push: version={version} must be greater than {last}")
            f.trees[version] = leaves
        if not block:
            return None
        with self._cv:
            self._cv.wait_for(lambda: version in f.reports or f.gone is not None)
            if version in f.reports:
                return f.reports[version]
        raise PeerError(f"ElasticTrainer.push: version {version} did not complete ({f.gone})")

    @property
    def version(self) -> int | None:
        """The latest version pushed (``None`` before the first push)."""
        if self._follower is not None:
            with self._cv:
                return max(self._follower.reports, default=None)
        with self._cv:
            return self._m.version

    def replicas(self, *, include_gone: bool = False) -> dict[str, ReplicaInfo]:
        """``{name: ReplicaInfo}`` of the live replicas (and, with ``include_gone``, the departed: for a name
        that is live again, the live one; for a name that departed more than once, its latest departure;
        :meth:`history` keeps every one).

        Raises:
          ValueError: on a process other than process 0 (it leads membership).
        """
        self._leader_only("replicas")
        with self._cv:
            live = {m.name: m.info() for m in self._m.members.values()}
            gone = {i.name: i for i in self._m.gone} if include_gone else {}
        return gone | live

    def history(self, name: str | None = None) -> list[ReplicaInfo]:
        """Every replica this trainer admitted, oldest first: the departed (the last 1024, each with its
        ``error``, the reason it is gone), then the live. A name that left (or died) and joined again has
        one entry per time it joined, each with its own ``id``: a rejoin never hides why the earlier one
        went (:meth:`replicas` keeps one entry per name, the live one first).

        Args:
          name: only the entries of this name.

        Raises:
          ValueError: on a process other than process 0 (it leads membership).
        """
        self._leader_only("history")
        with self._cv:
            out = [*self._m.gone, *(m.info() for m in self._m.members.values())]
        return sorted((i for i in out if name is None or i.name == name), key=lambda i: i.id)

    def push(self, params: PyTree, *, version: int, block: bool = True) -> PushReport | None:
        """Send ``params`` as ``version`` to every live replica (each on its own; failures are dropped).

        Args:
          params: a tree matching the declaration. Keep it alive (not donated) until the push is
            done; after it, it serves catch-ups until the next push (a deleted tree is not served:
            joiners then take the version from a replica).
          version: an int greater than the last one pushed.
          block: wait for the push to finish and return its report; with ``False`` return at once
            (use :meth:`wait` for "any k replicas at v").

        Raises:
          ValueError: ``params`` does not match the declaration, a leaf of it was deleted or donated, or
            ``version`` does not increase.
        """
        number = as_int(version)
        if number is None:
            raise TypeError(f"ElasticTrainer.push: version={version!r} must be an int")
        version = number  # a Python int: it travels as JSON
        leaves = check_like(params, self._decl, "source", self._devices, "ElasticTrainer.push", self._checked)
        gone = deleted_leaf(leaves)
        if gone:  # (read after the job started, it would cost every replica its connection)
            raise ValueError(f"ElasticTrainer.push: {gone}")
        if self._follower is not None:
            return self._follower_push(self._follower, version, leaves, block)
        with self._cv:
            if self._stop:
                raise PeerError(f"ElasticTrainer.push: the trainer stopped serving ({self._fatal})")
            queued = [j[1]["version"] for j in self._jobs]
            last = queued[-1] if queued else self._m.version
            if last is not None and version <= last:
                raise ValueError(f"ElasticTrainer.push: version={version} must be greater than {last}")
            box: dict = {"version": version, "done": False}
            self._jobs.append((lambda: self._m.push(version, leaves), box))
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
          ValueError: ``count`` is not None nor an int >= 1, or ``timeout_s`` not None nor a finite number of
            seconds >= 0.
        """
        self._leader_only("wait")
        if count is not None:
            n = as_int(count)
            if n is None or n < 1:
                raise ValueError(f"ElasticTrainer.wait: count={count!r} must be None (all) or an int >= 1")
            count = n
        timeout = wait_s(timeout_s, self.options.timeout_s, "ElasticTrainer.wait")

        def at() -> list[str]:
            return [
                m.name
                for m in self._m.members.values()
                if version is None or (m.version is not None and m.version >= version)
            ]

        def ready() -> bool:
            names = at()
            if count is None:
                return bool(self._m.members) and len(names) == len(self._m.members)
            return len(names) >= count

        with self._cv:
            if not self._cv.wait_for(ready, timeout):
                have = {m.name: m.version for m in self._m.members.values()}
                want = "every replica" if count is None else f"{count} replicas"
                raise TransferTimeoutError(
                    f"ElasticTrainer.wait: {want} at version {version} not reached within timeout_s={timeout}; "
                    f"replicas and their versions: {have or 'none connected'}"
                )
            return tuple(sorted(at()))

    def _leader_only(self, what: str) -> None:
        if self._follower is not None:
            raise ValueError(
                f"ElasticTrainer.{what}: this is process {self._process} of the trainer; membership is led by "
                "process 0: ask it there"
            )

    def close(self) -> None:
        """Tell every replica the trainer is done (their pulls return what they hold, then raise) and stop.

        On process 0 of a trainer of several processes this also ends the others' service."""
        stop_service(self._cv, self, self.options.timeout_s)

    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop and not self._jobs:
                        break
                    job = self._jobs.popleft() if self._jobs else None
                if job is None:
                    try:
                        self._m.poll(0.05)
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
            self._m.goodbye()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
