"""The rows of a plan: every byte movement of one tensor, as columns of numpy arrays.

A row moves one box of one tensor from a sender rank to a receiver rank over one
link kind, for one reason (:class:`Phase`), at one dependency stage. A
:class:`TensorPlan` stores a tensor's rows column by column; a :class:`Move` is
one row as a Python value.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
from typing import NamedTuple

import numpy as np

from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Link

__all__ = ["Emitter", "Move", "Phase", "Row", "TensorPlan", "TensorSpec", "TensorTemplate"]


class Phase(enum.IntEnum):
    """Why a transfer happens."""

    LAND = 0  # from a source replica: same-device copy, fast link inside G, or the network into G
    RELAY = 1  # a destination that received a piece forwards it to another domain
    FANOUT = 2  # a lander shares its stripe with the other holders in its domain


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a plan: a name, its source layout and its destination layout."""

    name: str
    src: Layout
    dst: Layout


class Row(NamedTuple):
    """One row as the planner emits it: ``box`` from ``src`` to ``dst``; ``unit`` is
    the index of the destination replica group it serves.

    ``dst`` may be a tuple of ranks: a fan-out block, the same box from ``src`` to
    each of them in turn (one row each once columnar), so the planner's hot loop
    does not build one Python row per receiver.
    """

    src: int
    dst: int | tuple[int, ...]
    link: Link
    phase: Phase
    stage: int
    unit: int
    box: Box


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """One byte movement: ``box`` of tensor ``tensor`` from ``src`` to ``dst``."""

    tensor: int
    src: int
    dst: int
    box: Box
    link: Link
    phase: Phase
    stage: int
    nbytes: int


def _block_sizes(dsts: tuple) -> np.ndarray | None:
    """Rows each entry stands for (fan-out blocks: their receivers), or None when every entry is one row."""
    if all(d.__class__ is not tuple for d in dsts):
        return None
    return np.fromiter((len(d) if d.__class__ is tuple else 1 for d in dsts), np.int64, len(dsts))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TensorPlan:
    """The transfers of one tensor, column by column (read-only numpy arrays).

    Row ``i`` moves ``box [lo[i], hi[i])`` from ``src[i]`` to ``dst[i]`` over
    ``link[i]`` in ``phase[i]`` at ``stage[i]``; ``unit[i]`` is the index of the
    destination replica group it serves and rows are in emission order.
    """

    src: np.ndarray
    dst: np.ndarray
    link: np.ndarray
    phase: np.ndarray
    stage: np.ndarray
    unit: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @classmethod
    def from_rows(cls, rows: list[Row], ndim: int, itemsize: int) -> TensorPlan:
        """Columns from a list of :class:`Row` (fan-out blocks expanded in place)."""
        n = len(rows)
        cols = list(zip(*rows, strict=True)) if rows else [()] * 7
        counts = _block_sizes(cols[1])
        ints = np.empty((n, 6), dtype=np.int64)
        for c in (0, 2, 3, 4, 5):
            ints[:, c] = np.fromiter(cols[c], np.int64, n)
        # fromiter over the flattened bounds: several times faster than np.array on a list of tuples.
        boxes = cols[6]
        lo = np.fromiter(itertools.chain.from_iterable(b.lo for b in boxes), np.int64, n * ndim).reshape(n, ndim)
        hi = np.fromiter(itertools.chain.from_iterable(b.hi for b in boxes), np.int64, n * ndim).reshape(n, ndim)
        if counts is None:
            ints[:, 1] = np.fromiter(cols[1], np.int64, n)
            return cls.from_columns(ints, lo, hi, itemsize)
        total = int(counts.sum())
        dst = np.fromiter(
            itertools.chain.from_iterable(d if d.__class__ is tuple else (d,) for d in cols[1]), np.int64, total
        )
        ints = np.repeat(ints, counts, axis=0)
        ints[:, 1] = dst
        return cls.from_columns(ints, np.repeat(lo, counts, axis=0), np.repeat(hi, counts, axis=0), itemsize)

    @classmethod
    def from_columns(cls, ints: np.ndarray, lo: np.ndarray, hi: np.ndarray, itemsize: int) -> TensorPlan:
        """Columns from an ``(n, 6)`` array of ``(src, dst, link, phase, stage, unit)`` and the box bounds."""
        nbytes = np.prod(hi - lo, axis=1, dtype=np.int64) * itemsize
        return cls(
            _frozen(np.ascontiguousarray(ints[:, 0])),
            _frozen(np.ascontiguousarray(ints[:, 1])),
            _frozen(ints[:, 2].astype(np.int8)),
            _frozen(ints[:, 3].astype(np.int8)),
            _frozen(ints[:, 4].astype(np.int32)),
            _frozen(ints[:, 5].astype(np.int32)),
            _frozen(np.ascontiguousarray(lo)),
            _frozen(np.ascontiguousarray(hi)),
            _frozen(nbytes),
        )

    def select(self, mask: np.ndarray) -> TensorPlan:
        """The rows where ``mask`` is true (or at the indices ``mask`` lists), in order."""
        return TensorPlan(*(_frozen(getattr(self, f.name)[mask]) for f in dataclasses.fields(self)))

    def box(self, i: int) -> Box:
        return Box(tuple(self.lo[i].tolist()), tuple(self.hi[i].tolist()))


