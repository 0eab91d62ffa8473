"""The declarations a RefitGroup exchanges, and their validation (pure functions, no MPI).

A process's declaration is a JSON-able dict::

  {"role": "source" | "destination", "ndev": number of devices it drives, "domain": int | None,
   "params": [[name, shape, dtype, [[local device index, lo, hi], ...]], ...], "errors": [...]}

Ranks are numbered sources first, then destinations, process by process, each
process's devices in the order it declared them. Every process runs
:func:`validate` on the same gathered declarations, so all report the same problems.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jreshard.errors import JReshardError
from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import dtype_name
from jreshard.sharding.layout import Layout

__all__ = ["declare_local", "group_layouts", "leaf_differences", "problems", "validate"]

_DEFAULT_DOMAIN = 1 << 20  # + process index: every process its own domain unless told


def declare_local(role: str, params: Any, devices: Sequence[Any], domain: int | None) -> dict:
    """This process's declaration of ``params`` (jax arrays / ShapeDtypeStructs with shardings)."""
    import jax

    local = list(jax.local_devices())
    errors: list[str] = []
    for d in devices:
        if d not in local:
            errors.append(f"declares device {d!r} that it does not have (its devices: {[str(x) for x in local]})")
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path) or "x"
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not hasattr(leaf, "shape"):
            errors.append(
                f"leaf {name} is {type(leaf).__name__}; expected a jax.Array or ShapeDtypeStruct with a sharding"
            )
            continue
        shape = tuple(int(n) for n in leaf.shape)
        lay = Layout.from_sharding(sharding, shape, leaf.dtype)
        boxes = []
        for d in sorted(sharding.addressable_devices, key=lambda d: d.id):
            if d not in devices:
                errors.append(f"leaf {name} has a shard on {d}, which this process does not declare as its device")
                continue
            b = lay.box_of(d.id)
            boxes.append([devices.index(d), list(b.lo), list(b.hi)])
        out.append([name, list(shape), dtype_name(leaf.dtype), boxes])
    return {"role": role, "ndev": len(devices), "domain": domain, "params": out, "errors": errors}


def _sides(decls: Mapping[int, dict]) -> dict[str, list[int]]:
    return {r: sorted(p for p, d in decls.items() if d["role"] == r) for r in ("source", "destination")}


def _who(p: int, decls: Mapping[int, dict]) -> str:
    return f"process {p} ({decls[p]['role']})"


def validate(decls: Mapping[int, dict]) -> list[str]:
    """Every problem with the gathered declarations ``{process: declaration}``; empty when they agree."""
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
    from jreshard.errors import LayoutError

    sides = _sides(decls)
    order = sides["source"] + sides["destination"]
    base, domains, rank_process = {}, {}, {}
    nxt = 0
    for p in order:
        base[p] = nxt
        dom = decls[p]["domain"]
        for i in range(decls[p]["ndev"]):
            domains[nxt + i] = int(dom) if dom is not None else _DEFAULT_DOMAIN + p
            rank_process[nxt + i] = p
        nxt += decls[p]["ndev"]
    first = decls[sides["source"][0]]["params"]
    names = [n for n, _, _, _ in first]
    pairs = []
    for name, shape, dtype, _ in first:
        lays = []
        for role in ("source", "destination"):
            boxes = {}
            for p in sides[role]:
                entry = next(e for e in decls[p]["params"] if e[0] == name)
                for i, lo, hi in entry[3]:
                    boxes[base[p] + i] = Box(tuple(lo), tuple(hi))
            if not boxes:
                raise LayoutError(f"parameter {name}: no {role} process holds any part of it")
            lays.append(Layout.from_boxes(tuple(shape), dtype, boxes))
        pairs.append((lays[0], lays[1]))
    return names, pairs, domains, rank_process, base
