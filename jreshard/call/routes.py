"""Backend selection: which transport runs a transfer, and why.

``Options.backend`` is one of ``auto``, ``local``, ``mpi``, ``nccl``, ``xla``. An explicit
choice is checked and either runs or raises :class:`BackendUnavailableError`
naming what to install; it never falls back to another backend. ``auto`` picks:

1. ``local`` when every device of the transfer is addressable in this process
   (a single-controller program, CPU devices, one host's GPUs: direct copies);
2. ``nccl`` when the arrays are on CUDA GPUs and ``cupy.cuda.nccl`` imports;
3. ``mpi`` when the arrays are on CPUs and ``mpi4py.MPI`` imports.

``auto`` never picks ``xla`` (the plan compiled into one XLA program, :mod:`jreshard.xla`): on
CPU in one process the direct copies were measured faster (``benchmarks/transfer_bench.py``),
and it has not been run on GPU or TPU. ``xla`` runs only when asked for; it needs nothing but jax.

Arrays on GPUs across processes without an importable NCCL raise rather than
quietly running MPI: MPI on GPU buffers needs a CUDA-aware MPI, which only the
caller can vouch for (pass ``backend="mpi"`` to say so).

Availability is probed by importing the module (``importlib``), through an
``import_module`` argument so tests can pass a stand-in importer. CuPy's
``cupy.cuda.nccl`` imports even when libnccl is missing and declares that with
``available = False``, which is read too.

The router (:func:`route`) reads where the arrays live, picks the backend and says why;
:func:`run_engine` builds the message-passing transport it picked (MPI, NCCL, or local copies
between GPUs in one process) and hands it to the engine's multi-process driver
(:func:`jreshard.engine.driver.transfer_multiprocess`). Nothing below this module imports MPI,
CuPy or NCCL by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import warnings
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import jax

from jreshard.errors import BackendUnavailableError, cuda_extra
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder
from jreshard.sharding.topology import Topology

__all__ = [
    "BackendChoice",
    "Placement",
    "route",
    "run_engine",
    "select_backend",
    "target_shardings",
    "transfer_multiprocess",
]

ImportModule = Callable[[str], ModuleType]
FindSpec = Callable[[str], object]

# jax device platform names that mean an NVIDIA GPU.
_CUDA_PLATFORMS = frozenset({"gpu", "cuda"})
NCCL_MODULE = "cupy.cuda.nccl"
MPI_MODULE = "mpi4py.MPI"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where a transfer's arrays live, as far as choosing a backend goes.

    Attributes:
      platforms: the jax platform names of every device taking part (``{"cpu"}``, ``{"gpu"}``).
      single_process: every device taking part is addressable from this process.

    Example:
      >>> Placement(platforms=frozenset({"gpu"}), single_process=False).on_gpus
      True
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

    @classmethod
    def of_devices(cls, devices: Iterable[object], process_index: int) -> Placement:
        """From jax devices (anything with ``platform`` and ``process_index``).

        Args:
          devices: every device of the source and destination shardings.
          process_index: this process's ``jax.process_index()``.
        """
        devices = list(devices)
        return cls(
            platforms=frozenset(str(d.platform) for d in devices),  # type: ignore[attr-defined]
            single_process=all(int(d.process_index) == process_index for d in devices),  # type: ignore[attr-defined]
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BackendChoice:
    """The backend that will run a transfer (never ``AUTO``) and why, for the transfer's report."""

    backend: Backend
    reason: str


