"""Lower bounds on what any plan must move, computed independently of the planner.

For a domain ``G``, let ``U(G)`` be the union of the source boxes held by ranks
in ``G``. Every distinct destination box ``beta`` held in ``G`` needs all of its
elements inside ``G``; those outside ``U(G)`` must cross the network into ``G``
at least once. Distinct ``beta`` are disjoint for a disjoint destination; where
they overlap, an element is counted once per distinct box, as any plan that
fills each box's holders must deliver it once per box. Hence

    network_bytes >= Σ_G Σ_beta |beta \\ U(G)| * itemsize.

``|beta \\ U(G)|`` is computed by cutting ``beta`` into cells along every
boundary of the boxes of ``U(G)`` and summing the cells no box covers: a
different computation from the planner's pieces, so the equality of the two is
a real check.
"""

from __future__ import annotations

import functools

import numpy as np

from jreshard._cache import cache
from jreshard.sharding.box import Box, intersect
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Topology

__all__ = ["network_lower_bound", "uncovered_volume"]


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


@cache(max_size=4096)
def network_lower_bound(src: Layout, dst: Layout, topo: Topology) -> int:
    """``Σ_G Σ_beta |beta \\ U(G)|`` in bytes (module docstring)."""
    src_in: dict[int, list[Box]] = {}
    for r, b in zip(src.ranks, src.boxes, strict=True):
        src_in.setdefault(topo.domain_of(r), []).append(b)
    need: dict[int, set[Box]] = {}
    for r, b in zip(dst.ranks, dst.boxes, strict=True):
        need.setdefault(topo.domain_of(r), set()).add(b)
    total = 0
    for g, betas in need.items():
        cover = sorted(set(src_in.get(g, [])))
        for beta in betas:
            total += uncovered_volume(beta, cover)
    return total * src.itemsize
