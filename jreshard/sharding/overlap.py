"""Destination boxes that overlap inside one domain: each shared element enters the domain once.

Distinct destination boxes of a ``NamedSharding`` never overlap. Hand-written
layouts (halos, uneven producers) may: ranks 1 and 2 of one domain holding
``[0, 3)`` and ``[1, 4)``. The network bound counts an element of the union once
per domain (``bounds.py``), so the planner must too: a destination group ``u``
takes, in each domain ``G``, what an *earlier* group ``e < u`` held in ``G`` also
needs from that group's holders over fast links (or a same-device copy), once ``e`` is
complete there, and only the rest over the network.

``ready[e]`` is a stage by which every holder of ``e`` has all of its box: its
landings are at stage 0, relays at stage ``hop`` and fan-outs at ``hop + 1``, with
``hop`` below the number of domains that hold ``e``; copies from earlier groups
come at ``ready[e'] + 1``. So a copy out of ``e`` at stage ``ready[e] + 1`` only
sends bytes its sender has.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jreshard.sharding.box import Box, difference, intersect
from jreshard.sharding.pieces import overlapping
from jreshard.sharding.rows import Emitter, Phase, Row
from jreshard.sharding.topology import Link, Topology

__all__ = ["Overlaps", "overlaps_of", "take_from_earlier"]

Holders = tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Overlaps:
    """For each destination group ``u``: ``earlier[u][G]`` are the ``(e, holders of e in G)``
    with ``e < u`` whose box meets ``u``'s, and ``ready[u]`` (module docstring)."""

    earlier: tuple[dict[int, tuple[tuple[int, Holders], ...]], ...]
    ready: tuple[int, ...]


def overlaps_of(
    groups: tuple[tuple[Box, Holders], ...],
    by_domain: tuple[tuple[tuple[int, Holders], ...], ...],
    dlo: np.ndarray,
    dhi: np.ndarray,
) -> Overlaps | None:
    """The :class:`Overlaps` of the destination groups, or None when no two of them overlap."""
    earlier: list[dict[int, tuple[tuple[int, Holders], ...]]] = []
    ready: list[int] = []
    any_overlap = False
    for u, (beta, _) in enumerate(groups):
        mine = dict(by_domain[u])
        got: dict[int, list[tuple[int, Holders]]] = {}
        r = len(by_domain[u])
        for e in overlapping(dlo, dhi, beta).tolist():
            if e >= u:
                continue
            for g, hs in by_domain[e]:
                if g in mine:
                    got.setdefault(g, []).append((e, hs))
                    r = max(r, ready[e] + 1)
        any_overlap = any_overlap or bool(got)
        earlier.append({g: tuple(v) for g, v in got.items()})
        ready.append(r)
    return Overlaps(tuple(earlier), tuple(ready)) if any_overlap else None


def take_from_earlier(
    ov: Overlaps,
    groups: tuple[tuple[Box, Holders], ...],
    topo: Topology,
    u: int,
    g: int,
    holders: Holders,
    k: int,
    pbox: Box,
    out: Emitter,
) -> list[Box]:
    """Append the rows that fill ``pbox`` (piece ``k`` of group ``u``) in domain ``g`` from earlier
    groups held there; return what is left of ``pbox`` (disjoint boxes), which must cross the network."""
    rest = [pbox]
    for e, hs in ov.earlier[u].get(g, ()):
        beta_e = groups[e][0]
        left: list[Box] = []
        for b in rest:
            x = intersect(b, beta_e)
            if x is None:
                left.append(b)
                continue
            left.extend(difference(b, beta_e))
            for q, r in enumerate(holders):
                dev = topo.device_of(r)
                h = next((h for h in hs if topo.device_of(h) == dev), None)
                if h is not None:
                    out.add(Row(h, r, Link.SAME_DEVICE, Phase.FANOUT, ov.ready[e] + 1, u, x))
                else:
                    out.pick(hs, q + k, r, Link.FAST, Phase.FANOUT, ov.ready[e] + 1, u, x)
        rest = left
        if not rest:
            break
    return rest