def _probe(module: str, import_module: ImportModule) -> str | None:
    """``None`` when ``module`` imports (and, for NCCL, loaded its library), else why not, in words.

    Warnings raised while importing (CuPy warns when libnccl is missing) are kept
    for the message instead of being shown.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mod = import_module(module)
        except (ImportError, OSError) as err:  # OSError: a shared library (libnccl, libmpi) that fails to load
            return f"{type(err).__name__}: {err}"
    if module == NCCL_MODULE and mod.available is not True:
        # cupy.cuda.nccl imports without libnccl and declares it with ``available = False``.
        said = "; ".join(" ".join(str(w.message).split()) for w in caught)
        return f"{NCCL_MODULE}.available is False ({said or 'libnccl was not loaded'})"
    return None


def _require_nccl(import_module: ImportModule, find_spec: FindSpec, why: str) -> None:
    err = _probe(NCCL_MODULE, import_module)
    if err is not None:
        raise BackendUnavailableError(
            f"backend 'nccl' {why}cannot start: importing {NCCL_MODULE} failed ({err}). "
            f"The fix is to install CuPy with NCCL: {cuda_extra(find_spec)}"
        )


def _require_mpi(import_module: ImportModule, why: str) -> None:
    err = _probe(MPI_MODULE, import_module)
    if err is not None:
        raise BackendUnavailableError(
            f"backend 'mpi' {why}cannot start: importing {MPI_MODULE} failed ({err}). "
            "The fix is to install mpi4py and an MPI: pip install 'jreshard[mpi]'"
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
      requested: ``Backend.AUTO``/``LOCAL``/``MPI``/``NCCL``/``XLA`` or its name.
      placement: the platforms of the devices and whether one process addresses them all.
      import_module: imports a module by name (``importlib.import_module``).
      find_spec: finds a module without importing it (``importlib.util.find_spec``);
        used only to name the right CUDA extra in an error message.

    Returns:
      The resolved backend and the reason, in words.

    Raises:
      BackendUnavailableError: the backend's module does not import (the message
        names the pip extra to install), ``local`` was asked for devices that
        other processes own, or ``nccl`` was asked for arrays that are not on GPUs.
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

    if backend is Backend.LOCAL:
        if not placement.single_process:
            raise BackendUnavailableError(
                f"backend 'local' cannot start: it copies between buffers of one process, but the {where}. "
                "The fix is backend='nccl' (GPUs) or backend='mpi', or 'auto'"
            )
        return BackendChoice(backend=Backend.LOCAL, reason=f"requested: {where}")
    if backend is Backend.NCCL:
        if not placement.on_gpus:
            raise BackendUnavailableError(
                f"backend 'nccl' cannot start: NCCL moves CUDA device buffers, but the {where}. "
                "The fix is backend='mpi' or 'local', or 'auto'"
            )
        _require_nccl(import_module, find_spec, "")
        return BackendChoice(backend=Backend.NCCL, reason=f"requested: {where}")
    if backend is Backend.MPI:
        _require_mpi(import_module, "")
        return BackendChoice(backend=Backend.MPI, reason=f"requested: {where}")
    if backend is Backend.XLA:
        return BackendChoice(backend=Backend.XLA, reason=f"requested: {where}; one XLA program over the devices")

    # AUTO
    if placement.single_process:
        return BackendChoice(
            backend=Backend.LOCAL,
            reason=f"auto: every device is in this process ({where}); direct copies, measured faster than "
            "backend 'xla' on CPU (benchmarks/transfer_bench.py)",
        )
    if placement.on_gpus:
        _require_nccl(
            import_module,
            find_spec,
            f"(picked by 'auto' for {where}; pass backend='mpi' if your MPI is CUDA-aware) ",
        )
        return BackendChoice(backend=Backend.NCCL, reason=f"auto: {where} and {NCCL_MODULE} imports")
    _require_mpi(import_module, f"(picked by 'auto' for {where}) ")
    return BackendChoice(backend=Backend.MPI, reason=f"auto: {where} and {MPI_MODULE} imports")


def route(leaves: Sequence[Any], targets: Sequence[Any], options: Options) -> tuple[BackendChoice, bool]:
    """The backend for a call's flat leaves and targets, and whether one process addresses every device.

    Args:
      leaves: the leaves of ``x``, flattened once by the front door.
      targets: per leaf, its target (a sharding, ``ShapeDtypeStruct``, array, or ``None``).
      options: ``options.backend`` is the caller's choice (``auto`` picks).
    """
    shardings = set()
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
    devices: set = set()
    for sh in shardings:
        try:
            devices |= sh.device_set
        except Exception:  # an abstract mesh: the front door says so
            continue
    if not devices:  # nothing to place: an empty tree
        return BackendChoice(backend=Backend.LOCAL, reason="no devices take part (an empty pytree)"), True
    placement = Placement.of_devices(devices, jax.process_index())
    return select_backend(options.backend, placement), placement.single_process


def target_shardings(targets: Sequence[Any]) -> list[Any]:
    """Per flat target, its sharding (``None``: the leaf is kept)."""
    from jreshard.call.front import target_sharding

    out = []
    for i, t in enumerate(targets):
        if t is None or isinstance(t, jax.sharding.Sharding):
            out.append(t)
        else:
            out.append(t.sharding if isinstance(t, jax.Array) else target_sharding(t, f"the target of leaf #{i}"))
    return out


def run_engine(
    leaves: Sequence[Any],
    shardings: Sequence[Any],
    choice: BackendChoice,
    single_process: bool,
    topology: Topology | None,
    options: Options,
    builder: ReportBuilder,
    into: Sequence[Any] | None = None,
) -> list[Any]:
    """Build the message-passing transport ``choice`` names and run the flat leaves through the engine:
    MPI across processes, NCCL, or stream-ordered local copies between GPUs in one process (not run
    on GPU). ``into``: per leaf, the array ``transfer_into`` writes into (GPUs in one process).

    Returns the result leaves (the caller unflattens them).
    """
    from jreshard.engine.driver import run_leaves

    def run(transport: Any, buffers: Any = None) -> list[Any]:
        out, _, _ = run_leaves(
            leaves,
            shardings,
            topology=topology,
            options=options,
            transport=transport,
            buffers=buffers,
            report=builder,
            into=into,
        )
        return out

    if choice.backend is Backend.MPI:
        from jreshard.mpi.cluster import cluster_comm
        from jreshard.mpi.comm import import_mpi

        return run(cluster_comm(import_mpi().COMM_WORLD))
    devs = {d.id: d for leaf in leaves for d in leaf.sharding.device_set}
    devs.update({d.id: d for s in shardings if s is not None for d in s.device_set})
    if choice.backend is Backend.LOCAL:  # GPUs in one process: the engine over stream-ordered local copies
        from jreshard.nccl.gpu_buffers import CupyBuffers
        from jreshard.nccl.gpu_local import CupyLocalComm

        gpu = CupyBuffers(timeout_s=options.timeout_s)
        try:
            return run(CupyLocalComm(sorted(devs), gpu), gpu)
        finally:
            gpu.release()
    comm = _nccl_comm(devs, single_process, options)
    buffers = comm.buffers(timeout_s=options.timeout_s)  # stream-ordered: one host wait, at the end
    try:
        return run(comm, buffers)
    finally:
        buffers.synchronize()
        buffers.release()


def _nccl_comm(devs: dict[int, Any], single_process: bool, options: Options) -> Any:
    """``backend="nccl"``'s transport: with every GPU in this process (an in-process rendezvous), or
    across the processes of a ``jax.distributed`` cluster (the unique id shared through the cluster's
    key-value store; every process calls ``transfer``). Not run on GPU."""
    from jreshard.nccl.cupy_nccl import NcclComm
    from jreshard.nccl.rendezvous import KeyValueRendezvous

    mine = devs if single_process else {r: d for r, d in devs.items() if d.process_index == jax.process_index()}
    if not mine:
        raise BackendUnavailableError(
            f"backend 'nccl': process {jax.process_index()} holds none of the {len(devs)} devices of this transfer, "
            "and an NCCL communicator needs at least one; the fix is to call transfer only on the processes "
            "that take part, or backend='mpi'"
        )
    rendezvous = (
        KeyValueRendezvous.in_process()
        if single_process
        else KeyValueRendezvous.from_jax(namespace="jreshard.transfer")
    )
    return NcclComm(
        devices={r: r for r in devs},
        local_devices={r: int(d.local_hardware_id) for r, d in mine.items()},
        rendezvous=rendezvous,
        namespace="jreshard.transfer",
        timeout_s=options.timeout_s,
    )


def transfer_multiprocess(
    x: Any,
    target: Any,
    *,
    topology: Topology | None = None,
    options: Options | None = None,
    comm: Any = None,
    transport: Any = None,
    buffers: Any = None,
    report: ReportBuilder | None = None,
    details: bool = False,
    into: bool = False,
) -> Any:
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
      details: return ``(result, stats, programs)`` instead of the result alone: what the engine
        did for this process's ranks, and their programs ``{rank: RankProgram}``. No process
        builds the whole plan; ``jreshard.plan`` gives it.
      into: ``target``'s leaves are arrays to write into (``transfer_into``, one process): each
        one owned exclusively is donated and written in place, the others get fresh buffers.

    Raises:
      TransferTimeoutError: a peer process did not answer within ``options.timeout_s``.
      LayoutMismatchError, LayoutError: the trees, shapes or dtypes disagree.
    """
    from jreshard.call.front import flatten
    from jreshard.engine.driver import run_leaves

    if transport is None:
        from jreshard.mpi.cluster import cluster_comm
        from jreshard.mpi.comm import import_mpi

        MPI = import_mpi()
        transport = cluster_comm(MPI.COMM_WORLD if comm is None else comm)
    leaves, treedef, targets = flatten(x, target, "into" if into else "target")
    out, stats, programs = run_leaves(
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
    return (result, stats, programs) if details else result
