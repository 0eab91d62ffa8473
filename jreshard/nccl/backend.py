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
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import warnings
from collections.abc import Callable, Iterable
from types import ModuleType

from jreshard.errors import BackendUnavailableError
from jreshard.options import Backend

__all__ = ["BackendChoice", "Placement", "cuda_extra", "select_backend"]

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


def cuda_extra(find_spec: FindSpec = importlib.util.find_spec) -> str:
    """The pip extra that installs CuPy and NCCL for the jax CUDA build in use.

    ``jreshard[cuda13]`` when the ``jax_cuda13_plugin`` package is present,
    ``jreshard[cuda12]`` when ``jax_cuda12_plugin`` is, else both are named.

    Example:
      >>> cuda_extra(lambda name: object() if name == "jax_cuda13_plugin" else None)
      "pip install 'jreshard[cuda13]'"
    """
    if find_spec("jax_cuda13_plugin") is not None:
        return "pip install 'jreshard[cuda13]'"
    if find_spec("jax_cuda12_plugin") is not None:
        return "pip install 'jreshard[cuda12]'"
    return "pip install 'jreshard[cuda12]' (CUDA 12) or 'jreshard[cuda13]' (CUDA 13)"


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
