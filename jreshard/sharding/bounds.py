"""Lower bounds on what any plan must move, computed independently of the planner.

For a domain ``G``, let ``U(G)`` be the union of the source boxes held by ranks
in ``G``. Every element of a destination box held in ``G`` must be inside ``G``
at the end; those outside ``U(G)`` must cross the network into ``G`` at least
once. An element that two overlapping destination boxes of ``G`` share can
enter ``G`` once and be copied between them over fast links, so the bound counts
each element of the union once:

    network_bytes >= Σ_G |(∪_beta beta) \\ U(G)| * itemsize,

over the distinct destination boxes ``beta`` held in ``G``. When those are
pairwise disjoint (every ``NamedSharding``) this is ``Σ_beta |beta \\ U(G)|``.

The volumes are computed by cutting the boxes into cells along every boundary
and summing the cells that some ``beta`` holds and no box of ``U(G)`` covers: a
different computation from the planner's pieces, so the equality of the two is
a real check.
"""

from __future__ import annotations

import functools

import numpy as np

from jreshard.sharding.box import Box, intersect
from jreshard.sharding.caches import cache
from jreshard.sharding.layout import Layout
from jreshard.sharding.pieces import disjoint
from jreshard.sharding.topology import Topology

__all__ = ["network_lower_bound", "uncovered_volume"]


def _cell_grid(boxes: list[Box], ndim: int) -> list[np.ndarray]:
    return [np.unique([v for b in boxes for v in (b.lo[d], b.hi[d])]) for d in range(ndim)]


def _mark(grid: list[np.ndarray], boxes: list[Box]) -> np.ndarray:
    """A boolean array over the cells of ``grid``: true in every cell inside one of ``boxes``."""
    out = np.zeros([len(c) - 1 for c in grid], dtype=bool)
    for b in boxes:
        out[
            tuple(
                slice(int(np.searchsorted(c, lo)), int(np.searchsorted(c, hi)))
                for c, lo, hi in zip(grid, b.lo, b.hi, strict=True)
            )
        ] = True
    return out


def union_uncovered_volume(betas: list[Box], cover: list[Box]) -> int:
    """Elements inside some box of ``betas`` and inside none of the boxes ``cover``."""
    betas = [b for b in betas if not b.empty]
    if not betas:
        return 0
    if betas[0].ndim == 0:
        return 0 if cover else 1
    parts = [x for c in cover for b in betas if (x := intersect(b, c)) is not None]
    grid = _cell_grid(betas + parts, betas[0].ndim)
    vol = functools.reduce(np.multiply, np.ix_(*[np.diff(c) for c in grid]))
    return int(np.sum(np.where(_mark(grid, betas) & ~_mark(grid, parts), vol, 0)))


def uncovered_volume(beta: Box, cover: list[Box]) -> int:
    """Elements of ``beta`` inside none of the boxes ``cover``."""
    parts = [x for c in cover if (x := intersect(beta, c)) is not None]
    if not parts:
        return beta.volume
    if beta.ndim == 0:
        return 0
    cuts = [
        np.unique([beta.lo[d], beta.hi[d]] + [v for p in parts for v in (p.lo[d], p.hi[d])]) for d in range(beta.ndim)
    ]
    covered = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
    for p in parts:
        covered[
            tuple(
                slice(int(np.searchsorted(cuts[d], p.lo[d])), int(np.searchsorted(cuts[d], p.hi[d])))
                for d in range(beta.ndim)
            )
        ] = True
    widths = np.ix_(*[np.diff(c) for c in cuts])
    vol = functools.reduce(np.multiply, widths)
    return int(beta.volume - np.sum(np.where(covered, vol, 0)))


def _covered_volumes(betas: list[Box], cover: list[Box]) -> int:
    """``Σ_beta Σ_c |beta ∩ c|``, all pairs at once: per dimension, the overlap of two
    intervals is ``max(0, min(hi) - max(lo))``, and a box's is the product over dimensions."""
    if not betas or not cover:
        return 0
    ndim = betas[0].ndim
    if ndim == 0:
        return len(betas) * len(cover)
    blo = np.array([b.lo for b in betas], np.int64)[:, None, :]
    bhi = np.array([b.hi for b in betas], np.int64)[:, None, :]
    clo = np.array([c.lo for c in cover], np.int64)[None, :, :]
    chi = np.array([c.hi for c in cover], np.int64)[None, :, :]
    width = np.clip(np.minimum(bhi, chi) - np.maximum(blo, clo), 0, None)
    return int(np.prod(width, axis=2).sum())


@cache(max_size=4096)
def network_lower_bound(src: Layout, dst: Layout, topo: Topology) -> int:
    """``Σ_G |(∪_beta beta) \\ U(G)|`` in bytes (module docstring)."""
    src_in: dict[int, set[Box]] = {}
    for r, b in zip(src.ranks, src.boxes, strict=True):
        src_in.setdefault(topo.domain_of(r), set()).add(b)
    need: dict[int, set[Box]] = {}
    for r, b in zip(dst.ranks, dst.boxes, strict=True):
        need.setdefault(topo.domain_of(r), set()).add(b)
    # Distinct boxes of one NamedSharding never overlap. When neither side's do, the union is a
    # sum: Σ_beta |beta| - Σ_beta Σ_c |beta ∩ c| over the distinct boxes of G on each side.
    dst_disjoint = disjoint(tuple(sorted(set(dst.boxes))), dst.ndim)
    src_disjoint = disjoint(tuple(sorted(set(src.boxes))), src.ndim)
    total = 0
    for g, betas in need.items():
        cover = sorted(src_in.get(g, ()))
        ordered = sorted(betas)
        if dst_disjoint and src_disjoint:
            total += sum(b.volume for b in ordered) - _covered_volumes(ordered, cover)
        elif dst_disjoint:
            total += sum(uncovered_volume(beta, cover) for beta in ordered)
        else:
            total += union_uncovered_volume(ordered, cover)
    return total * src.itemsize
