"""What a transport tells the registry about itself: one :class:`TransportRecord` per transport folder.

A transport (``jreshard/mpi``, ``nccl``, ``nixl``, ``xla``, ``local``; the test transports
``recording`` and ``loopback`` of this folder) exports one record: its name, where it can move
arrays (:class:`Reach`), a probe that says why it cannot start here (``None``: it can), and how to
make what a call runs on: the engine's :class:`~jreshard.engine.comm.Communicator` and
:class:`~jreshard.engine.buffers.Buffers` (:attr:`TransportRecord.open`), or a runner that
replaces the engine (:attr:`TransportRecord.run`, XLA's). The registry
(:mod:`jreshard.call.routes`) is the one module above the transports that reads them; adding a
transport is one folder with one record, plus one line in the registry.

A record also carries its ``kit``: the parts programs (``RefitGroup``, the elastic trainer and
replicas) form groups from, typed by the transport (MPI's communicator and control plane, NIXL's
agent and process group).
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Generic, TypeVar

from jreshard.engine.buffers import Buffers
from jreshard.engine.comm import Communicator
from jreshard.options import Options

if TYPE_CHECKING:
    from jreshard.sharding.topology import Topology
    from jreshard.types import Device

__all__ = ["FindSpec", "ImportModule", "Opened", "Reach", "TransportRecord", "import_failure"]

ImportModule = Callable[[str], ModuleType]
"""Imports a module by name (``importlib.import_module``; tests pass a stand-in)."""

FindSpec = Callable[[str], object]
"""Finds a module without importing it (``importlib.util.find_spec``)."""

KitT = TypeVar("KitT")


class Reach(enum.Enum):
    """Where the devices of one transfer are, as far as a transport goes."""

    CPU_ONE_PROCESS = "CPU devices of one process"
    GPU_ONE_PROCESS = "GPUs of one process"
    CPU_PROCESSES = "CPU devices across the processes of one program"
    GPU_PROCESSES = "GPUs across the processes of one program"
    PROGRAMS = "between two programs (RefitGroup.connect, jreshard.elastic)"

    @classmethod
    def of(cls, *, on_gpus: bool, single_process: bool) -> Reach:
        """The reach of a transfer whose devices are (all) GPUs or not, in one process or not."""
        if single_process:
            return cls.GPU_ONE_PROCESS if on_gpus else cls.CPU_ONE_PROCESS
        return cls.GPU_PROCESSES if on_gpus else cls.CPU_PROCESSES


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Opened:
    """The engine's communicator and buffers for one call, and how to give them back.

    ``buffers`` is ``None`` where the engine's default (numpy on CPU) serves.
    """

    comm: Communicator
    buffers: Buffers | None = None
    close: Callable[[], object] = lambda: None


Open = Callable[["Mapping[int, Device]", bool, Options, "Topology | None"], Opened]
"""``open(devices, single_process, options, topology)``: ``devices`` maps every rank of the transfer
(``device.id``) to its jax device; ``single_process``: this process addresses all of them; ``topology``:
the caller's (``None``: one domain per process)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TransportRecord(Generic[KitT]):
    """One transport, as the registry knows it (final).

    Attributes:
      name: the name ``Options.backend`` and ``RefitGroup.connect(transport=...)`` use.
      summary: what it moves and over what, in a few words.
      serves: where it can move arrays; asking it for anything else raises before any byte moves.
      auto: where ``backend="auto"`` picks it (a subset of ``serves``; registry order breaks ties).
      probe: ``probe(import_module)`` is ``None`` when it can start here, else why not, in words.
      fix: ``fix(find_spec)``: what to install when the probe fails (``"pip install 'jreshard[mpi]'"``).
      open: makes the engine's communicator and buffers for one call (``None``: it runs no engine call).
      run: a runner that replaces the engine (``None``: it runs the engine's rounds).
      kit: what programs form groups from (``None``: it forms none).
      why_auto: why ``auto`` picks it, in words.
      auto_note: said when ``auto`` picked it and it cannot start.

    Example:
      >>> from jreshard.engine.loopback import RECORD
      >>> RECORD.name, Reach.CPU_ONE_PROCESS in RECORD.serves, RECORD.probe(__import__)
      ('loopback', True, None)
    """

    name: str
    summary: str
    serves: frozenset[Reach]
    auto: frozenset[Reach] = frozenset()
    probe: Callable[[ImportModule], str | None] = lambda import_module: None
    fix: Callable[[FindSpec], str] = lambda find_spec: ""
    open: Open | None = None
    run: Callable[..., list] | None = None
    kit: KitT | None = None
    why_auto: str = ""
    """Why ``auto`` picks it where it does, in words (the report's ``backend_reason``)."""
    auto_note: str = ""
    """Said when ``auto`` picked it and it cannot start (the alternative the caller may vouch for)."""

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower():
            raise ValueError(f"TransportRecord: name={self.name!r}; expected a lower-case name")
        if not self.auto <= self.serves:
            raise ValueError(
                f"TransportRecord {self.name!r}: auto={sorted(r.name for r in self.auto)} is not a subset of "
                f"serves={sorted(r.name for r in self.serves)}"
            )


def import_failure(module: str, import_module: ImportModule) -> tuple[ModuleType | None, str | None]:
    """``(module, None)`` when ``module`` imports, else ``(None, why)``.

    Warnings raised while importing (CuPy warns when libnccl is missing) are kept in the
    message instead of being shown; a module that imports but warned gives ``(module, warnings)``
    with the warnings in words.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mod = import_module(module)
        except (ImportError, OSError) as err:  # OSError: a shared library (libnccl, libmpi) that fails to load
            return None, f"{type(err).__name__}: {err}"
    said = "; ".join(" ".join(str(w.message).split()) for w in caught)
    return mod, (said or None)
