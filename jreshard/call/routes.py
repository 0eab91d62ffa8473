"""The transport registry: which transport runs a call, and why; the one module above the transports
that imports them.

Each transport folder exports one :class:`~jreshard.engine.record.TransportRecord` (its name, where
it serves, a probe saying why it cannot start, how to make its communicator and buffers or its
runner); :data:`REGISTRY` names them, one line each. Everything above the transports asks this
module by name: ``transfer`` (:func:`route`, :func:`run_engine`, :func:`runner`), the views across
processes (:func:`cluster_transport`), ``RefitGroup`` and the elastic pairs (:func:`kit`,
:func:`program_transport`).

``Options.backend`` names a transport or ``auto``. An explicit choice is checked and either runs
or raises :class:`BackendUnavailableError` naming what to install; it never falls back to another
transport. ``auto`` picks, in registry order, the first transport whose record lists the call's
:class:`~jreshard.engine.record.Reach` among its ``auto`` reaches:

1. ``local`` when every device of the transfer is addressable in this process (a
   single-controller program, CPU devices, one host's GPUs: direct copies);
2. ``nccl`` when the arrays are on CUDA GPUs across processes;
3. ``mpi`` when the arrays are on CPUs across processes.

and raises if that one cannot start. ``auto`` never picks ``xla`` (the plan compiled into one XLA
computation, :mod:`jreshard.xla`): on CPU in one process the direct copies were measured faster
(``benchmarks/transfer_bench.py``), and it has not been run on GPU or TPU. ``nixl`` serves two
programs (``RefitGroup``, :mod:`jreshard.elastic`), not a ``transfer`` call.

Arrays on GPUs across processes without an importable NCCL raise rather than quietly running MPI:
MPI on GPU buffers needs a CUDA-aware MPI, which only the caller can vouch for (pass
``backend="mpi"`` to say so).

Availability is probed by importing the module (``importlib``), through an ``import_module``
argument so tests can pass a stand-in importer. CuPy's ``cupy.cuda.nccl`` imports even when libnccl
is missing and declares that with ``available = False``, which is read too.

``loopback`` and ``recording`` (:mod:`jreshard.engine.loopback`, :mod:`jreshard.engine.recording`)
are registered the same way: the engine over copies in one process, for tests. They are no
``Options.backend`` value; :func:`run_engine` runs a call over any registered name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from jreshard.engine.buffers import Buffers
from jreshard.engine.comm import Communicator
from jreshard.engine.record import FindSpec, ImportModule, Reach, TransportRecord
from jreshard.errors import BackendUnavailableError
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder
from jreshard.sharding.topology import Topology
from jreshard.types import Array, Device, MpiCommunicator, PyTree, Sharding, Target, TreeLeaf

if TYPE_CHECKING:
    from jreshard.mpi.record import MpiKit
    from jreshard.nixl.record import NixlKit

__all__ = [
    "REGISTRY",
    "BackendChoice",
    "Placement",
    "cluster_transport",
    "kit",
    "program_transport",
    "route",
    "route_shardings",
    "run_engine",
    "runner",
    "select_backend",
    "target_shardings",
    "transfer_multiprocess",
    "transport",
]

# The registry: a transport's name and the module holding its record. Order is auto's preference.
REGISTRY: dict[str, str] = {
    "local": "jreshard.local.record",
    "nccl": "jreshard.nccl.record",
    "mpi": "jreshard.mpi.record",
    "xla": "jreshard.xla.record",
    "nixl": "jreshard.nixl.record",
    "loopback": "jreshard.engine.loopback",
    "recording": "jreshard.engine.recording",
}

# jax device platform names that mean an NVIDIA GPU.
_CUDA_PLATFORMS = frozenset({"gpu", "cuda"})


@overload
def transport(name: Literal["mpi"]) -> TransportRecord[MpiKit]: ...
@overload
def transport(name: Literal["nixl"]) -> TransportRecord[NixlKit]: ...
@overload
def transport(name: str) -> TransportRecord[Any]: ...
def transport(name: str) -> TransportRecord[Any]:
    """The record of the transport called ``name`` (its module imported on first use).

    Raises:
      ValueError: no transport of that name is registered (the message lists those that are).

    Example:
      >>> transport("loopback").name, sorted(r.name for r in transport("local").serves)
      ('loopback', ['CPU_ONE_PROCESS', 'GPU_ONE_PROCESS'])
    """
    return _record(str(name))


@functools.cache
def _record(name: str) -> TransportRecord[Any]:
    module = REGISTRY.get(name)
    if module is None:
        raise ValueError(f"transport: name={name!r} is not registered; registered: {sorted(REGISTRY)}")
    record: TransportRecord[Any] = importlib.import_module(module).RECORD
    if record.name != name:
        raise ValueError(f"transport: {module} registers {record.name!r} under the name {name!r}")
    return record


@overload
def kit(name: Literal["mpi"]) -> MpiKit: ...
@overload
def kit(name: Literal["nixl"]) -> NixlKit: ...
def kit(name: str) -> Any:
    """What programs (``RefitGroup``, the elastic trainer and replicas) form groups from over the transport
    ``name``: its record's ``kit``.

    Raises:
      ValueError: ``name`` is not registered, or forms no groups between programs.
    """
    record = transport(name)
    if record.kit is None:
        raise ValueError(f"kit: transport {name!r} forms no groups between programs")
    return record.kit


def program_transport(name: object, who: str, *, import_module: ImportModule = importlib.import_module) -> str:
    """``name`` checked as the transport two programs connect over (``RefitGroup.connect(transport=...)``).

    Returns:
      the name.

    Raises:
      ValueError: no registered transport of that name serves two programs (the message names those that do).
      BackendUnavailableError: it does, but cannot start here (the message says why and what to install).
    """
    serving = sorted(n for n in REGISTRY if Reach.PROGRAMS in transport(n).serves)
    if not isinstance(name, str) or name not in serving:
        raise ValueError(f"{who}: transport={name!r}; expected one of {serving}")
    record = transport(name)
    why = record.probe(import_module)
    if why is not None:
        raise BackendUnavailableError(
            f"{who}: transport {name!r} cannot start: {why}. The fix is {record.fix(importlib.util.find_spec)}"
        )
    return name


def runner(name: str) -> Callable[..., list[Array]]:
    """The runner that replaces the engine for the transport ``name`` (XLA's)."""
    run = transport(name).run
    if run is None:
        raise ValueError(f"runner: transport {name!r} runs the engine's rounds, not a runner of its own")
    return run


def cluster_transport(name: str = "mpi", timeout_s: float = 300.0) -> Communicator:
    """The communicator over every process of this jax cluster for the transport ``name`` (MPI's
    ``COMM_WORLD``): the default of the calls every process makes (views across processes,
    :func:`transfer_multiprocess`). The first call forms it: every process must make it within ``timeout_s``
    (else :class:`~jreshard.errors.TransferTimeoutError`)."""
    if name != "mpi":
        raise ValueError(f"cluster_transport: name={name!r}; the cluster-wide default transport is 'mpi'")
    return kit("mpi").world(timeout_s)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where a transfer's arrays live, as far as choosing a backend goes.

    Attributes:
      platforms: the jax platform names of every device taking part (``{"cpu"}``, ``{"gpu"}``).
      single_process: every device taking part is addressable from this process.

    Example:
      >>> Placement(platforms=frozenset({"gpu"}), single_process=False).reach
      <Reach.GPU_PROCESSES: 'GPUs across the processes of one program'>
    """

    platforms: frozenset[str]
    single_process: bool

    def __post_init__(self) -> None:
        p = frozenset(str(x) for x in self.platforms)
        if not p:
            raise ValueError("Placement: platforms is empty; a transfer takes part on at least one device")
        object.__setattr__(self, "platforms", p)

    @property
    def on_gpus(self) -> bool:
        """Whether every device is a CUDA GPU."""
        return self.platforms <= _CUDA_PLATFORMS

    @property
    def reach(self) -> Reach:
        """The :class:`~jreshard.engine.record.Reach` transports are matched against."""
        return Reach.of(on_gpus=self.on_gpus, single_process=self.single_process)

    @classmethod
    def of_devices(cls, devices: Iterable[Device], process_index: int) -> Placement:
        """From jax devices (anything with ``platform`` and ``process_index``).

        Args:
          devices: every device of the source and destination shardings.
          process_index: this process's ``jax.process_index()``.
        """
        devices = list(devices)
        return cls(
            platforms=frozenset(str(d.platform) for d in devices),
            single_process=all(int(d.process_index) == process_index for d in devices),
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BackendChoice:
    """The backend that will run a transfer (never ``AUTO``) and why, for the transfer's report."""

    backend: Backend
    reason: str


def _unavailable(record: TransportRecord[Any], why: str, import_module: ImportModule, find_spec: FindSpec) -> None:
    err = record.probe(import_module)
    if err is not None:
        raise BackendUnavailableError(
            f"backend {record.name!r} {why}cannot start: {err}. The fix is {record.fix(find_spec)}"
        )


def select_backend(
    requested: Backend | str,
    placement: Placement,
    *,
    import_module: ImportModule = importlib.import_module,
    find_spec: FindSpec = importlib.util.find_spec,
) -> BackendChoice:
    """Resolve ``requested`` (``Options.backend``) for arrays placed as ``placement``.

    Args:
      requested: a :class:`Backend` or its name.
      placement: the platforms of the devices and whether one process addresses them all.
      import_module: imports a module by name (``importlib.import_module``).
      find_spec: finds a module without importing it (``importlib.util.find_spec``);
        used only to name the right CUDA extra in an error message.

    Returns:
      The resolved backend and the reason, in words.

    Raises:
      BackendUnavailableError: the backend's module does not import (the message
        names the pip extra to install), or it does not serve arrays placed so (``local`` for
        devices that other processes own, ``nccl`` for arrays that are not on GPUs, ``nixl``
        for any ``transfer`` call).
      ValueError: ``requested`` is not a backend name.

    Example:
      >>> here = Placement(platforms=frozenset({"cpu"}), single_process=True)
      >>> select_backend("auto", here).backend
      <Backend.LOCAL: 'local'>
    """
    try:
        backend = requested if isinstance(requested, Backend) else Backend(str(requested).lower())
    except ValueError:
        raise ValueError(
            f"select_backend: requested={requested!r}; expected one of {[b.value for b in Backend]}"
        ) from None
    procs = "one process" if placement.single_process else "several processes"
    where = f"arrays on {sorted(placement.platforms)}, {procs}"
    reach = placement.reach
    if backend is Backend.AUTO:
        record = next(transport(b.value) for b in Backend if b is not Backend.AUTO and reach in transport(b.value).auto)
        note = f"; {record.auto_note}" if record.auto_note else ""
        _unavailable(record, f"(picked by 'auto' for {where}{note}) ", import_module, find_spec)
        return BackendChoice(backend=Backend(record.name), reason=f"auto: {record.why_auto} ({where})")
    record = transport(backend.value)
    if reach not in record.serves:
        can = [b.value for b in Backend if b is not Backend.AUTO and reach in transport(b.value).serves]
        serves = " and ".join(r.value for r in Reach if r in record.serves)
        raise BackendUnavailableError(
            f"backend {record.name!r} cannot start: it serves {serves} "
            f"({record.summary}), but the {where}. The fix is "
            + " or ".join(f"backend={c!r}" for c in can)
            + ", or 'auto'"
        )
    _unavailable(record, "", import_module, find_spec)
    return BackendChoice(backend=backend, reason=f"requested: {where}; {record.summary}")


def route(leaves: Sequence[TreeLeaf], targets: Sequence[Target], options: Options) -> tuple[BackendChoice, bool]:
    """The backend for a call's flat leaves and targets, and whether one process addresses every device.

    Args:
      leaves: the leaves of ``x``, flattened once by the front door.
      targets: per leaf, its target (a sharding, ``ShapeDtypeStruct``, array, or ``None``).
      options: ``options.backend`` is the caller's choice (``auto`` picks).
    """
    import jax

    shardings: set[Sharding] = set()
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            shardings.add(leaf.sharding)
    for t in targets:
        if isinstance(t, jax.Array):
            shardings.add(t.sharding)
        elif isinstance(t, jax.sharding.Sharding):
            shardings.add(t)
        elif isinstance(t, jax.ShapeDtypeStruct) and t.sharding is not None:
            shardings.add(t.sharding)
    return route_shardings(shardings, options)


def route_shardings(shardings: Iterable[Sharding], options: Options) -> tuple[BackendChoice, bool]:
    """:func:`route` of a call whose leaves and targets have ``shardings`` (the set of them)."""
    import jax

    devices: set[Device] = set()
    for sh in shardings:
        try:
            devices |= sh.device_set
        except Exception:  # an abstract mesh: the front door says so
            continue
    if not devices:  # nothing to place: an empty tree
        return BackendChoice(backend=Backend.LOCAL, reason="no devices take part (an empty pytree)"), True
    placement = Placement.of_devices(devices, jax.process_index())
    return select_backend(options.backend, placement), placement.single_process


def target_shardings(targets: Sequence[Target]) -> list[Sharding | None]:
    """Per flat target, its sharding (``None``: the leaf is kept)."""
    import jax

    from jreshard.call.front import target_sharding

    out = []
    for i, t in enumerate(targets):
        if t is None or isinstance(t, jax.sharding.Sharding):
            out.append(t)
        else:
            out.append(t.sharding if isinstance(t, jax.Array) else target_sharding(t, f"the target of leaf #{i}"))
    return out


def run_engine(
    leaves: Sequence[Array],
    shardings: Sequence[Sharding | None],
    choice: BackendChoice | str,
    single_process: bool,
    topology: Topology | None,
    options: Options,
    builder: ReportBuilder,
    into: Sequence[Array | None] | None = None,
) -> list[Array]:
    """Open the transport ``choice`` names (its record's communicator and buffers) and run the flat leaves
    through the engine: MPI across processes, NCCL, or stream-ordered in-process copies between GPUs in one
    process (not run on GPU); any registered name (``"loopback"``, ``"recording"``) runs the same way.
    ``into``: per leaf, the array ``transfer_into`` writes into (GPUs in one process).

    Returns the result leaves (the caller unflattens them).
    """
    from jreshard.engine.driver import run_leaves

    name = choice if isinstance(choice, str) else choice.backend.value
    opener = transport(name).open
    if opener is None:
        raise BackendUnavailableError(f"backend {name!r} runs no engine call (its record has no communicator)")
    devs = {d.id: d for leaf in leaves for d in leaf.sharding.device_set}
    devs.update({d.id: d for s in shardings if s is not None for d in s.device_set})
    opened = opener(devs, single_process, options, topology)
    try:
        out, _, _ = run_leaves(
            leaves,
            shardings,
            topology=topology,
            options=options,
            transport=opened.comm,
            buffers=opened.buffers,
            report=builder,
            into=into,
        )
        return out
    finally:
        opened.close()


def transfer_multiprocess(
    x: PyTree,
    target: PyTree,
    *,
    topology: Topology | None = None,
    options: Options | None = None,
    comm: MpiCommunicator | None = None,
    transport: Communicator | None = None,
    buffers: Buffers | None = None,
    report: ReportBuilder | None = None,
    details: bool = False,
    into: bool = False,
) -> PyTree:
    """``jreshard.transfer`` through the message-passing engine: every process of the cluster calls it.

    This is the case ``jax.device_put`` refuses: source and target shardings on different processes,
    on different devices of the same processes, or overlapping. See
    :mod:`jreshard.engine.driver` for what each process plans and gets.

    Args:
      x: a jax array or pytree of arrays (global arrays of the cluster).
      target: a sharding or pytree of shardings (or arrays / ShapeDtypeStructs carrying one);
        a ``None`` leaf keeps that leaf of ``x`` as it is.
      topology: ranks (device ids), domains and links; default one domain per process.
      options: chunking, staging and ``timeout_s`` (every wait on a peer).
      comm: the MPI communicator of the cluster's processes (default ``MPI.COMM_WORLD``).
      transport: another :class:`~jreshard.engine.comm.Communicator` to run over instead of MPI
        (on GPUs ``NcclComm``, not run on GPU; in one process ``LocalComm``); its local ranks must
        be this process's device ids that take part. ``comm`` is then unused.
      buffers: the buffer operations (default numpy on CPU; ``CupyBuffers`` on GPUs).
      report: a report builder the engine adds its phases, bytes and messages to.
      details: return ``(result, stats, rank_plans)`` instead of the result alone: what the engine
        did for this process's ranks, and their plans ``{rank: RankPlan}``. No process
        builds the whole plan; ``jreshard.plan`` gives it.
      into: ``target``'s leaves are arrays to write into (``transfer_into``, one process): each
        one owned exclusively is donated and written in place, the others get fresh buffers.

    Raises:
      TransferTimeoutError: a peer process did not answer within ``options.timeout_s``.
      LayoutMismatchError, LayoutError: the trees, shapes or dtypes disagree.
    """
    import jax

    from jreshard.call.front import flatten
    from jreshard.engine.driver import run_leaves

    if transport is None:
        timeout_s = (options or Options()).timeout_s
        transport = cluster_transport(timeout_s=timeout_s) if comm is None else kit("mpi").cluster(comm, timeout_s)
    leaves, treedef, targets = flatten(x, target, "into" if into else "target")
    out, stats, plans = run_leaves(
        leaves,
        target_shardings(targets),
        topology=topology,
        options=options,
        transport=transport,
        buffers=buffers,
        report=report,
        into=targets if into else None,
    )
    result = jax.tree_util.tree_unflatten(treedef, out)
    return (result, stats, plans) if details else result
