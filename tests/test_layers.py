"""The runtime's layer order, encoded: data flows down, nothing imports up or sideways between transports.

    base -> sharding (and the view algebra) -> schedule -> engine -> transports -> routes / api / programs

``schedule/`` and ``engine/`` import no transport library (mpi4py, cupy, nixl) and no transport module;
only ``engine/`` builds and posts sends and receives.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
from test_imports import ROOT, import_graph

BASE, SHARDING, SCHEDULE, ENGINE, TRANSPORT, TOP = range(6)
_NAMES = ["base", "sharding", "schedule", "engine", "transport", "top"]

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
    # the view algebra, casts, quantisation and the lowering to pieces: numpy only
    ("jreshard.views", SHARDING),
    ("jreshard.schedule", SCHEDULE),
    ("jreshard.engine", ENGINE),
    ("jreshard.mpi", TRANSPORT),
    ("jreshard.nccl", TRANSPORT),
    ("jreshard.nixl", TRANSPORT),
    ("jreshard.xla", TRANSPORT),
    ("jreshard", TOP),
]
_TRANSPORTS = ("jreshard.mpi", "jreshard.nccl", "jreshard.nixl", "jreshard.xla")
_LIBRARIES = ("mpi4py", "cupy", "cupyx", "nixl", "nixl_cu12", "nixl_cu13", "pynvml")


# Modules placed by their exact name: the views facade re-exports the views' transfer (jreshard.call.views).
_EXACT = {"jreshard.views": TOP}


def layer(module: str) -> int:
    if module in _EXACT:
        return _EXACT[module]
    best = max((p for p, _ in _LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(_LAYERS)[best]


def _transport(module: str) -> str | None:
    return next((t for t in _TRANSPORTS if module == t or module.startswith(t + ".")), None)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a layer, or sideways from one transport to another."""
    out = []
    for a, deps in sorted(graph.items()):
        for b in sorted(deps):
            if layer(b) > layer(a):
                out.append(f"{a} ({_NAMES[layer(a)]}) imports {b} ({_NAMES[layer(b)]})")
            elif _transport(a) and _transport(b) and _transport(a) != _transport(b):
                out.append(f"{a} imports {b}: one transport imports another")
    return out


def test_the_checker_finds_planted_violations():
    g = {
        "jreshard.schedule.steps": {"jreshard.engine.rounds"},
        "jreshard.mpi.comm": {"jreshard.nccl.cupy_nccl"},
        "jreshard.engine.rounds": {"jreshard.schedule.steps", "jreshard.sharding.plan"},
        "jreshard.api": {"jreshard.engine.rounds", "jreshard.mpi.comm"},
    }
    assert violations(g) == [
        "jreshard.mpi.comm imports jreshard.nccl.cupy_nccl: one transport imports another",
        "jreshard.schedule.steps (schedule) imports jreshard.engine.rounds (engine)",
    ]


def test_layers_point_down():
    found = violations(import_graph())
    assert not found, "imports against the layer order:\n" + "\n".join(found)


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
