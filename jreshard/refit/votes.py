"""What one process of a :class:`~jreshard.refit.group.RefitGroup` may tell the others, checked before it is used.

The group's processes agree through votes gathered from every process (``allgather`` over MPI or over the
authenticated control connections of two programs): a *begin* vote before any byte moves, a *commit* vote once the
bytes moved. A vote that cannot be one (not an object, a field of the wrong type, a role other than the one
declared, a version that is not an int) is a peer that does not speak the protocol, whether a bug, another version
of jreshard, or a process that holds the secret and cannot be trusted. Each check returns what is wrong, in words,
so the caller raises :class:`~jreshard.errors.PeerError` naming the process, through the paths every other failure
takes, before anything reads the vote: nothing moves after a malformed begin vote, and a malformed commit vote
fails the refit with every destination on its previous version.

Example:
  >>> begin_problem({"role": "source", "error": "", "version": 3, "nonce": "ab", "delta": False,
  ...                "delta_base": None}, "source") is None
  True
  >>> begin_problem({"role": "source", "error": "", "version": "3", "nonce": "ab", "delta": False,
  ...                "delta_base": None}, "source")
  "its version is '3', not an int"
  >>> commit_problem(["error"])
  'it is a list, not an object'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jreshard.net.channel import INT64, peer_int

__all__ = ["NONCE_CHARS", "begin_problem", "commit_problem", "declaration_problem"]

NONCE_CHARS = 128  # a refit's nonce is 32 hex digits (refit/boxes.py); anything past this is not one


def _int(v: Any) -> bool:
    """An int in int64's range (a NumPy one too: over MPI a declaration keeps the caller's), never a bool."""
    return peer_int(v, *INT64)


def _shape(v: Any) -> str:
    return type(v).__name__ if not isinstance(v, Mapping) else "object"


def _object(v: Any) -> str | None:
    return None if isinstance(v, Mapping) else f"it is a {_shape(v)}, not an object"


def _error(v: Mapping) -> str | None:
    if not isinstance(v.get("error"), str):
        return f"its error is {v.get('error')!r:.80}, not a string"
    return None


def begin_problem(vote: Any, role: str | None) -> str | None:
    """What is wrong with a peer's begin vote (``None``: nothing), ``role`` the role its process declared.

    A begin vote holds ``role``, ``error`` (a string, empty when the process can take part), ``version`` (an
    int from a source, ``None`` from a destination), a source's ``nonce`` (hex, the refit's MAC keys derive
    from it), and the delta fields: ``delta`` (bool), ``delta_base`` (an int or ``None``) and, while a
    process sends whole, ``delta_dense`` (``[changed fraction, refits left]``).
    """
    if (why := _object(vote)) is not None:
        return why
    if vote.get("role") != role:
        return f"its role is {vote.get('role')!r:.80}, but the process declared {role!r}"
    if (why := _error(vote)) is not None:
        return why
    version = vote.get("version")
    if role == "source":
        if not _int(version):
            return f"its version is {version!r:.80}, not an int"
        nonce = vote.get("nonce")
        if not isinstance(nonce, str) or not 0 < len(nonce) <= NONCE_CHARS:
            return f"its nonce is {nonce!r:.80}, not a string of 1 to {NONCE_CHARS} characters"
    elif version is not None:
        return f"a destination's vote names version {version!r:.80}"
    if not isinstance(vote.get("delta"), bool):
        return f"its delta is {vote.get('delta')!r:.80}, not true or false"
    base = vote.get("delta_base")
    if base is not None and not _int(base):
        return f"its delta_base is {base!r:.80}, neither an int nor null"
    dense = vote.get("delta_dense")
    if dense is not None and not (
        isinstance(dense, list)
        and len(dense) == 2
        and all(type(x) in (int, float) and math.isfinite(x) for x in dense)
        and 0 <= dense[0] <= 1
        and _int(dense[1])
        and dense[1] >= 0
    ):
        return f"its delta_dense is {dense!r:.80}, not [a changed fraction, refits left]"
    return None


def commit_problem(vote: Any) -> str | None:
    """What is wrong with a peer's commit vote (``None``: nothing): it holds ``error`` (a string, empty when the
    process's part of the refit went through) and, where the refit is digested, ``digests`` (checked where they
    are compared, :func:`jreshard.refit.boxes.streams_of`)."""
    return _object(vote) or _error(vote)


def declaration_problem(decl: Any) -> str | None:
    """What is wrong with the *form* of a peer's declaration (``None``: nothing); what it declares is compared with
    the others' by :func:`jreshard.refit.decl.validate`.

    A declaration holds ``role`` (``"source"`` or ``"destination"``), ``ndev`` (its device count), ``domain``
    (an int or ``None``), ``errors`` (strings), ``params`` (``[name, shape, dtype, boxes]`` per leaf, a box
    ``[device index, lo, hi]``) and, from a destination with views, ``recipe`` (an object).
    """
    if (why := _object(decl)) is not None:
        return why
    if decl.get("role") not in ("source", "destination"):
        return f"its role is {decl.get('role')!r:.80}, neither 'source' nor 'destination'"
    ndev = decl.get("ndev")
    if not _int(ndev) or not 0 <= ndev <= 1 << 20:
        return f"its device count is {ndev!r:.80}"
    if decl.get("domain") is not None and not _int(decl.get("domain")):
        return f"its domain is {decl.get('domain')!r:.80}, neither an int nor null"
    errors = decl.get("errors")
    if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
        return f"its errors are {errors!r:.80}, not a list of strings"
    params = decl.get("params")
    if not isinstance(params, list):
        return f"its params are a {_shape(params)}, not a list"
    for p in params:
        if not (isinstance(p, list) and len(p) == 4):
            return f"a parameter is {p!r:.80}, not [name, shape, dtype, boxes]"
        name, shape, dtype, bxs = p
        if not isinstance(name, str) or not isinstance(dtype, str):
            return f"parameter {name!r:.80} has dtype {dtype!r:.80}: a name and a dtype are strings"
        if not isinstance(shape, list) or not all(_int(n) and n >= 0 for n in shape):
            return f"parameter {name!r:.80} has shape {shape!r:.80}, not a list of sizes"
        if not isinstance(bxs, list):
            return f"parameter {name!r:.80} has boxes {bxs!r:.80}, not a list"
        for b in bxs:
            if not (
                isinstance(b, list)
                and len(b) == 3
                and _int(b[0])
                and 0 <= b[0] < ndev
                and all(isinstance(c, list) and len(c) == len(shape) and all(_int(x) for x in c) for c in b[1:])
            ):
                return f"parameter {name!r:.80} has a box {b!r:.80}, not [device index, lo, hi] of its rank"
    if "recipe" in decl and not isinstance(decl["recipe"], Mapping):
        return f"its recipe is a {_shape(decl['recipe'])}, not an object"
    return None
