"""The brute-force network lower bound of a tree of views, and a numpy evaluator of views.

Independent of the lowering's box algebra: the views are evaluated with numpy on
arrays of *element ids* (which source leaf, which element, which cast chain), so
every destination element is traced to its source element one by one. For each
fast-link domain ``G``, each distinct ``(source element, wire dtype chain)`` that
some destination rank of ``G`` needs, and that no source rank of ``G`` holds, must
enter ``G`` at least once, in its wire dtype (:func:`~jreshard.views.casts.wire_cut`):

    network_bytes >= Σ_G Σ_{(e, chain) needed in G, e not held in G} itemsize(wire dtype).

For tests and small tensors: it builds id arrays of the views' full shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jreshard.sharding.dtypes import numpy_dtype
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Topology
from jreshard.views.algebra import Cast, Concat, Index, Leaf, Reshape, Stack, Transpose, View
from jreshard.views.casts import wire_cut

__all__ = ["brute_force_network_bound", "evaluate"]

_SHIFT = 40  # element ids below 2**40; the cast-chain code above


def evaluate(
    view: View, value: Callable[[Leaf], np.ndarray], on_cast: Callable[[np.ndarray, str], np.ndarray]
) -> np.ndarray:
    """``view`` computed with numpy from ``value(leaf)``, casting with ``on_cast``.

    Example:
      >>> from jreshard.views import concat
      >>> from jreshard.views.casts import cast
      >>> a, b = Leaf(np.arange(4.0).reshape(2, 2)), Leaf(10 + np.arange(4.0).reshape(2, 2))
      >>> evaluate(concat([a, b], axis=1, groups=2), lambda x: x.source, cast).tolist()
      [[0.0, 10.0, 1.0, 11.0], [2.0, 12.0, 3.0, 13.0]]
    """
    if isinstance(view, Leaf):
        return value(view)
    if isinstance(view, Cast):
        return on_cast(evaluate(view.x, value, on_cast), view.dtype)
    if isinstance(view, Transpose):
        return np.transpose(evaluate(view.x, value, on_cast), view.perm)
    if isinstance(view, Reshape):
        return np.reshape(evaluate(view.x, value, on_cast), view.shape)
    if isinstance(view, Index):
        x = evaluate(view.x, value, on_cast)
        idx = tuple(slice(a, b) if k else a for (a, b), k in zip(view.spans, view.keep, strict=True))
        return x[idx]
    if isinstance(view, Stack):
        return np.stack([evaluate(p, value, on_cast) for p in view.parts], axis=view.axis)
    if isinstance(view, Concat):
        xs = [evaluate(p, value, on_cast) for p in view.parts]
        g, a = view.groups, view.axis
        return np.concatenate([c for i in range(g) for c in (np.split(x, g, axis=a)[i] for x in xs)], axis=a)
    raise TypeError(f"evaluate: no numpy rule for {type(view).__name__}")


def brute_force_network_bound(
    views: Sequence[View], leaves: Sequence[Leaf], layouts: Sequence[Layout], dsts: Sequence[Layout], topo: Topology
) -> int:
    """The lower bound of the module docstring, in bytes, for a tree of views."""
    offsets = np.cumsum([0] + [lay.nbytes // lay.itemsize for lay in layouts])
    pos = {id(leaf.source): i for i, leaf in enumerate(leaves)}
    chains: list[tuple[str, ...]] = [()]
    code_of: dict[tuple[str, ...], int] = {(): 0}

    def ids(leaf: Leaf) -> np.ndarray:
        i = pos[id(leaf.source)]
        return (offsets[i] + np.arange(offsets[i + 1] - offsets[i], dtype=np.int64)).reshape(leaf.shape)

    def on_cast(x: np.ndarray, dtype: str) -> np.ndarray:
        codes = x >> _SHIFT
        out = x & ((1 << _SHIFT) - 1)
        for c in np.unique(codes):
            chain = (*chains[int(c)], dtype)
            if chain not in code_of:
                code_of[chain] = len(chains)
                chains.append(chain)
            out = np.where(codes == c, out | (np.int64(code_of[chain]) << _SHIFT), out)
        return out

    traced = [evaluate(v, ids, on_cast) for v in views]
    leaf_of = lambda e: np.searchsorted(offsets, e, side="right") - 1  # noqa: E731
    total = 0
    for g in sorted(set(topo.domains)):
        held = np.zeros(int(offsets[-1]), dtype=bool)
        for i, lay in enumerate(layouts):
            flat = held[offsets[i] : offsets[i + 1]].reshape(lay.shape)
            for r, b in zip(lay.ranks, lay.boxes, strict=True):
                if r in topo and topo.domain_of(r) == g:
                    flat[b.slices()] = True
        need: set[tuple[int, tuple[str, ...]]] = set()
        for t, d in zip(traced, dsts, strict=True):
            for r, b in zip(d.ranks, d.boxes, strict=True):
                if topo.domain_of(r) != g:
                    continue
                for x in np.unique(t[b.slices()].reshape(-1)):
                    e, c = int(x) & ((1 << _SHIFT) - 1), int(x) >> _SHIFT
                    if held[e]:
                        continue
                    src_dtype = layouts[int(leaf_of(e))].dtype
                    chain = chains[c]
                    need.add((e, chain[: wire_cut(src_dtype, chain)]))
        for e, wire in need:
            total += numpy_dtype(wire[-1] if wire else layouts[int(leaf_of(e))].dtype).itemsize
    return total


def box_network_bound(
    view: View, leaves: Sequence[Leaf], layouts: Sequence[Layout], dst: Layout, topo: Topology
) -> int:
    """The same bound for one destination leaf, from boxes instead of elements (for whole models).

    Per domain ``G`` and wire key ``(leaf, sender casts)``: the volume of the union of the
    source boxes the destination boxes of ``G`` read, minus the source boxes ranks of ``G``
    hold, by cutting along every boundary (a grid of cells, as in ``sharding/bounds.py``).
    """
    pos = {id(leaf.source): i for i, leaf in enumerate(leaves)}
    total = 0
    for g in sorted({topo.domain_of(r) for r in dst.ranks}):
        boxes = {b for r, b in zip(dst.ranks, dst.boxes, strict=True) if topo.domain_of(r) == g}
        need: dict[tuple, list] = {}
        for beta in sorted(boxes):
            for m in view.regions(beta):
                i = pos[id(m.leaf.source)]
                send = m.chain[: wire_cut(layouts[i].dtype, m.chain)]
                need.setdefault((i, send), []).append(m.src_box())
        for (i, send), bs in need.items():
            lay = layouts[i]
            cover = [b for r, b in zip(lay.ranks, lay.boxes, strict=True) if r in topo and topo.domain_of(r) == g]
            item = numpy_dtype(send[-1] if send else lay.dtype).itemsize
            total += _union_minus(bs, cover) * item
    return total


def _union_minus(need: list, cover: list) -> int:
    nd = need[0].ndim
    if nd == 0:
        return 0 if cover else 1
    cuts = [np.unique([v for b in need + cover for v in (b.lo[d], b.hi[d])]) for d in range(nd)]
    grid = np.zeros([len(c) - 1 for c in cuts], dtype=np.int8)

    def sl(b: object) -> tuple:
        return tuple(
            slice(int(np.searchsorted(cuts[d], b.lo[d])), int(np.searchsorted(cuts[d], b.hi[d])))  # type: ignore[attr-defined]
            for d in range(nd)
        )

    for b in need:
        grid[sl(b)] = 1
    for b in cover:
        grid[sl(b)] = 0
    vol = np.ones(grid.shape, dtype=np.int64)
    for d in range(nd):
        shape = [1] * nd
        shape[d] = -1
        vol = vol * np.diff(cuts[d]).reshape(shape)
    return int((vol * grid).sum())


def quant_network_bound(view: View, layouts: Sequence[Layout], dst: Layout, topo: Topology) -> int | None:
    """The bound for a block-quantised destination leaf, quantised at the sender.

    Each output element (a float8 weight or a float32 scale) a domain ``G`` needs must enter
    ``G`` once when no rank of ``G`` holds any of its source leaves: ``Σ_G |∪ boxes of G| *
    itemsize``. ``None`` when some domain does hold a source (not counted here).
    """
    total = 0
    src_domains = {topo.domain_of(r) for lay in layouts for r in lay.ranks if r in topo}
    item = numpy_dtype(view.dtype).itemsize
    for g in sorted({topo.domain_of(r) for r in dst.ranks}):
        if g in src_domains:
            return None
        boxes = sorted({b for r, b in zip(dst.ranks, dst.boxes, strict=True) if topo.domain_of(r) == g})
        total += _union_minus(boxes, []) * item
    return total
