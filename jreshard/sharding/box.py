"""Box: an N-d half-open interval of global indices.

A box is one ``[lo, hi)`` range per tensor dimension. A rank-0 tensor has the
empty box ``Box((), ())`` of volume 1. Boxes are values: frozen, hashable,
ordered lexicographically by ``(lo, hi)`` so that sorting them is deterministic.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

__all__ = ["Box", "difference", "intersect"]


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Box:
    """Half-open index ranges ``[lo[d], hi[d])`` for each dimension ``d``.

    Example:
      >>> b = Box((0, 2), (4, 6))
      >>> b.shape, b.volume
      ((4, 4), 16)
      >>> intersect(b, Box((2, 0), (8, 3)))
      Box(lo=(2, 2), hi=(4, 3))
    """

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    def __post_init__(self) -> None:
        lo = tuple(int(v) for v in self.lo)
        hi = tuple(int(v) for v in self.hi)
        if len(lo) != len(hi):
            raise ValueError(f"Box: lo={lo} and hi={hi} have different lengths")
        if any(a < 0 or b < a for a, b in zip(lo, hi, strict=True)):
            raise ValueError(f"Box: need 0 <= lo <= hi in every dimension, got lo={lo}, hi={hi}")
        object.__setattr__(self, "lo", lo)
        object.__setattr__(self, "hi", hi)

    @classmethod
    def trusted(cls, lo: tuple[int, ...], hi: tuple[int, ...]) -> Box:
        """A box from bounds already known valid (Python int tuples, ``0 <= lo <= hi``): no checks.

        For the planner's hot loops, which build boxes from boxes it has checked.
        """
        box = object.__new__(cls)
        object.__setattr__(box, "lo", lo)
        object.__setattr__(box, "hi", hi)
        return box

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @classmethod
    def from_slices(cls, index: Sequence[slice], shape: Sequence[int]) -> Box:
        """The box of a tuple of unit-step slices into a tensor of ``shape``."""
        lo, hi = [], []
        for s, n in zip(index, shape, strict=True):
            start, stop, step = s.indices(n)
            if step != 1:
                raise ValueError(f"Box.from_slices: step must be 1, got {s} for dimension of size {n}")
            lo.append(start)
            hi.append(max(start, stop))
        return cls(tuple(lo), tuple(hi))

    @property
    def ndim(self) -> int:
        return len(self.lo)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(map(operator.sub, self.hi, self.lo))

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    @property
    def empty(self) -> bool:
        return self.volume == 0

    def slices(self) -> tuple[slice, ...]:
        """Index this box out of a global-coordinate array."""
        return tuple(slice(a, b) for a, b in zip(self.lo, self.hi, strict=True))

    def relative_to(self, outer: Box) -> Box:
        """This box in coordinates relative to ``outer``'s origin (``outer`` must contain it)."""
        if not outer.contains(self):
            raise ValueError(f"Box.relative_to: {self} is not inside {outer}")
        return Box(
            tuple(a - o for a, o in zip(self.lo, outer.lo, strict=True)),
            tuple(b - o for b, o in zip(self.hi, outer.lo, strict=True)),
        )

    def contains(self, other: Box) -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.lo, self.hi, other.lo, other.hi, strict=True))

    def split(self, dim: int, at: int) -> tuple[Box, Box]:
        """Cut along ``dim`` at global index ``at``: ``[lo, at)`` and ``[at, hi)``."""
        if not self.lo[dim] <= at <= self.hi[dim]:
            raise ValueError(f"Box.split: at={at} is outside [{self.lo[dim]}, {self.hi[dim]}) of dimension {dim}")
        at = int(at)
        hi1 = list(self.hi)
        hi1[dim] = at
        lo2 = list(self.lo)
        lo2[dim] = at
        return Box.trusted(self.lo, tuple(hi1)), Box.trusted(tuple(lo2), self.hi)

    def is_contiguous_in(self, outer_shape: Sequence[int]) -> bool:
        """Whether this box, in the coordinates of a C-ordered buffer of
        ``outer_shape`` (relative to its origin), is one contiguous run of memory.

        That holds when, after the first dimension with extent > 1, every later
        dimension spans its whole extent.
        """
        shape = self.shape
        if math.prod(shape) <= 1:
            return True
        d = 0
        while d < len(shape) and shape[d] == 1:
            d += 1
        return all(self.lo[e] == 0 and self.hi[e] == outer_shape[e] for e in range(d + 1, len(shape)))

    def to_json(self) -> list[list[int]]:
        return [list(self.lo), list(self.hi)]

    def __repr__(self) -> str:
        return f"Box(lo={self.lo}, hi={self.hi})"


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or ``None`` when they do not overlap.

    Per dimension the overlap of ``[a.lo, a.hi)`` and ``[b.lo, b.hi)`` is
    ``[max(lo), min(hi))``; the boxes overlap when every dimension's is non-empty.
    Rank-0 boxes always overlap (both are the single element).
    """
    if len(a.lo) != len(b.lo):
        raise ValueError(f"intersect: boxes of {len(a.lo)} and {len(b.lo)} dimensions: {a}, {b}")
    lo = tuple(map(max, a.lo, b.lo))
    hi = tuple(map(min, a.hi, b.hi))
    for x, y in zip(lo, hi, strict=True):
        if y <= x:
            return None
    return Box.trusted(lo, hi)  # bounds of two valid boxes: valid


def difference(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as disjoint boxes (at most two per dimension), in a fixed order.

    Peel off, dimension by dimension, the slab of ``a`` below ``b`` and the slab
    above it; what is left of ``a`` is ``a ∩ b``, which is dropped.

    Example:
      >>> difference(Box((0,), (8,)), Box((2,), (5,)))
      [Box(lo=(0,), hi=(2,)), Box(lo=(5,), hi=(8,))]
    """
    x = intersect(a, b)
    if x is None:
        return [a]
    out: list[Box] = []
    rest = a
    for d in range(a.ndim):
        if rest.lo[d] < x.lo[d]:
            below, rest = rest.split(d, x.lo[d])
            out.append(below)
        if x.hi[d] < rest.hi[d]:
            rest, above = rest.split(d, x.hi[d])
            out.append(above)
    return out
