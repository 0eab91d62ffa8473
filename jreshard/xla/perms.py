"""Permutations: a stage's messages cut into the rounds of one ``ppermute`` each (numpy, no jax).

``jax.lax.ppermute`` sends one buffer of one shape from every sender of a permutation (a set of
``(sender, receiver)`` pairs in which no device sends twice or receives twice). A stage of a plan
is a multigraph: a rank may send to several peers and receive from several. So each stage's
messages are cut into permutations, and every pair of a permutation sends the same number of
bytes, its ``length``: a pair with fewer pads up to it.

**The cut.** Repeat until every byte of the stage is placed: take the messages with bytes left,
largest remainder first (ties by sender, then receiver: deterministic); the first sets the
length ``L = min(remainder, cap)``; add each next message whose ends are both still free and
whose next segment ``min(remainder, L)`` is at least ``(1 - tol) L``. Every member moves
``min(remainder, L)`` bytes and pads the rest, so a permutation's padding is at most ``tol L``
per member against at least ``(1 - tol) L`` moved: padding is at most ``tol / (1 - tol)`` of the
bytes moved (5.3% at the default ``tol = 0.05``), whatever the plan. Each permutation ends the
message it started from (or moves ``cap`` bytes of it), so a stage has at most
``messages + bytes / cap`` permutations; equal messages (the common case: pair-balanced plans)
cut into as few permutations as the busiest rank has peers.

The same cut is made by every process from the plan alone.

Example:
  >>> cut = permutations([0, 0, 1], [2, 3, 3], [100, 60, 96], cap=1 << 20)
  >>> [(p.length, [(s.message, s.start, s.stop) for s in p.segments]) for p in cut]
  [(100, [(0, 0, 100), (2, 0, 96)]), (60, [(1, 0, 60)])]
  >>> padding_bytes(cut)
  4
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["Permutation", "Segment", "padding_bytes", "permutations"]

TOLERANCE = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """Bytes ``[start, stop)`` of message ``message`` (its index in the stage's list)."""

    message: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True, slots=True)
class Permutation:
    """One ``ppermute``: each segment's sender sends its receiver ``length`` bytes (the segment, padded)."""

    length: int
    segments: tuple[Segment, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def wire_bytes(self) -> int:
        """Bytes the collective moves, padding included."""
        return self.length * len(self.segments)


def permutations(
    src: Sequence[int], dst: Sequence[int], nbytes: Sequence[int], *, cap: int, tol: float = TOLERANCE
) -> list[Permutation]:
    """Cut one stage's messages (``src[i] -> dst[i]``, ``nbytes[i]`` bytes) into permutations (module docstring).

    Args:
      src, dst, nbytes: the messages; no two share both ends (the plan sends one message per pair
        and stage), and none is from a rank to itself.
      cap: the most bytes one pair sends in one permutation.
      tol: the padding a member may add, as a share of the length (``0 <= tol < 1``).

    Raises:
      ValueError: ``cap < 1``, ``tol`` out of range, or a message from a rank to itself.
    """
    if cap < 1:
        raise ValueError(f"permutations: cap={cap} must be >= 1")
    if not 0 <= tol < 1:
        raise ValueError(f"permutations: tol={tol} must be in [0, 1)")
    if any(a == b for a, b in zip(src, dst, strict=True)):
        raise ValueError("permutations: a message from a rank to itself is a same-device copy, not a permutation")
    src_a, dst_a = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    left = np.asarray(nbytes, np.int64).copy()  # bytes not yet placed, per message
    out: list[Permutation] = []
    active = np.flatnonzero(left > 0)
    while len(active):
        part = np.minimum(left[active], cap)
        order = active[np.lexsort((dst_a[active], src_a[active], -part))]  # largest first, then (src, dst)
        length = int(min(left[order[0]], cap))
        floor = (1 - tol) * length
        busy_src: set[int] = set()
        busy_dst: set[int] = set()
        segs: list[Segment] = []
        for i in order.tolist():
            take = int(min(left[i], length))
            if take < floor:
                break  # sorted by remainder: every later one is smaller still
            a, b = int(src_a[i]), int(dst_a[i])
            if a in busy_src or b in busy_dst:
                continue
            busy_src.add(a)
            busy_dst.add(b)
            start = int(nbytes[i]) - int(left[i])
            segs.append(Segment(i, start, start + take))
            left[i] -= take
        out.append(Permutation(length, tuple(segs)))
        active = active[left[active] > 0]
    return out


def padding_bytes(perms: Sequence[Permutation]) -> int:
    """Bytes the permutations send beyond their segments."""
    return sum(p.wire_bytes - p.payload_bytes for p in perms)
