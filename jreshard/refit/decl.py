"""The declarations a RefitGroup exchanges, and their validation (pure functions, no MPI).

A process's declaration is a JSON-able dict::

  {"role": "source" | "destination", "ndev": number of devices it drives, "domain": int | None,
   "params": [[name, shape, dtype, [[local device index, lo, hi], ...]], ...], "errors": [...],
   "recipe": {destination name: encoded view}}   # a destination's, optional

Ranks are numbered sources first, then destinations, process by process, each
process's devices in the order it declared them. Every process runs
:func:`validate` on the same gathered declarations, so all report the same problems.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jreshard.errors import JReshardError, LayoutError
from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import dtype_name
from jreshard.sharding.layout import Layout
from jreshard.types import PyTree, TreeDef

__all__ = [
    "GroupViews",
    "declare_leaves",
    "declare_local",
    "deleted_leaf",
    "group_layouts",
    "group_views",
    "leaf_differences",
    "needs_views",
    "problems",
    "validate",
    "view_problems",
]

_DEFAULT_DOMAIN = 1 << 20  # + process index: every process its own domain unless told


def declare_local(role: str, params: PyTree, devices: Sequence[Any], domain: int | None, recipe: PyTree = None) -> dict:
    """This process's declaration of ``params`` (jax arrays / ShapeDtypeStructs with shardings).

    ``recipe`` (a destination's): a pytree with the structure of ``params`` whose leaves are views
    over :func:`jreshard.views.param` leaves, or ``None`` where the destination leaf is the source
    leaf of its own name; the declaration holds it as
    ``"recipe": {destination name: encoded view}`` (:func:`jreshard.views.named.encode`).
    """
    import jax

    decl = declare_leaves(role, jax.tree_util.tree_flatten_with_path(params)[0], devices, domain)
    if recipe is not None:
        decl["recipe"] = _recipe(params, recipe, decl["errors"])
    return decl


def declare_leaves(role: str, leaves: Sequence[tuple[Any, Any]], devices: Sequence[Any], domain: int | None) -> dict:
    """:func:`declare_local` of a tree already flattened: ``leaves`` are its ``(key path, leaf)`` pairs."""
    import jax

    local = list(jax.local_devices())
    errors: list[str] = []
    for d in devices:
        if d not in local:
            errors.append(f"declares device {d!r} that it does not have (its devices: {[str(x) for x in local]})")
    out = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path) or "x"
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not hasattr(leaf, "shape"):
            errors.append(
                f"leaf {name} is {type(leaf).__name__}; expected a jax.Array or ShapeDtypeStruct with a sharding"
            )
            continue
        why = _dtype_problem(leaf.dtype)
        if why is not None:
            errors.append(f"leaf {name} {why}")
            continue
        shape = tuple(int(n) for n in leaf.shape)
        try:
            lay = Layout.from_sharding(sharding, shape, leaf.dtype)
        except LayoutError as err:  # (unreduced or manual axes, a shape the sharding cannot hold): said everywhere
            errors.append(f"leaf {name}: {err}")
            continue
        boxes = []
        for d in sorted(sharding.addressable_devices, key=lambda d: d.id):
            if d not in devices:
                errors.append(f"leaf {name} has a shard on {d}, which this process does not declare as its device")
                continue
            b = lay.box_of(d.id)
            boxes.append([devices.index(d), list(b.lo), list(b.hi)])
        out.append([name, list(shape), dtype_name(leaf.dtype), boxes])
    return {"role": role, "ndev": len(devices), "domain": domain, "params": out, "errors": errors}


def tree_key(flat: Sequence[tuple[Any, Any]], treedef: Any) -> tuple | None:
    """What a declaration reads of a flattened tree: its structure (its leaves' names) and each leaf's type,
    shape, dtype and sharding; ``None`` where a leaf has no shape, dtype or sharding. Two trees with one key declare
    alike, so a tree with the key of one that matched a declaration matches it too (what can change under one key,
    a leaf deleted since, is checked apart: :func:`deleted_leaf`)."""
    leaves = []
    for _, a in flat:
        try:
            leaves.append((type(a), a.shape, a.dtype, a.sharding))
        except AttributeError:
            return None
    return treedef, tuple(leaves)


def deleted_leaf(leaves: Sequence[tuple[Any, Any]]) -> str:
    """Why a source tree cannot be read (``""``: it can): a leaf deleted or donated since it was made. ``leaves``
    are ``(key path or name, leaf)`` pairs. A declaration reads shapes, dtypes and shardings, which a deleted array
    still has: a source checks this every call, before anything moves."""
    import jax

    for path, a in leaves:
        if isinstance(a, jax.Array) and a.is_deleted():
            name = path if isinstance(path, str) else jax.tree_util.keystr(path) or "x"
            return f"leaf {name} has been deleted or donated; the fix is to push live arrays"
    return ""


def _dtype_problem(dtype: Any) -> str | None:
    """Why a leaf of ``dtype`` cannot be declared for a refit between programs, in words (``None``: it can).

    A refit moves whole bytes of plain arrays; in one process ``jreshard.transfer`` repacks the others on their
    devices (:mod:`jreshard.call.repack`), which the declarations of two programs do not describe.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jreshard.sharding.dtypes import packed_bits

    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return (
            f"is a {dtype} array (typed PRNG keys or another extended dtype), and a refit between programs moves "
            "plain arrays: refit jax.random.key_data(keys) and wrap it back with jax.random.wrap_key_data(data, "
            "impl=...) after the pull"
        )
    bits = packed_bits(np.dtype(dtype))
    if bits is not None:
        u = jnp.dtype(f"uint{bits}").name
        return (
            f"is {np.dtype(dtype).name}, which devices hold {8 // bits} values a byte, and a refit between programs "
            f"moves whole bytes: refit it one value a byte, jax.lax.bitcast_convert_type(x, jnp.{u}).astype("
            f"jnp.uint8), and narrow it back after the pull, jax.lax.bitcast_convert_type(y.astype(jnp.{u}), "
            f"jnp.{np.dtype(dtype).name})"
        )
    return None


def _up_to(treedef: TreeDef, tree: PyTree) -> list[Any]:
    """``tree`` flattened up to ``treedef``'s leaves (``None`` stays a leaf there)."""
    return list(treedef.flatten_up_to(tree))


def _recipe(params: PyTree, recipe: PyTree, errors: list[str]) -> dict[str, list]:
    """``{destination name: encoded view}`` of ``recipe`` (its problems appended to ``errors``)."""
    import jax

    from jreshard.views.algebra import View
    from jreshard.views.named import encode

    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    try:
        views = _up_to(treedef, recipe)
    except (ValueError, TypeError) as err:
        errors.append(f"the recipe does not have the structure of the parameters: {err}")
        return {}
    out = {}
    for (path, _), v in zip(leaves, views, strict=True):
        name = jax.tree_util.keystr(path) or "x"
        if v is None:
            continue
        if not isinstance(v, View):
            errors.append(f"recipe leaf {name} is {type(v).__name__}; expected a view over jreshard.views.param leaves")
            continue
        try:
            out[name] = encode(v)
        except TypeError as err:
            errors.append(f"recipe leaf {name}: {err}")
    return out


def _sides(decls: Mapping[int, dict]) -> dict[str, list[int]]:
    return {r: sorted(p for p, d in decls.items() if d["role"] == r) for r in ("source", "destination")}


def _who(p: int, decls: Mapping[int, dict]) -> str:
    return f"process {p} ({decls[p]['role']})"


def validate(decls: Mapping[int, dict], *, views: bool = False) -> list[str]:
    """Every problem with the gathered declarations ``{process: declaration}``; empty when they agree.

    ``views=False``: both sides declare the same names, shapes and dtypes. ``views=True``: a destination
    leaf may differ from its source in dtype (a cast) or be made by the destination's recipe
    (:func:`view_problems`); :func:`group_views` then gives what moves.
    """
    errors = [f"{_who(p, decls)}: {e}" for p, d in sorted(decls.items()) for e in d["errors"]]
    sides = _sides(decls)
    for role, procs in sides.items():
        if not procs:
            errors.append(f"no process declared the {role} role")
    if not all(sides.values()):
        return errors
    ref: dict[str, dict[str, tuple]] = {}
    for role, procs in sides.items():
        first = procs[0]
        ref[role] = {n: (tuple(s), dt) for n, s, dt, _ in decls[first]["params"]}
        for p in procs[1:]:
            mine = {n: (tuple(s), dt) for n, s, dt, _ in decls[p]["params"]}
            if mine != ref[role]:
                errors.append(
                    f"{_who(p, decls)} declares {_diff(mine, ref[role])} unlike {_who(first, decls)} of its own side"
                )
    src, dst = ref["source"], ref["destination"]
    if views:
        errors += _recipes_agree(decls, sides["destination"]) + view_problems(src, dst, _recipe_of(decls))
        if not errors:
            try:
                group_views(decls)
            except (JReshardError, ValueError, TypeError, KeyError, IndexError) as err:
                errors.append(f"the declared layouts cannot be planned: {err}"[:500])
        return errors
    if any("recipe" in decls[p] for p in sides["destination"]):
        errors.append("the destination side declares a recipe, which this group does not take")
    for n in sorted(set(src) - set(dst)):
        errors.append(f"parameter {n} is declared by the source side only")
    for n in sorted(set(dst) - set(src)):
        errors.append(f"parameter {n} is declared by the destination side only")
    for n in sorted(set(src) & set(dst)):
        (ss, sd), (ds, dd) = src[n], dst[n]
        if ss != ds:
            errors.append(f"parameter {n}: source shape {ss} != destination shape {ds}")
        if sd != dd:
            errors.append(f"parameter {n}: source dtype {sd} != destination dtype {dd}")
    if errors:  # the layouts are only planned once everything above agrees
        return errors
    try:
        names, pairs, domains, _, _ = group_layouts(decls)
        from jreshard.sharding.planner import prepare_pairs
        from jreshard.sharding.topology import Topology

        # What planning checks, without the whole plan: each process later plans only its own ranks.
        prepare_pairs(pairs, Topology.from_domains(domains, devices={r: r for r in domains}), None, names)
    except JReshardError as err:
        errors.append(f"the declared layouts cannot be planned: {err}")
    return errors


def _recipe_of(decls: Mapping[int, dict]) -> dict[str, list]:
    dst = _sides(decls)["destination"]
    return dict(decls[dst[0]].get("recipe") or {}) if dst else {}


def _recipes_agree(decls: Mapping[int, dict], procs: Sequence[int]) -> list[str]:
    first = decls[procs[0]].get("recipe") or {}
    return [
        f"{_who(p, decls)} declares another recipe than {_who(procs[0], decls)} of its own side"
        for p in procs[1:]
        if (decls[p].get("recipe") or {}) != first
    ]


def view_problems(
    src: Mapping[str, tuple[tuple[int, ...], str]],
    dst: Mapping[str, tuple[tuple[int, ...], str]],
    recipe: Mapping[str, list],
) -> list[str]:
    """Every problem between the source's parameters, the destination's and the destination's recipe.

    Args:
      src, dst: ``{name: (shape, dtype)}`` of each side.
      recipe: ``{destination name: encoded view}``; a destination leaf without one is the source
        leaf of its name, cast to the destination's dtype where they differ.

    Example:
      >>> from jreshard.views import concat, param
      >>> from jreshard.views.named import encode
      >>> src = {"q": ((4, 8), "float32"), "k": ((4, 4), "float32"), "n": ((4,), "float32")}
      >>> dst = {"qkv": ((4, 16), "bfloat16"), "n": ((4,), "int32"), "x": ((2,), "float32")}
      >>> qkv = concat([param("q", (4, 8), "float32"), param("k", (4, 2), "float32")], axis=1)
      >>> for line in view_problems(src, dst, {"qkv": encode(qkv)}):
      ...     print(line)
      parameter n: source dtype float32 cannot be cast to destination dtype int32 (views cast between ...)
      recipe leaf qkv: it reads source parameter k as shape (4, 2), but the source declares (4, 4)
      parameter x is declared by the destination side only (and no recipe leaf makes it)
    """
    from jreshard.views.casts import CAST_DTYPES
    from jreshard.views.named import decode, param, reads

    def castable(a: str, b: str) -> bool:
        return a == b or (a in CAST_DTYPES and b in CAST_DTYPES)

    errors: list[str] = []
    used: set[str] = set()
    for n in sorted(map(str, set(recipe) - set(dst))):
        errors.append(f"recipe leaf {n} is not a parameter the destination declares")
    for n, (shape, dtype) in sorted(dst.items()):
        form = recipe.get(n)
        if form is None and n in recipe:
            errors.append(f"recipe leaf {n}: null is not a view (leave the leaf out of the recipe instead)")
            continue
        if form is None:
            if n not in src:
                errors.append(f"parameter {n} is declared by the destination side only (and no recipe leaf makes it)")
                continue
            used.add(n)
            (ss, sd) = src[n]
            if ss != shape:
                errors.append(f"parameter {n}: source shape {ss} != destination shape {shape}")
            if not castable(sd, dtype):
                errors.append(
                    f"parameter {n}: source dtype {sd} cannot be cast to destination dtype {dtype} "
                    f"(views cast between {', '.join(CAST_DTYPES)})"
                )
            continue
        bad = len(errors)
        try:
            read = reads(form)
        except (ValueError, TypeError, IndexError, KeyError, RecursionError) as err:  # another process's form
            errors.append(f"recipe leaf {n}: {type(err).__name__}: {err}"[:500])
            continue
        for name, rshape, rdtype in read:
            used.add(name)
            if name not in src:
                errors.append(f"recipe leaf {n}: it reads {name}, which the source side does not declare")
            elif src[name] != (rshape, rdtype):
                (ss, sd) = src[name]
                fields = [f"shape {rshape}, but the source declares {ss}"] if ss != rshape else []
                fields += [f"dtype {rdtype}, but the source declares {sd}"] if sd != rdtype else []
                errors.append(f"recipe leaf {n}: it reads source parameter {name} as " + " and ".join(fields))
        if len(errors) > bad:
            continue
        try:
            view = decode(form, lambda name: param(name, *src[name]))
        except (ValueError, TypeError, IndexError, KeyError, RecursionError) as err:
            errors.append(f"recipe leaf {n}: {err}"[:500])
            continue
        if view.shape != shape:
            errors.append(f"recipe leaf {n}: the view has shape {view.shape}, but the destination declares {shape}")
        if not castable(view.dtype, dtype):
            errors.append(f"recipe leaf {n}: the view's dtype {view.dtype} cannot be cast to the destination's {dtype}")
    for n in sorted(set(src) - used):
        errors.append(f"parameter {n} is declared by the source side only (no destination leaf reads it)")
    return errors


def _diff(a: Mapping[str, tuple], b: Mapping[str, tuple]) -> str:
    extra = sorted(set(a) - set(b))
    missing = sorted(set(b) - set(a))
    changed = sorted(n for n in set(a) & set(b) if a[n] != b[n])
    parts = []
    if extra:
        parts.append(f"extra parameters {extra}")
    if missing:
        parts.append(f"no parameters {missing}")
    for n in changed:
        fields = [f"{f} {x} (not {y})" for f, x, y in zip(("shape", "dtype"), a[n], b[n], strict=True) if x != y]
        parts.append(f"{n} with " + " and ".join(fields))
    return "; ".join(parts)


def leaf_differences(now: Sequence[Sequence[Any]], declared: Sequence[Sequence[Any]]) -> list[str]:
    """Each leaf of a tree (``declare_local(...)["params"]``) that differs from the declaration, and how.

    Every differing field of every leaf is named, with both values: ``shape``, ``dtype``, and
    ``sharding`` (the boxes this process's devices hold).

    Example:
      >>> now = [["w", [4], "float32", [[0, [0], [4]]]]]
      >>> for line in leaf_differences(now, [["w", [4], "bfloat16", [[0, [0], [2]]]]]):
      ...     print(line)
      w: dtype float32 where bfloat16 was declared
      w: sharding (boxes per device) [[0, [0], [4]]] where [[0, [0], [2]]] was declared
    """
    want = {p[0]: p for p in declared}
    got = {p[0]: p for p in now}
    out = [f"{n} is not declared" for n in got if n not in want]
    out += [f"{n} is missing" for n in want if n not in got]
    for n in (n for n in got if n in want):
        for i, field in ((1, "shape"), (2, "dtype"), (3, "sharding (boxes per device)")):
            x, y = got[n][i], want[n][i]
            if x != y:
                x, y = (tuple(x), tuple(y)) if i == 1 else (x, y)
                out.append(f"{n}: {field} {x} where {y} was declared")
    return out


def problems(n: int) -> str:
    """``"1 problem"``, ``"2 problems"``."""
    return f"{n} problem" if n == 1 else f"{n} problems"


def group_layouts(
    decls: Mapping[int, dict],
) -> tuple[list[str], list[tuple[Layout, Layout]], dict[int, int], dict[int, int], dict[int, int]]:
    """``(names, [(src layout, dst layout)], {rank: domain}, {rank: process}, {process: first rank})``.

    Raises:
      LayoutError: a side holds no part of a parameter.
    """
    sides = _sides(decls)
    domains, rank_process, base = _ranks(decls)
    first = decls[sides["source"][0]]["params"]
    names = [n for n, _, _, _ in first]
    pairs = []
    for name, shape, dtype, _ in first:
        src, dst = (_side_layout(decls, sides[role], base, role, name, shape, dtype) for role in SIDES)
        pairs.append((src, dst))
    return names, pairs, domains, rank_process, base


SIDES = ("source", "destination")


def _ranks(decls: Mapping[int, dict]) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """``({rank: domain}, {rank: process}, {process: first rank})``: sources first, process by process."""
    sides = _sides(decls)
    base, domains, rank_process = {}, {}, {}
    nxt = 0
    for p in sides["source"] + sides["destination"]:
        base[p] = nxt
        dom = decls[p]["domain"]
        for i in range(decls[p]["ndev"]):
            domains[nxt + i] = int(dom) if dom is not None else _DEFAULT_DOMAIN + p
            rank_process[nxt + i] = p
        nxt += decls[p]["ndev"]
    return domains, rank_process, base


def _side_layout(
    decls: Mapping[int, dict],
    procs: Sequence[int],
    base: Mapping[int, int],
    role: str,
    name: str,
    shape: Any,
    dtype: str,
) -> Layout:
    """The layout of parameter ``name`` over the ranks of ``procs`` (one side's processes)."""
    boxes = {}
    for p in procs:
        entry = next(e for e in decls[p]["params"] if e[0] == name)
        for i, lo, hi in entry[3]:
            boxes[base[p] + i] = Box(tuple(lo), tuple(hi))
    if not boxes:
        raise LayoutError(f"parameter {name}: no {role} process holds any part of it")
    return Layout.from_boxes(tuple(shape), dtype, boxes)


def needs_views(decls: Mapping[int, dict]) -> bool:
    """Whether the group moves views: the destination declares a recipe, or a leaf of another dtype."""
    sides = _sides(decls)
    if not all(sides.values()):
        return False
    src = {n: dt for n, _, dt, _ in decls[sides["source"][0]]["params"]}
    dst = decls[sides["destination"][0]]
    return bool(dst.get("recipe")) or any(n in src and src[n] != dt for n, _, dt, _ in dst["params"])


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GroupViews:
    """What a group that moves views moves: every source leaf, and every destination leaf as a view of them.

    Attributes:
      src_names, dst_names: the leaf names of each side (the source's order; the destination's).
      leaves: one view leaf per source parameter (over a :class:`~jreshard.views.named.NamedParam`).
      layouts: the source leaves' layouts over the group's ranks.
      views: per destination leaf, the view that makes it, in the destination's dtype.
      dsts: the destination leaves' layouts.
      domains, rank_process, base: ``{rank: domain}``, ``{rank: process}``, ``{process: first rank}``.
    """

    src_names: tuple[str, ...]
    dst_names: tuple[str, ...]
    leaves: tuple[Any, ...]
    layouts: tuple[Layout, ...]
    views: tuple[Any, ...]
    dsts: tuple[Layout, ...]
    domains: dict[int, int]
    rank_process: dict[int, int]
    base: dict[int, int]


def group_views(decls: Mapping[int, dict]) -> GroupViews:
    """The views of declarations that :func:`validate` (``views=True``) accepted.

    Raises:
      LayoutError: a side holds no part of a parameter.
    """
    from jreshard.views.named import decode, param

    sides = _sides(decls)
    domains, rank_process, base = _ranks(decls)
    src_params = decls[sides["source"][0]]["params"]
    leaf = {n: param(n, shape, dt) for n, shape, dt, _ in src_params}
    layouts = [_side_layout(decls, sides["source"], base, "source", n, s, dt) for n, s, dt, _ in src_params]
    recipe = _recipe_of(decls)
    views, dsts = [], []
    for n, shape, dt, _ in decls[sides["destination"][0]]["params"]:
        view = decode(recipe[n], leaf.__getitem__) if n in recipe else leaf[n]
        views.append(view.astype(dt))
        dsts.append(_side_layout(decls, sides["destination"], base, "destination", n, shape, dt))
    return GroupViews(
        src_names=tuple(n for n, *_ in src_params),
        dst_names=tuple(n for n, *_ in decls[sides["destination"][0]]["params"]),
        leaves=tuple(leaf.values()),
        layouts=tuple(layouts),
        views=tuple(views),
        dsts=tuple(dsts),
        domains=domains,
        rank_process=rank_process,
        base=base,
    )
