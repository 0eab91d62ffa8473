"""RefitGroup: a source program (trainer) and a destination program (server), versioned refits over MPI.

Forming a group. Every process of both programs constructs a ``RefitGroup``
with its role and its parameter declaration (a pytree of ``jax.Array`` or
``jax.ShapeDtypeStruct`` with shardings; leaf names are their key paths):

- one launch, MPMD: ``mpiexec -n A python trainer.py : -n B python server.py``,
  ``RefitGroup(role, params)`` over ``MPI.COMM_WORLD``;
- two launches: ``RefitGroup.connect(role, params, address=path)``: every
  process joins an authenticated TCP group that meets at the file ``path``
  (bounded by ``timeout_s``; a stale file is refused), the source's process 0
  hands its MPI port name over it, and the sides ``Comm_accept`` /
  ``Comm_connect``; the TCP group carries the votes and sees a dead peer;
- two launches on any hosts, no MPI: ``RefitGroup.connect(role, params,
  address="HOST:PORT" or path, transport="nixl")``: the processes meet over
  authenticated TCP (the shared secret of ``Options.secret`` / ``$JRESHARD_SECRET``)
  and the weights move as NIXL WRITEs (:mod:`jreshard.nixl`).

Each process declares the boxes of the devices it drives (``devices``, default
``jax.local_devices()``); ranks are numbered sources first, then destinations,
process by process. Declarations are exchanged; every process checks all of
them (names, shapes, dtypes on both sides, every process of a side agreeing, a
device a process does not have, a source that does not cover a tensor) and
raises :class:`LayoutMismatchError` with the same full list on every process of
both sides before any weight moves. Otherwise each process plans only the
ranks it drives (their rank plans, no whole plan) and, at the first refit, agrees
their rounds with its peers in a few small messages; the schedule is kept for
every later refit. ``group.plan`` builds the whole plan only when read.

Casts and fused parameters. The destination's declaration may differ from the
source's: a leaf of another dtype is a cast (float32 trainer, bfloat16 server: the
bits of ``x.astype(bfloat16)``), and a ``recipe`` (a pytree with the structure of
the destination's parameters, each leaf a view over :func:`jreshard.views.param`
leaves naming the trainer's parameters, or ``None``) says how the server's tensors
are made from the trainer's: fused ``qkv`` with repeated key/value heads, ``gate_up``,
stacked experts, block FP8. Both declarations are checked against each other (names,
shapes, dtypes, every parameter a recipe reads) before any byte moves. Such a group
lowers its views once on every process (:mod:`jreshard.refit.views`: the whole
lowering: every rank's pieces) and runs its ranks of them through the same round
loop, casting while packing and unpacking in the CPU backend.

A refit. ``push(params, version)`` on every source process and ``pull(...)`` on
every destination process: (1) a *begin* vote (each side's local checks, the
version), (2) the data, through the shared engine over :class:`MpiComm`, into
freshly allocated destination buffers, (3) a *commit* vote. ``pull`` returns the
new arrays only if every process of the group reported success; otherwise it
raises and the arrays the caller holds (the previous version) are untouched and
``group.version`` is unchanged. A failed begin vote (bad input) leaves the group
usable; a failure after data moved (a dead or silent peer: every wait is bounded
by ``options.timeout_s``) breaks it, fail-stop as NCCL: form a new group.
Under one ``mpiexec`` a killed process makes the launcher kill the whole job;
with two launches the other program survives and raises within the timeout.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jreshard.refit.boxes as boxes
from jreshard.call.routes import kit, program_transport
from jreshard.engine.buffers import CpuBuffers
from jreshard.engine.digest import DigestComm, DigestCost, Digests
from jreshard.engine.driver import assemble, receive_schedule, schedule_local
from jreshard.engine.ownership import shard_arrays
from jreshard.engine.rounds import ExecStats
from jreshard.errors import IntegrityError, LayoutMismatchError, PeerError, TransferError, TransferTimeoutError
from jreshard.options import Options, as_int, wait_s
from jreshard.refit.decl import (
    GroupViews,
    declare_leaves,
    declare_local,
    deleted_leaf,
    group_layouts,
    group_views,
    leaf_differences,
    needs_views,
    problems,
    tree_key,
    validate,
)
from jreshard.refit.delta import DeltaReport, GroupDelta, wire_unit
from jreshard.refit.views import lower_group, run_group, schedule_group
from jreshard.refit.votes import begin_problem, commit_problem, declaration_problem
from jreshard.schedule.steps import Schedule
from jreshard.sharding.dtypes import storage_bytes
from jreshard.sharding.plan import Plan
from jreshard.sharding.rows import TensorSpec
from jreshard.sharding.topology import Link, Topology
from jreshard.types import Device, PyTree
from jreshard.views.lowering import LeafLowering

if TYPE_CHECKING:  # jax is imported only where a call needs it (a PyTorch endpoint runs without it)
    from jreshard.engine.put import BatchedPut

__all__ = ["RefitGroup", "Role"]


def _local_devices() -> list[Any]:
    import jax

    return list(jax.local_devices())


def _role(role: Role | str, who: str) -> Role:
    """``role`` as a :class:`Role` (ValueError naming ``who``, the value and the roles otherwise)."""
    try:
        return Role(role)
    except ValueError:
        raise ValueError(f"{who}: role={role!r}; expected one of {[r.value for r in Role]}") from None


def _declared_early(role: Role, params: PyTree, kwargs: dict[str, Any]) -> dict | None:
    """This process's declaration, made before it meets its peers (the group's constructor then takes it as made),
    with what is wrong with it in its ``errors`` (a shard on a device it does not declare, a shape its sharding
    cannot hold, a dtype no refit moves...); ``None`` where it cannot be made here: the constructor makes it again
    and raises what stops it."""
    devices = kwargs.get("devices")
    try:
        return declare_local(
            role.value,
            params,
            list(_local_devices() if devices is None else devices),
            kwargs.get("domain"),
            kwargs.get("recipe"),
        )
    except Exception:  # said again, with its own exception, by the constructor
        return None


_MPI = kit("mpi")  # the transports, by name from the registry (jreshard.call.routes)
MpiComm, Control, LiveComm, import_mpi = _MPI.comm, _MPI.control, _MPI.live, _MPI.import_mpi

MPI_JOIN_EXIT = 75  # the exit status of a process whose MPI accept/connect a dead peer left hanging (EX_TEMPFAIL)


def _join_mpi(MPI: Any, comm: Any, port: str, source: bool, group: Any, timeout_s: float) -> Any:
    """``Comm_accept`` (``source``) or ``Comm_connect`` at ``port``, collective over ``comm``: the intercommunicator.

    MPI can neither time these calls out nor cancel them, so they run in a helper thread while this one
    watches every peer's connection in ``group`` and the deadline. A peer that dies (or a call still not
    done after ``timeout_s``) leaves the call hanging inside MPI for good, and MPI cannot be finalized
    after it: this process then says so on stderr and exits with status :data:`MPI_JOIN_EXIT`.
    """
    import sys
    import threading
    import time

    call = comm.Accept if source else comm.Connect
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:  # MPI may not be called from another thread: no watch
        return call(port, root=0)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["inter"] = call(port, root=0)
        except BaseException as err:  # handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, name="jreshard-mpi-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    peers = [p for p in range(group.size) if p != group.rank]
    while True:
        thread.join(0.05)
        if not thread.is_alive():
            break
        gone = group.gone(peers)
        if gone or time.monotonic() > deadline:
            what = "MPI_Comm_accept" if source else "MPI_Comm_connect"
            why = (
                f"{', '.join(group.describe(p) for p in gone)} died"
                if gone
                else f"the peers did not complete it within timeout_s={timeout_s}"
            )
            sys.stdout.flush()
            sys.stderr.write(
                f"jreshard: RefitGroup.connect: {why} while the two launches were joining over MPI ({what}). "
                f"MPI cannot time out or cancel that call, and cannot be finalized with it pending, so this "
                f"process exits with status {MPI_JOIN_EXIT}. Start it again to form a new group, or connect "
                "with transport='nixl'.\n"
            )
            sys.stderr.flush()
            os._exit(MPI_JOIN_EXIT)
    if "error" in box:
        raise PeerError(f"RefitGroup.connect: MPI failed joining the two launches: {box['error']}") from box["error"]
    return box["inter"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Landing:
    """How a pulled leaf's new array is made from the buffers its shards landed in, worked out once per tree.

    Attributes:
      devices: its addressable devices, in the order jax assembles its shards.
      ranks: per device, its rank on this side (``None``: a device of the sharding this side does not hold).
      forms: per device, its shard's ``(shape, dtype)``.
      direct: every device is a CPU device of this side and the sharding is fully addressable: one batched put.
    """

    devices: tuple[Device, ...]
    ranks: tuple[int | None, ...]
    forms: tuple[tuple[tuple[int, ...], Any], ...]
    direct: bool


class Role(enum.Enum):
    """Which side of a refit a process is on."""

    SOURCE = "source"
    DESTINATION = "destination"


class RefitGroup:
    """A trainer side and a server side that refit versioned parameters (final).

    Args:
      role: ``"source"`` or ``"destination"`` (or a :class:`Role`).
      params: this side's parameter declaration: a pytree of ``jax.Array`` or
        ``jax.ShapeDtypeStruct`` with shardings.
      comm: an MPI intracommunicator spanning both sides (default ``MPI.COMM_WORLD``).
      devices: the jax devices this process drives (default ``jax.local_devices()``).
      domain: this process's fast-link domain id (default: its own).
      options: chunking, staging and ``timeout_s`` (every wait on a peer).
      links: link speeds for the plan's topology (``Topology.from_domains`` keywords).
      recipe: a destination's views of the source's parameters (module docstring): a pytree with the
        structure of ``params``, each leaf a view over :func:`jreshard.views.param` leaves or ``None``
        (the source leaf of that name, cast to this leaf's dtype).

    Attributes:
      sent_bytes: the bytes this process's ranks sent in the last refit, by link (empty before one), as a full
        refit sends them; what a delta refit sent instead is in :attr:`delta_report`.
      digest_cost: what digesting the last refit's messages cost this process (:class:`DigestCost`: seconds,
        bytes, messages), or ``None`` when nothing is digested (one MPI universe without ``verify``).

    Verified boxes. Over NIXL (the processes share a secret) every message crossing processes is tagged on
    both sides with a keyed MAC; over MPI only with ``Options(verify=True)`` (MACs between two launches,
    XXH3-128 hashes in one MPI universe; such a refit replays its prepared groups from Python, not in the
    compiled loop). The commit vote carries every stream's digests and every process compares them before
    the version is published (:mod:`jreshard.refit.boxes`). A mismatch is
    :class:`~jreshard.errors.IntegrityError` on every process of both sides, the destinations keep their
    previous version, and the group stays usable.

    Raises:
      LayoutMismatchError: the declarations disagree (same message on every process).
      TransferTimeoutError: a process did not join or answer while forming the group (one that failed or exited
        before making its side, included), within ``options.timeout_s``.
    """

    def __init__(
        self,
        role: Role | str,
        params: PyTree,
        *,
        comm: Any = None,
        devices: Sequence[Any] | None = None,
        domain: int | None = None,
        options: Options | None = None,
        links: dict[str, float] | None = None,
        recipe: PyTree = None,
        _group: Any = None,
        _declared: dict | None = None,
    ):
        self.role = _role(role, "RefitGroup")
        self.options = options or Options()
        self._devices = list(_local_devices() if devices is None else devices)
        if recipe is not None and self.role is not Role.DESTINATION:
            raise ValueError("RefitGroup: recipe= is the destination's (how its tensors are made); a source has none")
        if _declared is not None:  # made by connect() before it met its peers, or an Endpoint's (devices are slots)
            mine = _declared
        else:
            mine = declare_local(self.role.value, params, self._devices, domain, recipe)
        if _group is None:  # one MPI universe
            MPI = import_mpi()
            comm = MPI.COMM_WORLD if comm is None else comm
            self._control: Any = Control(comm, describe=self._describe, timeout_s=self.options.timeout_s)
        else:  # a jreshard.nixl.group.ProcessGroup made by connect(transport="nixl")
            self._control = _group
            _group.describe = self._describe
        self._roles: dict[int, str] = {}
        decls = self._control.allgather(mine, timeout_s=self.options.timeout_s)
        malformed = [(p, why) for p, d in sorted(decls.items()) if (why := declaration_problem(d)) is not None]
        if malformed:
            self._control.close()
            raise PeerError(
                "RefitGroup: a process sent a declaration that cannot be one (no weights moved): "
                + "; ".join(f"process {p}: {why}" for p, why in malformed),
                destination_intact=True,
            )
        self._roles = {p: d["role"] for p, d in decls.items()}
        errors = validate(decls, views=True)
        if errors:
            self._control.close()
            raise LayoutMismatchError(
                f"RefitGroup: the declarations disagree ({problems(len(errors))}, reported on every process of "
                "both sides; no weights moved):\n  " + "\n  ".join(errors),
                what="declaration",
            )
        self._views: GroupViews | None = group_views(decls) if needs_views(decls) else None
        if self._views is None:
            self.names, pairs, domains, rank_process, bases = group_layouts(decls)
            side = self.names
        else:
            gv = self._views
            self.names, pairs, domains = list(gv.src_names), [], gv.domains
            rank_process, bases = gv.rank_process, gv.base
            side = list(gv.src_names if self.role is Role.SOURCE else gv.dst_names)
        self._base = bases[self._control.rank]
        self._index = {n: t for t, n in enumerate(side)}
        self.topology = Topology.from_domains(domains, devices={r: r for r in domains}, **(links or {}))
        self._pairs = pairs
        self._tensors = [TensorSpec(n, s, d) for n, (s, d) in zip(self.names if pairs else [], pairs, strict=True)]
        self._src_layouts = [s for s, _ in pairs] if self._views is None else list(self._views.layouts)
        self._lowerings = None if self._views is None else self._lower(self._views)
        self._view_schedule: Any = None
        self.sent_bytes: dict[Link, int] = {}
        self._plan: Plan | None = None
        self._schedule: Schedule | None = None  # this process's ranks only, agreed with peers at the first refit
        if _group is None:
            self._comm: Any = MpiComm(comm, rank_process, timeout_s=self.options.timeout_s)
        elif comm is not None:  # two MPI launches: the weights over MPI, never posted to a peer known gone
            mpi = MpiComm(comm, rank_process, timeout_s=self.options.timeout_s)
            self._comm = LiveComm(mpi, _group.gone, self._describe)
        else:
            self._comm = _group.communicator(
                rank_process, timeout_s=self.options.timeout_s, encrypt=self.options.encrypt
            )
        self._rank_process = dict(rank_process)
        peers = [p for p in self._roles if p != self._control.rank]
        sessions = None if _group is None else [_group.channel(p).session for p in peers]
        self._digest_kind = boxes.mode(self.options, sessions, always=_group is not None and comm is None)
        self._wire = self._comm  # the transport itself
        if self._digest_kind is not None:
            if _group is not None and comm is None:  # NIXL: the box MACs check every message
                self._wire.tags = False
            self._comm = DigestComm(self._comm)
        # the schedule's options: a digested refit cuts its messages small enough to digest them in the cache
        self._planned = self.options if self._digest_kind is None else boxes.digested(self.options)
        self._nonce = ""
        self.digest_cost: DigestCost | None = None
        self._decl = mine
        self.version: int | None = None
        self._broken: str | None = None
        self._background: Any = None  # the PullHandle of a pull_async in flight (refit/background.py)
        wire = [d.np_dtype for _, d in pairs] if self._views is None else [d.np_dtype for d in self._views.dsts]
        self._delta = GroupDelta(self.options, wire_unit(wire), rank_process, self._describe)  # refit/delta.py
        self._votes: dict = {}
        self._checked: tuple | None = None  # the key of the last tree that matched the declaration (tree_key)
        self._order: tuple[Any, list[int]] | None = None  # (treedef, its leaves' tensor indices)
        self._shards: tuple[Any, dict, dict, list] | None = None  # (the key they were made for, _shards_of's answer)
        self._sent: tuple[Any, list] | None = None  # (the key it was made for, _sent_of's answer)

    @classmethod
    def connect(
        cls,
        role: Role | str,
        params: PyTree,
        *,
        address: str,
        comm: Any = None,
        transport: str = "mpi",
        host: str = "127.0.0.1",
        **kwargs: Any,
    ) -> RefitGroup:
        """Form a group between two separate launches meeting at ``address``.

        ``transport="mpi"``: ``address`` is a file path both can reach. Every process joins a
        :class:`~jreshard.nixl.group.ProcessGroup` there (the source's process 0 listens on ``host``
        and writes its address, with a fresh key when no secret is configured; a file whose address
        nobody listens on is stale: read again until replaced, then refused), every wait bounded by
        ``options.timeout_s`` (:class:`TransferTimeoutError`). Then the source's process 0 hands its
        MPI port name over that group and the sides ``Comm_accept`` / ``Comm_connect``, merged into
        one communicator (sources first) that carries the weights. The group's votes and close notice
        go over TCP, and no message is posted over MPI to a peer whose connection closed (MPICH may
        crash on a send to a dead peer): a survivor raises :class:`PeerError` and can connect again.

        ``transport="nixl"``: no MPI. ``address`` is ``"HOST:PORT"`` (the source's process 0 binds
        it, the others connect) or a file path (process 0 binds ``host`` and writes its address
        there). Every process authenticates with the shared secret, then every pair of processes
        is connected (:class:`~jreshard.nixl.group.ProcessGroup`); the weights move as NIXL WRITEs.
        Each side's processes are its jax cluster (``jax.process_index()`` of
        ``jax.process_count()``). Every wait, the source's included, is bounded by
        ``options.timeout_s``; a peer that dies is seen within it, and the surviving side can
        ``connect`` again with a new peer.

        This process's own declaration is checked before it meets anyone, and its problems are voted as the group
        forms, so every process names them; where the group does not form in time, the
        :class:`TransferTimeoutError` names them too.
        """
        side = _role(role, "RefitGroup.connect")
        nixl = program_transport(transport, "RefitGroup.connect") == "nixl"
        declared = _declared_early(side, params, kwargs)
        own = [] if declared is None else [str(e) for e in declared["errors"]]
        if declared is not None:
            kwargs["_declared"] = declared  # declared once: the constructor takes it as it is
        try:
            if nixl:
                return cls._connect_nixl(side, params, address, host, **kwargs)
            return cls._connect_mpi(side, params, address, host, comm, **kwargs)
        except TransferTimeoutError as err:
            if not own:
                raise
            raise TransferTimeoutError(
                f"{err}; and this process could not have taken part: " + "; ".join(own),
                destination_intact=err.destination_intact,
            ) from err

    @classmethod
    def _connect_mpi(cls, role: Role, params: PyTree, address: str, host: str, comm: Any, **kwargs: Any) -> RefitGroup:
        """Two MPI launches: every process joins a :class:`~jreshard.nixl.group.ProcessGroup` at ``address``
        (bounded, authenticated; the control plane and the liveness of every peer), the source's process 0
        hands its MPI port name over it, then the sides ``Comm_accept`` / ``Comm_connect`` (both known alive
        and calling) and the weights move over the merged communicator."""
        from jreshard.net.auth import SECRET_ENV, SECRET_FILE_ENV, resolve_secret

        ProcessGroup = kit("nixl").group

        MPI = import_mpi()
        comm = MPI.COMM_WORLD if comm is None else comm
        options = Options.of(kwargs.get("options"))
        key: bytes | None = None  # none configured: process 0 of the source side draws one into the address file
        if options.secret is not None or os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV):
            key = resolve_secret(options.secret, who="RefitGroup.connect")  # a bad one raises
        group = ProcessGroup.join(
            role.value,
            address,
            index=comm.Get_rank(),
            count=comm.Get_size(),
            key=key,
            timeout_s=options.timeout_s,
            host=host,
        )
        try:
            port = MPI.Open_port() if role is Role.SOURCE and comm.Get_rank() == 0 else None
            ports = group.allgather({"port": port}, timeout_s=options.timeout_s)
            name = ports[0].get("port") if isinstance(ports[0], dict) else None
            if not isinstance(name, str) or not name:
                raise PeerError(f"RefitGroup.connect: the source's process 0 sent no MPI port ({ports[0]!r})")
            # every process of both sides is alive and calls in now (MPI's accept has no timeout: watched)
            inter = _join_mpi(MPI, comm, name, role is Role.SOURCE, group, options.timeout_s)
            if port is not None:
                MPI.Close_port(port)
            merged = inter.Merge(high=role is Role.DESTINATION)
        except BaseException:
            group.close()
            raise
        try:
            return cls(role, params, comm=merged, _group=group, **kwargs)
        except BaseException:
            group.close()
            raise

    @classmethod
    def _connect_nixl(cls, role: Role, params: PyTree, address: str, host: str, **kwargs: Any) -> RefitGroup:
        import jax

        from jreshard.net.auth import resolve_secret

        ProcessGroup = kit("nixl").group

        options = Options.of(kwargs.get("options"))
        key = resolve_secret(options.secret, who="RefitGroup.connect")
        group = ProcessGroup.join(
            role.value,
            address,
            index=jax.process_index(),
            count=jax.process_count(),
            key=key,
            timeout_s=options.timeout_s,
            host=host,
        )
        try:
            return cls(role, params, _group=group, **kwargs)
        except BaseException:
            group.close()
            raise

    def _lower(self, gv: GroupViews) -> list[LeafLowering]:
        """The group's views lowered to pieces (the same on every process: it raises on all or none)."""
        from jreshard.errors import JReshardError

        try:
            return lower_group(gv, self.topology)
        except JReshardError as err:
            self._control.close()
            raise LayoutMismatchError(
                f"RefitGroup: the declared views cannot be lowered (on every process; no weights moved): {err}",
                what="declaration",
            ) from None

    @property
    def delta_report(self) -> DeltaReport | None:
        """What the last committed refit sent from this process against a full refit (``None`` before one):
        mode and why chunks went whole, full and sent bytes, the changed fraction, encode and apply times,
        and the bytes kept to diff the next refit against (:class:`~jreshard.refit.delta.DeltaReport`)."""
        return self._delta.report

    @property
    def lowerings(self) -> list[LeafLowering]:
        """Per destination leaf, its pieces and bytes by link (a group that moves views; else ``ValueError``)."""
        if self._lowerings is None:
            raise ValueError("RefitGroup.lowerings: this group moves plain arrays; read group.plan instead")
        return self._lowerings

    @property
    def plan(self) -> Plan:
        """The whole plan of the group (every rank's moves), built when first read and kept.

        Refits do not build it: each process plans and schedules only the ranks it drives,
        agreeing on rounds with its peers at the first refit. Read it for statistics
        (``group.plan.stats()``) or pictures.
        """
        if self._views is not None:
            raise ValueError(
                "RefitGroup.plan: this group moves views (a cast or a recipe), lowered to pieces, not planned "
                "as layout pairs; read group.lowerings for their bytes"
            )
        if self._plan is None:
            from jreshard.sharding.planner import plan_layouts

            self._plan = plan_layouts(self._pairs, self.topology, self.options, self.names)
        return self._plan

    def _describe(self, p: int) -> str:
        return f"process {p} ({self._roles.get(p, 'unknown role')})"

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise PeerError(
                f"RefitGroup is broken since an earlier failure ({self._broken}); form a new group",
                destination_intact=True,
            )

    def _begin(self, vote: dict, timeout_s: float) -> int:
        votes = self._control.allgather(vote, timeout_s=timeout_s)
        self._votes = {}
        malformed = [
            f"{self._describe(p)} sent a begin vote that cannot be one ({why})"
            for p, v in sorted(votes.items())
            if (why := begin_problem(v, self._roles.get(p))) is not None
        ]
        if malformed:  # a process that does not speak the protocol: nothing moves, and the group is done
            self._broken = malformed[0]
            raise PeerError("refit not started (nothing moved):\n  " + "\n  ".join(malformed), destination_intact=True)
        self._votes = votes
        bad = [f"{self._describe(p)}: {v['error']}" for p, v in sorted(votes.items()) if v["error"]]
        versions = {v["version"] for v in votes.values() if v["role"] == "source"}
        if len(versions) > 1:
            bad.append(f"the source processes push different versions {sorted(versions)}")
        if bad:
            raise PeerError("refit not started (nothing moved):\n  " + "\n  ".join(bad), destination_intact=True)
        self._nonce = str(next(v.get("nonce") for _, v in sorted(votes.items()) if v["role"] == "source"))
        return versions.pop()

    def _digests(self) -> Digests | None:
        """This refit's digests (``None``: none taken)."""
        kind = self._digest_kind
        if kind is None:
            return None
        channel = self._control.channel if kind == "mac" else None
        return boxes.digests_for(
            kind,
            self._comm.local_ranks,
            lambda r: boxes.keyed(channel(self._rank_process[r]).session, self._nonce),  # type: ignore[misc]
        )

    def _rank_name(self, r: int) -> str:
        return f"rank {r} of {self._describe(self._rank_process.get(r, -1))}"

    def _boxes_of(self, src: int, dst: int) -> str:
        """The destination boxes at rank ``dst`` that rank ``src`` may fill, as text."""
        if self._views is None:
            return boxes.boxes_at(src, dst, self.names, self._pairs)
        gv = self._views
        return boxes.boxes_at(src, dst, gv.dst_names, [(None, d) for d in gv.dsts])

    def _check_digests(self, votes: dict) -> None:
        """Compare every stream's digests in the commit ``votes``; :class:`IntegrityError` on a difference."""
        sent: dict[str, str] = {}
        landed: dict[str, str] = {}
        for p, v in sorted(votes.items()):
            s, r = boxes.streams_of(v, self._describe(p))
            sent.update(s)
            landed.update(r)
        assert self._digest_kind is not None
        boxes.check(sent, landed, describe=self._rank_name, boxes=self._boxes_of, kind=self._digest_kind)

    def _run(self, sources: dict, targets: dict, given: dict | None = None, abort: Any = None) -> dict:
        """The bytes of one refit, then the commit vote. ``given``: ``{(tensor, rank): 1-D uint8}``
        destination buffers to write into instead of fresh ones (they come back as they are); ``abort``:
        a background pull's cancel check (true: vote against the commit)."""
        err = ""
        cause: BaseException | None = None
        shards: dict = {}
        digests = self._digests()
        if digests is not None:
            assert isinstance(self._comm, DigestComm)
            self._comm.begin(digests)
        try:
            delta = self._delta.start(self._votes, self._control.rank)
            if self._views is not None:
                shards, stats = self._move_views(self._views, sources, targets, given, delta)
            else:
                if self._schedule is None:
                    _, _, self._schedule = schedule_local(
                        self._pairs, self.names, self.topology, self._planned, self._wire
                    )
                _, shards, stats = receive_schedule(
                    self._tensors,
                    self._schedule,
                    self._comm,
                    sources,
                    targets,
                    options=self.options,
                    buffers=CpuBuffers(),
                    given=given,
                    delta=delta,
                )
            if digests is not None:
                self._comm.finish()  # every message digested (a digest's failure fails the refit here)
            self.sent_bytes = dict(stats.sent_bytes)
            if abort is not None and abort(True):  # a background pull cancelled: vote against the commit
                raise PeerError("the destination cancelled the refit (PullHandle.cancel)")
        except Exception as e:  # any failure: the group is broken, and the commit vote still runs
            # (a transport's own exception type, a ValueError of options that cannot schedule, ...):
            # every other process hears of it at once instead of waiting out its timeout
            err = f"{type(e).__name__}: {e}"
            self._broken = err
            cause = e
        finally:
            if digests is not None:
                assert isinstance(self._comm, DigestComm)
                self._comm.end()
                self.digest_cost = digests.cost()
        failed: list[str] = [f"{self._describe(self._control.rank)}: {err}"] if err else []
        vote: dict[str, Any] = {"error": err}
        if digests is not None and not err:
            vote["digests"] = digests.streams()
        votes: dict = {}
        try:
            votes = self._control.allgather(
                vote,
                timeout_s=0.0 if err else self.options.timeout_s,  # a failed process only tells the others
                stop=lambda p, v: commit_problem(v) is not None or bool(v["error"]),
            )
            failed = []
            for p, v in sorted(votes.items()):
                if (why := commit_problem(v)) is not None:
                    failed.append(f"{self._describe(p)} sent a commit vote that cannot be one ({why})")
                elif v["error"]:
                    failed.append(f"{self._describe(p)}: {v['error']}")
            if err and not failed:
                failed = [f"{self._describe(self._control.rank)}: {err}"]
        except TransferError as e:
            self._broken = self._broken or str(e)
            if not err:
                raise
            failed.append(f"commit vote: {e}")
        if failed:
            self._broken = self._broken or failed[0]
            self._delta.abort()
            raise PeerError(
                "refit failed; the destination keeps its previous version:\n  " + "\n  ".join(failed),
                destination_intact=True,
            ) from cause
        if digests is not None:
            try:
                self._check_digests(votes)  # on every process alike: all hold every vote
            except IntegrityError:  # the bytes differ: refused, and the group stays usable
                self._delta.abort()
                raise
            except PeerError as e:  # digests that cannot be digests: a peer off the protocol
                self._broken = self._broken or str(e)
                self._delta.abort()
                raise
        return shards

    def _move_views(
        self, gv: GroupViews, sources: dict, targets: dict, given: dict | None = None, delta: Any = None
    ) -> tuple[dict, ExecStats]:
        """This process's ranks of the group's views through the round loop (the schedule built at the first
        refit and kept): ``({(destination leaf, rank): new shard}, stats)``."""
        if self._view_schedule is None:
            self._view_schedule = schedule_group(
                gv, self.lowerings, self.topology, self._planned, pipelined=self._comm.pipelines_packs
            )
        return run_group(
            gv, self._view_schedule, self._comm, sources, targets, options=self.options, given=given, delta=delta
        )

    def push(self, params: PyTree, *, version: int) -> None:
        """Send ``params`` (matching the declaration) as ``version`` to the destination side.

        Returns when every process of the group has committed the new version.

        Args:
          params: the source tree.
          version: an int (numpy's too): every source process pushes the same one.

        Raises:
          PeerError: some process rejected the refit or failed (message names it), a version that is not an
            int (a float, a bool, a string) included: every process hears of it and nothing moves.
          TransferTimeoutError: a process did not answer within ``options.timeout_s``.
        """

        if self.role is not Role.SOURCE:
            raise ValueError(f"RefitGroup.push: this process is a {self.role.value}; call pull()")
        import jax

        self._check_usable()
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)  # the one flattening of the call
        number = as_int(version)
        error = self._local_check(flat, treedef) or deleted_leaf(flat)
        if number is None:
            error = error or f"RefitGroup.push: version={version!r:.80} is not an int"
        said = 0 if number is None else number  # (with an error, every process refuses the refit: never used)
        vote = {"role": "source", "error": error, "version": said, "nonce": boxes.new_nonce()}
        vote |= self._delta.vote()
        self._begin(vote, self.options.timeout_s)
        leaves = self._indexed(flat, treedef)
        sources = {}
        for (t, a), picks in zip(leaves, self._sent_of(leaves), strict=True):
            shards = shard_arrays(a)  # jax's own list, in the order of their devices: no Shard object built
            for k, r in picks:
                sources[(t, r)] = shards[k]
        self._run(sources, {})
        assert number is not None  # else the begin vote refused it
        self.version = number
        self._delta.commit(self.version, sum(self.sent_bytes.values()))

    def pull_async(
        self,
        *,
        into: PyTree = None,
        like: PyTree = None,
        timeout_s: float | None = None,
        shadow: Any = "keep",
        max_shadow_bytes: int | None = None,
        nice: int = 10,
        cpus: Iterable[int] | None = None,
    ) -> Any:
        """Start :meth:`pull` in the background and return its :class:`~jreshard.refit.background.PullHandle`
        (``ready()``, ``result()``, ``flip()``, ``cancel()``): the server keeps stepping on the arrays it
        holds while the new version lands in fresh buffers, then flips between two steps.

        Args:
          into: the current parameter tree, as :meth:`pull` (left untouched unless ``shadow="release"``).
          like: an abstract tree instead, as :meth:`pull`.
          timeout_s: how long to wait for the source side to start, as :meth:`pull`.
          shadow: ``"keep"`` or ``"release"`` (:class:`~jreshard.refit.background.Shadow`): whether the flip
            deletes the old arrays (``into``).
          max_shadow_bytes: refuse (before any byte moves) when this process's shards of the new version,
            held beside the current ones until the flip, exceed it.
          nice: added to the receive thread's nice value (0 to 19; Linux, that thread only): where cores
            are short, the server's own steps go first. 0 keeps the caller's priority.
          cpus: the cores the receive thread runs on (a set of core numbers; Linux, that thread only), e.g.
            cores the server's steps do not use; ``None`` keeps the caller's.

        Raises:
          ValueError: this process is a source, a background pull is already in flight, the shadow is
            over ``max_shadow_bytes``, ``nice`` is not an int in 0..19, ``cpus`` is not a non-empty set
            of cores the OS lets this process run on, or ``timeout_s`` is not None nor a finite number of
            seconds >= 0.
        """
        from jreshard.refit.background import PullHandle, Shadow, check_cpus, check_nice, shadow_bytes

        if self.role is not Role.DESTINATION:
            raise ValueError(f"RefitGroup.pull_async: this process is a {self.role.value}; call push()")
        if self._background is not None:
            raise ValueError("RefitGroup.pull_async: a background pull is in flight; flip or cancel it first")
        try:
            mode = Shadow(shadow)
        except ValueError:
            raise ValueError(f"RefitGroup.pull_async: shadow={shadow!r}; expected 'keep' or 'release'") from None
        tree = into if into is not None else like
        if tree is None:
            raise ValueError("RefitGroup.pull_async: pass into=<current params> or like=<abstract tree>")
        if mode is Shadow.RELEASE and into is None:
            raise ValueError("RefitGroup.pull_async: shadow='release' deletes into= at the flip; pass into=")
        nbytes = shadow_bytes(tree)
        if max_shadow_bytes is not None:
            limit = as_int(max_shadow_bytes)
            if limit is None or limit < 0:
                raise ValueError(f"RefitGroup.pull_async: max_shadow_bytes={max_shadow_bytes!r}: a byte count >= 0")
            if nbytes > limit:
                raise ValueError(
                    f"RefitGroup.pull_async: the shadow copy needs {nbytes} bytes on this process, over "
                    f"max_shadow_bytes={max_shadow_bytes}; raise it, or pull() between steps (no second copy)"
                )
        nice = check_nice(nice, "RefitGroup.pull_async")
        cores = check_cpus(cpus, "RefitGroup.pull_async")
        wait_s(timeout_s, self.options.timeout_s, "RefitGroup.pull_async")
        self._check_usable()
        self._background = PullHandle(
            self, into=into, like=like, timeout_s=timeout_s, shadow=mode, nbytes=nbytes, nice=nice, cpus=cores
        )
        return self._background

    def pull(
        self,
        *,
        into: PyTree = None,
        like: PyTree = None,
        timeout_s: float | None = None,
        _phases: dict | None = None,
        _abort: Any = None,
    ) -> tuple[Any, int]:
        """Receive the next version: ``(new arrays, version)``, shaped like ``into`` (or ``like``).

        ``into`` / ``like`` must match this side's declaration; neither is
        written: the new version lands in fresh buffers and is returned only
        when every process committed it.

        Args:
          into: the current parameter tree (its arrays are left untouched).
          like: an abstract tree (``ShapeDtypeStruct`` with shardings) instead.
          timeout_s: how long to wait for the source side to start (default ``options.timeout_s``).

        Raises:
          PeerError, TransferTimeoutError: the refit failed; ``group.version``
            and the caller's arrays are the previous version.
          ValueError: this process is a source, neither ``into`` nor ``like`` was given, a background pull is
            in flight, or ``timeout_s`` is not None nor a finite number of seconds >= 0 (before anything moves).
        """
        import jax

        if self.role is not Role.DESTINATION:
            raise ValueError(f"RefitGroup.pull: this process is a {self.role.value}; call push()")
        tree = into if into is not None else like
        if tree is None:
            raise ValueError("RefitGroup.pull: pass into=<current params> or like=<abstract tree>")
        if self._background is not None and _phases is None:
            raise ValueError("RefitGroup.pull: a background pull is in flight; flip or cancel it first")
        wait_s(timeout_s, self.options.timeout_s, "RefitGroup.pull")
        self._check_usable()
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)  # the one flattening of the call
        error = self._local_check(flat, treedef)
        if not error and _abort is not None and _abort(False):
            error = "the destination cancelled the refit (PullHandle.cancel)"
        leaves = self._indexed(flat, treedef) if not error else []
        phases = {} if _phases is None else _phases  # when each phase ended, for a background pull's report
        # Fresh host buffers for this process's shards, one block per device (the endpoint's pull loop
        # writes into them), and jax arrays over them once every process has committed.
        backend = CpuBuffers()
        meta, by_device, landings = self._shards_of(leaves) if not error else ({}, {}, [])
        given: dict[tuple[int, int], Any] = {}
        for d, (keys, sizes) in by_device.items():
            given.update(zip(keys, backend.allocate(sizes, d), strict=True))
        version = self._receive(error, given, timeout_s, phases=phases, abort=_abort)
        from jreshard.engine.put import batched_put, put_allowed

        put = batched_put(put_allowed())
        out = [
            self._made(t, a, landing, given, meta, backend, put)
            for (t, a), landing in zip(leaves, landings, strict=True)
        ]
        phases["assembled"] = time.monotonic()
        return jax.tree_util.tree_unflatten(treedef, out), version

    def _receive(
        self,
        error: str,
        given: dict[tuple[int, int], Any],
        timeout_s: float | None,
        *,
        phases: dict | None = None,
        abort: Any = None,
    ) -> int:
        """The pull loop of a destination process (:meth:`pull`, and :class:`~jreshard.refit.endpoint.Endpoint`'s
        without jax): the begin vote (``error``: this process's problem, or ``""``), the bytes into
        ``given`` (``{(tensor, rank): 1-D uint8 buffer}``, every shard this process receives), the commit
        vote. Returns the version once every process of the group committed it.

        Raises:
          PeerError, TransferTimeoutError: a process rejected the refit or failed; nothing is committed and
            ``given`` holds neither version for sure (the caller's earlier arrays are untouched).
        """
        self._check_usable()
        vote = {"role": "destination", "error": error, "version": None, **self._delta.vote()}
        version = self._begin(vote, timeout_s or self.options.timeout_s)
        if phases is not None:
            phases["begun"] = time.monotonic()
        self._run({}, {k: k[1] for k in given}, given=given, abort=abort)  # (a shard's device is its rank)
        if phases is not None:
            phases["moved"] = time.monotonic()
        self.version = version
        self._delta.commit(version, sum(self.sent_bytes.values()))
        return version

    def _shards_of(self, leaves: list[tuple[int, Any]]) -> tuple[dict, dict, list[_Landing]]:
        """``(meta, by_device, landings)`` of the shards this process receives of a tree's ``leaves`` (``(tensor,
        leaf)``): ``meta[(tensor, rank)] = (shape, dtype, device)``, ``by_device[device] = (keys, byte sizes)`` and
        per leaf how its new array is made (:class:`_Landing`). Kept for the tree the declaration check matched
        last (:meth:`_local_check`), whose key says all they depend on."""
        if self._shards is not None and self._shards[0] is self._checked is not None:
            return self._shards[1], self._shards[2], self._shards[3]
        from jreshard.sharding.jax import addressable_order

        meta: dict[tuple[int, int], tuple[tuple[int, ...], Any, Any]] = {}
        keys: dict[Any, list[tuple[int, int]]] = {}
        landings: list[_Landing] = []
        for t, a in leaves:
            layout = self._dst_layout(t)
            for d in a.sharding.addressable_devices:
                r = self._rank_of(d)
                if r is not None:
                    meta[(t, r)] = (layout.box_of(r).shape, layout.np_dtype, d)
                    keys.setdefault(d, []).append((t, r))
            devices = tuple(addressable_order(a.sharding))
            ranks = tuple(self._rank_of(d) for d in devices)
            direct = a.sharding.is_fully_addressable and all(
                r is not None and d.platform == "cpu" for d, r in zip(devices, ranks, strict=True)
            )
            forms = tuple(meta[(t, r)][:2] if r is not None else ((), None) for r in ranks)
            landings.append(_Landing(devices, ranks, forms, direct))
        by_device = {d: (ks, [storage_bytes(meta[k][1], math.prod(meta[k][0])) for k in ks]) for d, ks in keys.items()}
        self._shards = (self._checked, meta, by_device, landings)
        return meta, by_device, landings

    def _sent_of(self, leaves: list[tuple[int, Any]]) -> list[tuple[tuple[int, int], ...]]:
        """Per leaf of a tree this process pushes, ``(position in its shard list, rank)`` of each shard it sends (its
        devices that are ranks of the leaf's source layout). Kept for the tree the declaration check matched last,
        as :meth:`_shards_of`."""
        if self._sent is not None and self._sent[0] is self._checked is not None:
            return self._sent[1]
        from jreshard.sharding.jax import addressable_order

        out = []
        for t, a in leaves:
            ranks = self._src_layouts[t].ranks
            picks = ((k, self._rank_of(d)) for k, d in enumerate(addressable_order(a.sharding)))
            out.append(tuple((k, r) for k, r in picks if r is not None and r in ranks))
        self._sent = (self._checked, out)
        return out

    def _made(
        self, t: int, a: Any, landing: _Landing, given: dict, meta: dict, backend: CpuBuffers, put: BatchedPut | None
    ) -> Any:
        """Leaf ``a``'s new array (tensor ``t``) over the shards this process received into ``given`` (once every
        process committed them): on CPU devices all of this process's, one batched put over the buffers
        (zero-copy where jax aliases them; a copy is as good, every byte has landed), else each shard imported
        through DLPack (:meth:`CpuBuffers.import_shard`) and the array assembled from them."""
        sharding, weak = a.sharding, bool(getattr(a, "weak_type", False))
        if put is not None and landing.direct:
            views = [
                given[(t, r)].view(dtype).reshape(shape)
                for r, (shape, dtype) in zip(landing.ranks, landing.forms, strict=True)
            ]
            return put.raw(put.aval(tuple(a.shape), a.dtype, weak), sharding, views, landing.devices, True)
        mine = {
            d: backend.import_shard(given[(t, r)], *meta[(t, r)])
            for d, r in zip(landing.devices, landing.ranks, strict=True)
            if r is not None
        }
        return assemble(tuple(a.shape), a.dtype, sharding, mine, weak)

    def _dst_layout(self, t: int) -> Any:
        """The destination layout of this side's tensor ``t``."""
        return self._tensors[t].dst if self._views is None else self._views.dsts[t]

    def _indexed(self, flat: Sequence[tuple[Any, Any]], treedef: Any) -> list[tuple[int, Any]]:
        """``(plan tensor index, leaf)`` of a flattened tree's ``(key path, leaf)`` pairs, in its own leaf
        order (tensors are matched by name; the names of the last tree structure are kept)."""
        import jax

        if self._order is None or self._order[0] != treedef:
            self._order = (treedef, [self._index[jax.tree_util.keystr(p) or "x"] for p, _ in flat])
        return list(zip(self._order[1], (a for _, a in flat), strict=True))

    def _rank_of(self, device: Device) -> int | None:
        try:
            return self._base + self._devices.index(device)
        except ValueError:
            return None

    def _local_check(self, flat: Sequence[tuple[Any, Any]], treedef: Any) -> str:
        """Why a flattened tree does not match this process's declaration (``""``: it does). A tree with the key
        of the last one that matched (:func:`~jreshard.refit.decl.tree_key`: its structure and each leaf's type,
        shape, dtype and sharding, everything the declaration says of it) matches without being declared again."""
        key = tree_key(flat, treedef)
        if key is not None and key == self._checked:
            return ""
        self._checked = None
        error = self._declared_check(flat)
        if not error:
            self._checked = key
        return error

    def _declared_check(self, flat: Sequence[tuple[Any, Any]]) -> str:
        try:
            now = declare_leaves(self.role.value, flat, self._devices, self._decl["domain"])
        except (ValueError, TypeError) as err:
            return f"{type(err).__name__}: {err}"
        if now["errors"]:
            return f"the parameters do not match this side's declaration: {now['errors']}"
        diff = leaf_differences(now["params"], self._decl["params"])
        if diff:
            return "the parameters do not match this side's declaration: " + "; ".join(diff)
        return ""

    def close(self) -> None:
        """Tell every other process this one left (a peer waiting on it raises at once), then release the
        communicators (MPI's kept, unfreed, when broken: a dead peer never answers). Between two launches
        the notice goes over the side channel, and never to a peer whose connection closed."""
        self._control.notify_closed()
        mpi = isinstance(self._wire, (MpiComm, LiveComm))
        if self._broken is None or not mpi:  # sockets close at once, MPI may block
            self._comm.close()
        if self._broken is None or not isinstance(self._control, Control):
            self._control.close()
