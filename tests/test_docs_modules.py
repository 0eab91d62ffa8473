"""Every module docs/architecture.md names exists: dotted names (``jreshard.call.routes``), paths
(``jreshard/engine/rounds.py``, ``engine/rounds.py::execute``, ``tests/test_layers.py``) and bare file
names (``pairsched.py``)."""

from __future__ import annotations

import ast
import pathlib
import re

from test_imports import ROOT

REPO = ROOT.parent
DOC = REPO / "docs" / "architecture.md"

_DOTTED = re.compile(r"\bjreshard(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_PATH = re.compile(r"(?<![\w/.])((?:[A-Za-z_]\w*/)*[A-Za-z_]\w*\.(?:py|c|pyi|h))(?!\w)(?:::([A-Za-z_]\w*))?")
_FOLDER = re.compile(r"(?<![\w/.])(jreshard(?:/[A-Za-z_]\w*)+)/?(?![\w.])")


def _defined(path: pathlib.Path) -> set[str]:
    """The names a module defines or re-exports at its top level."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                out |= {
                    e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)
                }
        elif isinstance(node, ast.ImportFrom):
            out |= {a.asname or a.name for a in node.names}
    return out


def _module_file(parts: list[str], root: pathlib.Path) -> pathlib.Path | None:
    base = root.joinpath(*parts[1:])
    for candidate in (base / "__init__.py", base.with_suffix(".py"), base.with_suffix(".pyi")):
        if candidate.is_file():
            return candidate
    return None


def missing_names(text: str, root: pathlib.Path = ROOT) -> list[str]:
    """The module names, paths and file names in ``text`` that do not exist under ``root`` (the package)."""
    repo = root.parent
    out = []
    for name in sorted(set(_DOTTED.findall(text))):
        parts = name.split(".")
        k = max((i for i in range(1, len(parts) + 1) if _module_file(parts[:i], root)), default=0)
        rest = parts[k:]
        if k == 0 or len(rest) > 1 or (rest and rest[0] not in _defined(_module_file(parts[:k], root))):  # type: ignore[arg-type]
            out.append(name)
    files = {p.name for p in root.rglob("*") if p.is_file()}
    for path, attr in sorted(set(_PATH.findall(text))):
        if "/" not in path:
            found = path in files
            where = next(iter(root.rglob(path)), None) if attr else None
        else:
            where = next((c for c in (repo / path, root / path) if c.is_file()), None)
            found = where is not None
        if not found or (attr and (where is None or attr not in _defined(where))):
            out.append(path + (f"::{attr}" if attr else ""))
    for folder in sorted(set(_FOLDER.findall(text))):
        if not (repo / folder).exists():
            out.append(folder)
    return out


def test_the_checker_finds_planted_names():
    text = (
        "`jreshard.call.routes` and `jreshard.call.routes.select_backend` exist; `jreshard.routes` and "
        "`jreshard.call.routes.route_everything` do not. `jreshard/engine/rounds.py`, `engine/rounds.py::execute`, "
        "`pairsched.py`, `tests/test_layers.py` and `jreshard/cuda/` exist; `jreshard/frontdoor.py`, "
        "`engine/rounds.py::run_all`, `transfer_views.py` and `jreshard/router/` do not."
    )
    assert missing_names(text) == [
        "jreshard.call.routes.route_everything",
        "jreshard.routes",
        "engine/rounds.py::run_all",
        "jreshard/frontdoor.py",
        "transfer_views.py",
        "jreshard/router",
    ]


def test_every_module_the_architecture_names_exists():
    text = DOC.read_text()
    assert "jreshard/call/routes.py" in text and "jreshard.call.routes" in text
    found = missing_names(text)
    assert not found, f"docs/architecture.md names modules that do not exist: {found}"
