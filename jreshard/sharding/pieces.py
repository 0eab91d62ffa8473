"""Pieces: how a destination box is cut into parts that source ranks hold.

The source layout is first made *disjoint*: its distinct boxes, each with the
ranks that hold it (its replicas). Every ``NamedSharding`` and every even or
uneven grid is already disjoint; a layout whose distinct boxes overlap (halo
regions, hand-written boxes) is cut into cells along every box boundary, each
cell held by every rank whose box contains it.

The pieces of a destination box ``beta`` are then its intersections with the
disjoint source boxes. Per dimension these are interval overlaps, evaluated for
all source boxes at once with numpy, never by a search over rank pairs.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jreshard.errors import LayoutError
from jreshard.sharding.box import Box
from jreshard.sharding.caches import cache
from jreshard.sharding.layout import Layout

__all__ = ["SourceIndex", "disjoint", "overlapping", "pieces_of", "source_index"]

_MAX_CELLS = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SourceIndex:
    """Pairwise-disjoint source boxes and the ranks that hold each.

    Attributes:
      boxes: the disjoint boxes, sorted.
      holders: ``holders[j]`` are the ranks (ascending) whose source box contains ``boxes[j]``.
      lo, hi: ``(len(boxes), ndim)`` int64 arrays of the box bounds.
    """

    boxes: tuple[Box, ...]
    holders: tuple[tuple[int, ...], ...]
    lo: np.ndarray
    hi: np.ndarray


def _bounds(boxes: tuple[Box, ...], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    lo = np.array([b.lo for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    hi = np.array([b.hi for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    lo.setflags(write=False)
    hi.setflags(write=False)
    return lo, hi


def overlapping(lo: np.ndarray, hi: np.ndarray, box: Box) -> np.ndarray:
    """Indices of the boxes ``[lo[i], hi[i])`` that overlap ``box``.

    Two boxes overlap when, in every dimension, each starts before the other ends.
    Empty boxes overlap nothing.
    """
    if lo.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    blo = np.asarray(box.lo, dtype=np.int64)
    bhi = np.asarray(box.hi, dtype=np.int64)
    if np.any(bhi <= blo):
        return np.zeros(0, dtype=np.int64)
    mask = np.all((lo < bhi) & (hi > blo) & (hi > lo), axis=1)
    return np.flatnonzero(mask)


def disjoint(boxes: tuple[Box, ...], ndim: int) -> bool:
    """Whether distinct boxes are pairwise disjoint.

    Fast case: if, in every dimension, the distinct intervals used by the boxes
    do not overlap one another, two distinct boxes differ in some dimension's
    interval and so are disjoint. Otherwise compare all pairs.
    """
    grid = True
    for d in range(ndim):
        ivs = sorted({(b.lo[d], b.hi[d]) for b in boxes})
        if any(ivs[i][1] > ivs[i + 1][0] for i in range(len(ivs) - 1)):
            grid = False
            break
    if grid:
        return True
    lo, hi = _bounds(boxes, ndim)
    for i, b in enumerate(boxes):
        hits = overlapping(lo, hi, b)
        if np.any(hits != i):
            return False
    return True


@cache(max_size=1024)
def source_index(layout: Layout) -> SourceIndex:
    """The disjoint form of a source layout (see the module docstring)."""
    groups = layout.replica_groups()
    boxes = tuple(b for b, _ in groups)
    if disjoint(boxes, layout.ndim):
        holders = tuple(rs for _, rs in groups)
        lo, hi = _bounds(boxes, layout.ndim)
        return SourceIndex(boxes, holders, lo, hi)
    # Overlapping boxes: cells between consecutive boundaries in every dimension.
    cuts = [sorted({v for b in boxes for v in (b.lo[d], b.hi[d])}) for d in range(layout.ndim)]
    ncells = math.prod(max(len(c) - 1, 0) for c in cuts)
    if ncells > _MAX_CELLS:
        raise LayoutError(
            f"source layout of shape={layout.shape} has overlapping boxes that cut it into {ncells} cells "
            f"(more than {_MAX_CELLS}); the fix is to describe it with disjoint boxes"
        )
    owners: dict[tuple[int, ...], set[int]] = {}
    for b, rs in groups:
        ranges = [range(cuts[d].index(b.lo[d]), cuts[d].index(b.hi[d])) for d in range(layout.ndim)]
        for cell in np.ndindex(*[len(r) for r in ranges]):
            key = tuple(r[c] for r, c in zip(ranges, cell, strict=True))
            owners.setdefault(key, set()).update(rs)
    cells = sorted(
        (Box(tuple(cuts[d][k[d]] for d in range(layout.ndim)), tuple(cuts[d][k[d] + 1] for d in range(layout.ndim))), k)
        for k in owners
    )
    out_boxes = tuple(b for b, _ in cells)
    holders = tuple(tuple(sorted(owners[k])) for _, k in cells)
    lo, hi = _bounds(out_boxes, layout.ndim)
    return SourceIndex(out_boxes, holders, lo, hi)


def pieces_of(beta: Box, index: SourceIndex, *, what: str = "destination") -> list[tuple[Box, int]]:
    """The pieces of ``beta``: ``(beta ∩ boxes[j], j)`` for every source box ``j`` it meets.

    Raises:
      LayoutError: the source boxes do not cover all of ``beta``.
    """
    # Replicas of a box, and tensors that share layouts, ask for the same pieces: compute once.
    return list(_pieces_of(beta, index, what))


@cache(max_size=1 << 16)
def _pieces_of(beta: Box, index: SourceIndex, what: str) -> tuple[tuple[Box, int], ...]:
    out: list[tuple[Box, int]] = []
    covered = 0
    blo, bhi = beta.lo, beta.hi
    if len(index.boxes) == 1:  # one source box (a replicated source): no search
        sb = index.boxes[0]
        meets = all(a < d and c < b and a < b and c < d for a, b, c, d in zip(blo, bhi, sb.lo, sb.hi, strict=True))
        hits = [0] if meets else []
    else:
        hits = overlapping(index.lo, index.hi, beta).tolist()
    for j in hits:
        sb = index.boxes[j]
        box = Box.trusted(tuple(map(max, blo, sb.lo)), tuple(map(min, bhi, sb.hi)))  # overlapping: a valid box
        out.append((box, j))
        covered += box.volume
    if beta.ndim == 0 and index.boxes:
        out = [(beta, 0)]
        covered = 1
    if covered != beta.volume:
        raise LayoutError(
            f"the source layout covers only {covered} of the {beta.volume} elements of {what} box {beta}; "
            "every element a destination needs must be held by some source rank"
        )
    return tuple(out)
