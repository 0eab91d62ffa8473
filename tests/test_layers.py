"""The runtime's layer order, encoded: data flows down, nothing imports up or sideways between transports.

    base -> sharding (and the view algebra) -> schedule -> engine -> cuda (the device layer)
         -> transports (local, mpi, nccl, nixl, xla) -> call (api, the registry, the views facade) -> programs (refit,
         elastic, integrations) -> top (the package, the CLI, the model tables)

``schedule/`` and ``engine/`` import no transport library (mpi4py, cupy, nixl) and no transport module;
only ``engine/`` builds and posts sends and receives. Above the transports, only the registry
(``jreshard.call.routes``) imports one; ``cuda/`` imports none; no module imports a ``_private`` name
from another folder.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
from test_imports import ROOT, import_graph

BASE, SHARDING, SCHEDULE, ENGINE, DEVICE, TRANSPORT, CALL, PROGRAMS, TOP = range(9)
_NAMES = ["base", "sharding", "schedule", "engine", "device", "transport", "call", "programs", "top"]

# (module prefix, layer): the longest matching prefix decides.
_LAYERS = [
    # the shared secret, the authenticated control connections every cross-program transport uses, and
    # a port held for a jax coordinator until it has bound it
    ("jreshard.net", BASE),
    ("jreshard.errors", BASE),
    ("jreshard.options", BASE),
    ("jreshard.types", BASE),
    ("jreshard.sharding", SHARDING),
    ("jreshard.report", SHARDING),
    ("jreshard.cost", SHARDING),
    ("jreshard.baselines", SHARDING),
    ("jreshard.draw", SHARDING),
    # the view algebra, casts, quantisation and the lowering to pieces: numpy only
    ("jreshard.views", SHARDING),
    ("jreshard.schedule", SCHEDULE),
    ("jreshard.engine", ENGINE),
    # GPU buffers, streams, DLPack and kernels: below every transport that moves GPU memory
    ("jreshard.cuda", DEVICE),
    ("jreshard.local", TRANSPORT),
    ("jreshard.mpi", TRANSPORT),
    ("jreshard.nccl", TRANSPORT),
    ("jreshard.nixl", TRANSPORT),
    ("jreshard.xla", TRANSPORT),
    # one call of transfer / transfer_into: the front door, the registry, the views' transfer
    ("jreshard.call", CALL),
    ("jreshard.api", CALL),
    # programs that run many calls: refits, the elastic service, framework integrations
    ("jreshard.refit", PROGRAMS),
    ("jreshard.elastic", PROGRAMS),
    ("jreshard.integrations", PROGRAMS),
    # PyTorch tensors as destination memory, and a receiver over the endpoint (jreshard.refit.endpoint)
    ("jreshard.torch", PROGRAMS),
    ("jreshard", TOP),
]
_TRANSPORTS = ("jreshard.local", "jreshard.mpi", "jreshard.nccl", "jreshard.nixl", "jreshard.xla")
_LIBRARIES = ("mpi4py", "cupy", "cupyx", "nixl", "nixl_cu12", "nixl_cu13", "pynvml")
REGISTRY = "jreshard.call.routes"


# Modules placed by their exact name: the views facade re-exports the views' call (jreshard.call.views), so it
# sits with the calls, below the programs that use it (integrations.vllm) and the model tables (models.fused).
_EXACT = {"jreshard.views": CALL}


def layer(module: str) -> int:
    if module in _EXACT:
        return _EXACT[module]
    best = max((p for p, _ in _LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(_LAYERS)[best]


def _transport(module: str) -> str | None:
    return next((t for t in _TRANSPORTS if module == t or module.startswith(t + ".")), None)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a layer, sideways from one transport to another, or into a transport from
    above it anywhere but the registry."""
    out = []
    for a, deps in sorted(graph.items()):
        for b in sorted(deps):
            if layer(b) > layer(a):
                out.append(f"{a} ({_NAMES[layer(a)]}) imports {b} ({_NAMES[layer(b)]})")
            elif _transport(a) and _transport(b) and _transport(a) != _transport(b):
                out.append(f"{a} imports {b}: one transport imports another")
            elif _transport(b) and not _transport(a) and a != REGISTRY:
                out.append(f"{a} imports {b}: only the registry ({REGISTRY}) imports a transport")
    return out


def test_the_checker_finds_planted_violations():
    g = {
        "jreshard.schedule.steps": {"jreshard.engine.rounds"},
        "jreshard.mpi.comm": {"jreshard.nccl.cupy_nccl"},
        "jreshard.engine.rounds": {"jreshard.schedule.steps", "jreshard.sharding.plan"},
        "jreshard.api": {"jreshard.engine.rounds", "jreshard.mpi.comm"},
        "jreshard.call.routes": {"jreshard.mpi.record", "jreshard.nixl.record", "jreshard.local.record"},
        "jreshard.refit.group": {"jreshard.call.routes", "jreshard.nixl.group"},
        "jreshard.cuda.buffers": {"jreshard.nccl.cupy_nccl", "jreshard.engine.buffers"},
        "jreshard.nccl.cupy_nccl": {"jreshard.cuda.buffers"},
        "jreshard.call.front": {"jreshard.refit.decl"},
    }
    assert violations(g) == [
        "jreshard.api imports jreshard.mpi.comm: only the registry (jreshard.call.routes) imports a transport",
        "jreshard.call.front (call) imports jreshard.refit.decl (programs)",
        "jreshard.cuda.buffers (device) imports jreshard.nccl.cupy_nccl (transport)",
        "jreshard.mpi.comm imports jreshard.nccl.cupy_nccl: one transport imports another",
        "jreshard.refit.group imports jreshard.nixl.group: only the registry (jreshard.call.routes) "
        "imports a transport",
        "jreshard.schedule.steps (schedule) imports jreshard.engine.rounds (engine)",
    ]