class Emitter:
    """Where the planner appends rows, and how it picks a sender among replicas.

    ``pick(cands, base, ...)`` emits a row whose sender is ``cands[(base + rot) % len(cands)]``:
    the rotation ``rot`` spreads tensors with equal layouts over the replicas. With ``rot``
    None the emitter records a template instead (sender -1, and the choice), which
    :meth:`TensorTemplate.stamp` fills in for any rotation. With ``only`` set it keeps
    just the rows that involve rank ``only`` (templates: that may involve it).
    """

    __slots__ = ("choices", "only", "rot", "rows")

    def __init__(self, rot: int | None, only: int | None = None):
        self.rows: list[Row] = []
        self.rot = rot
        self.only = only
        self.choices: list[tuple[int, tuple[int, ...], int]] = []  # (row, candidates, base)

    def add(self, row: Row) -> None:
        """Emit a row whose sender is fixed (filtered by ``only``)."""
        only = self.only
        if only is None or row.src == only or row.dst == only:
            self.rows.append(row)

    def pick(
        self, cands: tuple[int, ...], base: int, dst: int, link: Link, phase: Phase, stage: int, unit: int, box: Box
    ) -> None:
        """Emit a row whose sender is ``cands[(base + rot) % len(cands)]``."""
        only = self.only
        if self.rot is None:
            if only is None or dst == only or only in cands:
                self.choices.append((len(self.rows), cands, base))
                self.rows.append(Row(-1, dst, link, phase, stage, unit, box))
            return
        h = cands[(base + self.rot) % len(cands)]
        if only is None or h == only or dst == only:
            self.rows.append(Row(h, dst, link, phase, stage, unit, box))

    def template(self, ndim: int, itemsize: int) -> TensorTemplate:
        groups: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
        counts = _block_sizes(tuple(r.dst for r in self.rows))
        start = None if counts is None else (np.cumsum(counts) - counts).tolist()  # entry -> its first row
        for i, cands, base in self.choices:
            if start is not None:
                i = start[i]
            rows, bases = groups.setdefault(cands, ([], []))
            rows.append(i)
            bases.append(base)
        return TensorTemplate(
            TensorPlan.from_rows(self.rows, ndim, itemsize),
            tuple(
                (_frozen(np.array(c, np.int64)), _frozen(np.array(r, np.int64)), _frozen(np.array(b, np.int64)))
                for c, (r, b) in groups.items()
            ),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class TensorTemplate:
    """A tensor's rows with the replica choices left open: ``plan.src`` is -1 where
    ``choices`` (candidates, rows, bases) pick ``candidates[(base + rot) % len]``."""

    plan: TensorPlan
    choices: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]

    @functools.cached_property
    def boxes(self) -> list[Box]:
        """Every row's box as a :class:`Box` (built once; shared by every tensor stamped from this)."""
        lo, hi = self.plan.lo.tolist(), self.plan.hi.tolist()
        return list(map(Box.trusted, map(tuple, lo), map(tuple, hi)))

    @functools.cached_property
    def matrix(self) -> np.ndarray:
        """Every row as ``(dst, link, phase, stage, nbytes, ndim, *lo, *hi)`` in one int64 array
        (built once; every column but the sender, which :meth:`stamp_many` gives)."""
        p = self.plan
        n, d = p.lo.shape
        head = np.stack([p.dst, p.link, p.phase, p.stage, p.nbytes, np.full(n, d)], axis=1).astype(np.int64)
        return _frozen(np.concatenate([head, p.lo, p.hi], axis=1).reshape(n, 6 + 2 * d))

    def stamp_many(self, rots: np.ndarray) -> np.ndarray:
        """The ``src`` column for each rotation in ``rots``: a ``(len(rots), len(plan))`` array."""
        src = np.tile(self.plan.src, (len(rots), 1))
        for cands, rows, bases in self.choices:
            src[:, rows] = cands[(bases[None, :] + rots[:, None]) % len(cands)]
        return src

    def stamp(self, rot: int) -> TensorPlan:
        """The rows for rotation ``rot`` (every column but ``src`` is shared with the template)."""
        if not self.choices:
            return self.plan
        src = self.plan.src.copy()
        for cands, rows, bases in self.choices:
            src[rows] = cands[(bases + rot) % len(cands)]
        return dataclasses.replace(self.plan, src=_frozen(src))
