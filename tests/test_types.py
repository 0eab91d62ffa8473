"""Types at the boundaries: bare ``Any`` annotations counted and capped, no class name defined twice, the
control planes checked against their protocol."""

from __future__ import annotations

import ast
import collections
import inspect

from test_imports import ROOT

from jreshard.types import ControlPlane

MAX_BARE_ANY = 200


def _bare(t: ast.expr | None) -> bool:
    return (isinstance(t, ast.Name) and t.id == "Any") or (isinstance(t, ast.Constant) and t.value == "Any")


def bare_any(source: str) -> int:
    """How many annotations (of a parameter, a return, or an annotated assignment) are exactly ``Any``;
    ``Any`` inside another type (``dict[str, Any]``) is not counted."""
    n = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            n += sum(_bare(p.annotation) for p in params if p is not None) + _bare(node.returns)
        elif isinstance(node, ast.AnnAssign):
            n += _bare(node.annotation)
    return n


def test_the_counter_counts_only_bare_any():
    src = (
        "def f(x: Any, *a: Any, y: dict[str, Any], **k: 'Any') -> Any:\n"
        "    z: Any = 1\n"
        "    w: list[Any] = []\n"
        "class C:\n"
        "    v: Any\n"
        "    def m(self, q: Any | None) -> None: ...\n"
    )
    assert bare_any(src) == 6  # x, *a, **k, the return, z and v


def test_bare_any_annotations_are_capped():
    per_file = {p.relative_to(ROOT).as_posix(): bare_any(p.read_text()) for p in ROOT.rglob("*.py")}
    total = sum(per_file.values())
    worst = sorted(per_file.items(), key=lambda kv: -kv[1])[:8]
    assert total <= MAX_BARE_ANY, f"{total} bare Any annotations in jreshard/ (cap {MAX_BARE_ANY}); most in {worst}"


def defined_twice(files: dict[str, str]) -> dict[str, list[str]]:
    """Class names defined in more than one place, with where."""
    where = collections.defaultdict(list)
    for name, src in sorted(files.items()):
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(name)
    return {k: v for k, v in where.items() if len(v) > 1}


def test_the_duplicate_finder_finds_a_planted_one():
    files = {"a.py": "class Buffers: ...\nclass A: ...", "b.py": "class Buffers(abc.ABC): ...", "c.py": "B = 1"}
    assert defined_twice(files) == {"Buffers": ["a.py", "b.py"]}


def test_no_class_name_is_defined_twice():
    found = defined_twice({p.relative_to(ROOT).as_posix(): p.read_text() for p in ROOT.rglob("*.py")})
    assert not found, f"class names defined more than once in jreshard/: {found}"


def _members(protocol: type) -> dict[str, inspect.Signature | None]:
    out: dict[str, inspect.Signature | None] = {}
    for name in protocol.__annotations__:
        out[name] = None
    for name, value in vars(protocol).items():
        if callable(value) and not name.startswith("_"):
            out[name] = inspect.signature(value)
    return out


def _implements(cls: type, protocol: type) -> list[str]:
    """What ``cls`` lacks of ``protocol``: members, or parameters of its methods (by name and kind)."""
    missing = []
    for name, sig in _members(protocol).items():
        if sig is None:  # an attribute: set in __init__
            if name not in inspect.getsource(cls.__init__):
                missing.append(name)
            continue
        impl = getattr(cls, name, None)
        if impl is None:
            missing.append(name)
            continue
        have = {(p.name, p.kind) for p in inspect.signature(impl).parameters.values()}
        want = {(p.name, p.kind) for p in sig.parameters.values()}
        missing += [f"{name}({p})" for p, _ in sorted(want - have)]
    return missing


def test_the_protocol_check_finds_a_planted_gap():
    class Half:
        def __init__(self) -> None:
            self.rank = 0

        def allgather(self, obj, *, timeout_s): ...

        def close(self) -> None: ...

    assert _implements(Half, ControlPlane) == ["allgather(peers)", "allgather(stop)", "notify_closed"]


def test_the_control_planes_of_mpi_and_of_two_programs_implement_control_plane():
    from jreshard.mpi.control import Control
    from jreshard.nixl.group import ProcessGroup

    assert _implements(Control, ControlPlane) == []
    assert _implements(ProcessGroup, ControlPlane) == []