def test_layers_point_down():
    found = violations(import_graph())
    assert not found, "imports against the layer order:\n" + "\n".join(found)


def test_every_transport_folder_is_registered_and_only_the_registry_imports_one():
    from jreshard.call.routes import REGISTRY as names

    folders = {t.rsplit(".", 1)[1] for t in _TRANSPORTS}
    assert folders <= set(names), f"transport folders without a registry line: {sorted(folders - set(names))}"
    importers = {a for a, deps in import_graph().items() for b in deps if _transport(b) and not _transport(a)}
    assert importers == {REGISTRY}


def test_cuda_imports_no_transport():
    found = {
        a: sorted(b for b in deps if _transport(b))
        for a, deps in import_graph().items()
        if a.startswith("jreshard.cuda")
    }
    assert found and not any(found.values()), found


def private_imports(files: dict[str, str]) -> list[str]:
    """Every ``_private`` name one module imports from a module of another folder.

    Args:
      files: module name -> its source (``jreshard.engine.rounds`` -> text); a package's ``__init__`` is
        named as the package.
    """
    packages = {m for m, src in files.items() if m + ".__init__" in files} | {
        m.rsplit(".", 1)[0] for m in files if "." in m
    }
    out = []
    for mod, src in sorted(files.items()):
        folder = mod if mod in packages else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(src)):
            found: list[tuple[str, str]] = []  # (the module imported from, the private name)
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = folder.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                found = [(base, a.name) for a in node.names]
                found += [(base.rsplit(".", 1)[0], p) for p in base.split(".")[-1:] if p.startswith("_")]
            elif isinstance(node, ast.Import):
                found = [(a.name.rsplit(".", 1)[0], a.name.rsplit(".", 1)[1]) for a in node.names if "." in a.name]
            for base, name in found:
                if not base.startswith("jreshard") or not name.startswith("_") or name.startswith("__"):
                    continue
                home = base if base in packages else base.rsplit(".", 1)[0]
                if home != folder:
                    out.append(f"{mod} imports {base}.{name}")
    return sorted(out)


def test_the_private_import_checker_finds_planted_ones():
    files = {
        "jreshard.engine.inprocess": "def _fresh(): ...",
        "jreshard.engine.rounds": "from jreshard.engine.inprocess import _fresh\nfrom . import _replay",
        "jreshard.call.views": (
            "from jreshard.engine.inprocess import _fresh, run_local\nimport jreshard.engine._strided"
        ),
        "jreshard.refit.group": "from ..engine import _replay\nfrom jreshard.engine._replay import run",
        "jreshard.schedule.steps": "from jreshard.schedule import _rows",
    }
    assert private_imports(files) == [
        "jreshard.call.views imports jreshard.engine._strided",
        "jreshard.call.views imports jreshard.engine.inprocess._fresh",
        "jreshard.refit.group imports jreshard.engine._replay",
        "jreshard.refit.group imports jreshard.engine._replay",
    ]


# Private names still imported across folders, each on its way out. Listed one by one, so that none is added,
# and checked to be still there, so that the list only shrinks. Empty now: keep it so.
_PENDING: set[str] = set()


def _sources() -> dict[str, str]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        out[".".join(parts)] = p.read_text()
    return {(m[: -len(".__init__")] if m.endswith(".__init__") else m): s for m, s in out.items()} | {
        m: "" for m in out if m.endswith(".__init__")
    }


def test_no_module_imports_a_private_name_of_another_folder():
    found = set(private_imports(_sources()))
    assert not found - _PENDING, f"private names imported across folders: {sorted(found - _PENDING)}"
    assert not _PENDING - found, f"fixed, drop from _PENDING: {sorted(_PENDING - found)}"


def _imported_libraries(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out & set(_LIBRARIES)


@pytest.mark.parametrize("folder", ["sharding", "schedule", "engine"])
def test_lower_layers_import_no_transport_library(folder):
    found = {str(p.relative_to(ROOT)): libs for p in (ROOT / folder).rglob("*.py") if (libs := _imported_libraries(p))}
    assert not found, f"jreshard/{folder} imports transport libraries: {found}"


# Building a send or receive operation, or completing a group of them.
_POSTS = re.compile(r"\b(SendOp|RecvOp)\(|\.exchange\(")


# Transports that wrap another: they forward the engine's groups, and post none of their own.
_WRAPPERS = ("mpi/live.py",)


def posters() -> set[str]:
    """The library files outside engine/ and the transports' own modules that post sends or receives."""
    out = set()
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith("engine/") or rel in _WRAPPERS:
            continue
        # (doctest lines are examples of the interface, not the library posting)
        lines = [ln for ln in p.read_text().splitlines() if not ln.lstrip().startswith((">>>", "..."))]
        code = "\n".join(ln.split("#")[0] for ln in lines)
        if _POSTS.search(code):
            out.add(rel)
    return out


def test_only_the_engine_posts_sends_and_receives():
    # Transports implement exchange() (NixlComm's WRITEs, MpiComm's Isend/Irecv); they do not build
    # operations of their own.
    found = posters()
    assert not found, f"sends and receives posted outside jreshard/engine: {sorted(found)}"
