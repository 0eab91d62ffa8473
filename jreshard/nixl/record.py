"""The NIXL transport's record for the registry (:mod:`jreshard.call.routes`).

NIXL moves registered memory as one-sided WRITEs between two programs: a trainer and its servers
joined by ``RefitGroup.connect(transport="nixl")``, and the elastic trainer and its replicas.
It serves no ``transfer`` call (``Options(backend="nixl")`` raises, naming the backends that can).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

from jreshard.engine.record import ImportModule, Reach, TransportRecord, import_failure
from jreshard.nixl.agent import NixlAgent, import_nixl
from jreshard.nixl.comm import NixlComm
from jreshard.nixl.group import ProcessGroup

__all__ = ["RECORD", "NixlKit"]

MODULES = ("nixl_cu12", "nixl_cu13")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NixlKit:
    """What programs form NIXL groups from: the process's agent, the communicator over it, the
    authenticated process group of two programs (also the control plane of two MPI launches), and the
    NIXL module itself."""

    agent: type[NixlAgent] = NixlAgent
    comm: type[NixlComm] = NixlComm
    group: type[ProcessGroup] = ProcessGroup
    import_nixl: Callable[[], ModuleType] = import_nixl


def _probe(import_module: ImportModule) -> str | None:
    why = []
    for name in MODULES:
        mod, said = import_failure(name, import_module)
        if mod is not None:
            return None
        why.append(f"{name}: {said}")
    return f"importing NIXL failed ({'; '.join(why)})"


RECORD: TransportRecord[NixlKit] = TransportRecord(
    name="nixl",
    summary="one-sided NIXL WRITEs of registered memory between two programs",
    serves=frozenset({Reach.PROGRAMS}),
    probe=_probe,
    fix=lambda find_spec: "to install NIXL: pip install --no-deps nixl-cu12 (or nixl-cu13)",
    kit=NixlKit(),
)
