"""The rows of a plan: every byte movement of one tensor, as columns of numpy arrays.

A row moves one box of one tensor from a sender rank to a receiver rank over one
link kind, for one reason (:class:`Phase`), at one dependency stage. A
:class:`TensorPlan` stores a tensor's rows column by column; a :class:`Move` is
one row as a Python value.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import NamedTuple

import numpy as np

from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.topology import Link

__all__ = ["Move", "Phase", "Row", "TensorPlan", "TensorSpec"]


class Phase(enum.IntEnum):
    """Why a transfer happens."""

    LAND = 0  # from a source replica: local copy, fast link inside G, or the network into G
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
    the index of the destination replica group it serves."""

    src: int
    dst: int
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
        """Columns from a list of :class:`Row`."""
        n = len(rows)
        cols = list(zip(*rows, strict=True)) if rows else [()] * 7
        ints = np.empty((n, 6), dtype=np.int64)
        for c in range(6):
            ints[:, c] = np.fromiter(cols[c], np.int64, n)
        # fromiter over the flattened bounds: several times faster than np.array on a list of tuples.
        boxes = cols[6]
        lo = np.fromiter(itertools.chain.from_iterable(b.lo for b in boxes), np.int64, n * ndim).reshape(n, ndim)
        hi = np.fromiter(itertools.chain.from_iterable(b.hi for b in boxes), np.int64, n * ndim).reshape(n, ndim)
        return cls.from_columns(ints, lo, hi, itemsize)

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
