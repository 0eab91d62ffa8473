"""Views over named parameters: a program's recipe, and the JSON form programs exchange.

A server that refits from a trainer in another program holds none of the trainer's
arrays, so its recipe names them: :func:`param` is a view leaf that stands for the
source parameter of that name (its key path, as ``jax.tree_util.keystr`` spells it,
with the shape and dtype the server expects it to have). Views built on those leaves
(``concat``, ``astype``, ``quantize_fp8``, ...) are encoded as nested lists
(:func:`encode`): every process of both programs gets the same form, checks the names,
shapes and dtypes it reads against the trainer's declaration and rebuilds the same view
(:func:`decode`) over one leaf per name. Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jreshard.sharding.dtypes import dtype_name
from jreshard.types import DType, Json
from jreshard.views.algebra import Cast, Concat, Index, Leaf, Reshape, Stack, Transpose, View
from jreshard.views.quant import QuantScales, QuantWeights

__all__ = ["NamedParam", "decode", "encode", "param", "reads"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class NamedParam:
    """A source parameter named by a program's declaration (no data; two objects are two leaves).

    Attributes:
      name: the parameter's key path in the source tree (``jax.tree_util.keystr``).
      shape, dtype: what the recipe expects the source to declare.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str


def param(name: str, shape: Sequence[int], dtype: DType) -> Leaf:
    """A view leaf standing for the source parameter ``name`` of ``shape`` and ``dtype``.

    Args:
      name: the source leaf's key path, ``jax.tree_util.keystr(path)`` (``"['layers'][0]['q']"``).
      shape: the shape the source side declares for it (checked when the group forms).
      dtype: the dtype the source side declares for it (checked likewise).

    Raises:
      TypeError: ``name`` is not a string; ValueError: a negative extent in ``shape``.

    Example:
      >>> from jreshard import views
      >>> q = param("['q']", (8, 16), "float32")
      >>> views.astype(q, "bfloat16").dtype, q.shape
      ('bfloat16', (8, 16))
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"param: name={name!r} must be a source parameter's key path (a non-empty str)")
    dims = tuple(int(n) for n in shape)
    if any(n < 0 for n in dims):
        raise ValueError(f"param({name!r}): shape={dims} has a negative extent")
    return Leaf(NamedParam(name, dims, dtype_name(dtype)))


def _leaf_form(leaf: Leaf) -> list:
    src = leaf.source
    if not isinstance(src, NamedParam):
        raise TypeError(
            f"a recipe reads a {type(src).__name__} of shape {leaf.shape}; a program's recipe names the source's "
            "parameters instead: build it on jreshard.views.param(name, shape, dtype)"
        )
    return [src.name, list(src.shape), src.dtype]


def _lists(x: Json) -> Json:
    """A signature with its tuples as lists (what JSON gives back)."""
    if isinstance(x, (tuple, list)):
        return [_lists(v) for v in x]
    return x


def encode(view: View) -> list:
    """The JSON-able form of ``view`` (its composition; each leaf as ``[name, shape, dtype]``).

    Raises:
      TypeError: a leaf of ``view`` is not a :func:`param`.

    Example:
      >>> from jreshard import views
      >>> encode(views.astype(param("['w']", (2, 4), "float32"), "bfloat16"))
      ['cast', 'bfloat16', ['leaf', ["['w']", [2, 4], 'float32']]]
    """
    return _lists(view.signature(_leaf_form))


def reads(form: Json) -> list[tuple[str, tuple[int, ...], str]]:
    """Each source parameter ``(name, shape, dtype)`` the encoded view reads, in first-use order."""
    out: dict[str, tuple[str, tuple[int, ...], str]] = {}

    def walk(f: Json) -> None:
        if f[0] == "leaf":
            name, shape, dtype = f[1]
            out.setdefault(name, (name, tuple(shape), dtype))
            return
        for child in _children(f):
            walk(child)

    walk(form)
    return list(out.values())


def _children(f: Json) -> list:
    kind = f[0]
    if kind in ("cast", "transpose", "reshape"):
        return [f[2]]
    if kind == "index" or kind == "fp8":
        return [f[3]]
    if kind == "stack":
        return list(f[2])
    if kind == "concat":
        return list(f[3])
    raise ValueError(f"decode: {kind!r} is not a view in the encoded form {f!r}")


def decode(form: Json, leaf: Callable[[str], Leaf]) -> View:
    """The view ``form`` encodes, each leaf ``leaf(name)`` (the caller gives one leaf per name).

    Raises:
      ValueError: ``form`` is not what :func:`encode` writes; and whatever the view constructors
        raise when ``leaf`` returns leaves of other shapes than the recipe was built on.
    """
    kind = f"{form[0]}" if isinstance(form, list) and form else repr(form)
    if kind == "leaf":
        return leaf(form[1][0])
    if kind == "cast":
        return Cast(decode(form[2], leaf), form[1])
    if kind == "transpose":
        return Transpose(decode(form[2], leaf), form[1])
    if kind == "reshape":
        return Reshape(decode(form[2], leaf), form[1])
    if kind == "index":
        spans, keep = form[1], form[2]
        idx = tuple(slice(a, b) if k else a for (a, b), k in zip(spans, keep, strict=True))
        return Index(decode(form[3], leaf), idx)
    if kind == "stack":
        return Stack([decode(p, leaf) for p in form[2]], form[1])
    if kind == "concat":
        return Concat([decode(p, leaf) for p in form[3]], form[1], form[2])
    if kind == "fp8":
        part = {"weights": QuantWeights, "scales": QuantScales}.get(form[1])
        if part is None:
            raise ValueError(f"decode: fp8 part {form[1]!r} is neither 'weights' nor 'scales'")
        return part(decode(form[3], leaf), tuple(form[2]))
    raise ValueError(f"decode: {kind} is not a view in the encoded form {form!r}")
