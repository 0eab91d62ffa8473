"""What every unit of one (source, destination, topology) reads: the planner's context.

The source side (the disjoint source boxes, their replicas by domain and by device)
depends only on the source layout and the topology, the destination side (the
destination replica groups, their holders by domain, overlaps) only on the
destination layout and the topology: each is built once and shared by every
layout pair that has it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jreshard.sharding.box import Box
from jreshard.sharding.caches import cache
from jreshard.sharding.layout import Layout
from jreshard.sharding.overlap import Overlaps, overlaps_of
from jreshard.sharding.pieces import SourceIndex, disjoint, source_index
from jreshard.sharding.topology import Link, Topology

__all__ = ["Context", "context", "fan_link"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Context:
    """Everything about one (src, dst, topology) that every unit reads."""

    src: Layout
    dst: Layout
    topo: Topology
    sidx: SourceIndex
    groups: tuple[tuple[Box, tuple[int, ...]], ...]  # destination replica groups
    by_domain: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]  # per group: (domain, holders) sorted
    holders_in: tuple[dict[int, tuple[int, ...]], ...]  # per source box: domain -> replicas there
    on_device: tuple[dict[int, int], ...]  # per source box: device -> its smallest replica there
    dlo: np.ndarray
    dhi: np.ndarray
    overlaps: Overlaps | None  # destination groups that overlap inside one domain (overlap.py)
    shared_devices: bool  # whether two destination ranks share a device (their fan-out is then a same-device copy)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _SourceSide:
    sidx: SourceIndex
    holders_in: tuple[dict[int, tuple[int, ...]], ...]
    on_device: tuple[dict[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _DestinationSide:
    groups: tuple[tuple[Box, tuple[int, ...]], ...]
    by_domain: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]
    dlo: np.ndarray
    dhi: np.ndarray
    overlaps: Overlaps | None
    shared_devices: bool


@cache(max_size=1024)
def _source_side(src: Layout, topo: Topology) -> _SourceSide:
    """What every unit reads about the source layout (shared by every pair with this source)."""
    sidx = source_index(src)
    sides = [_spread(hs, topo) for hs in sidx.holders]
    return _SourceSide(sidx, tuple(s[0] for s in sides), tuple(s[1] for s in sides))


@cache(max_size=8192)
def _spread(hs: tuple[int, ...], topo: Topology) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
    """Replicas ``hs`` by domain, and the smallest replica on each device (tensors of many shapes share
    one set of replicas: computed once per set)."""
    domain, device = topo._domain, topo._device
    inn: dict[int, list[int]] = {}
    dev: dict[int, int] = {}
    for h in hs:
        inn.setdefault(domain[h], []).append(h)
        dev.setdefault(device[h], h)
    return {g: tuple(v) for g, v in inn.items()}, dev


@cache(max_size=1024)
def _destination_side(dst: Layout, topo: Topology) -> _DestinationSide:
    """What every unit reads about the destination layout (shared by every pair with this destination)."""
    groups = dst.replica_groups()
    domain = topo._domain
    by_domain = []
    for _, ranks in groups:
        doms: dict[int, list[int]] = {}
        for r in ranks:
            doms.setdefault(domain[r], []).append(r)
        by_domain.append(tuple((g, tuple(rs)) for g, rs in sorted(doms.items())))
    dlo = np.array([b.lo for b, _ in groups], dtype=np.int64).reshape(len(groups), dst.ndim)
    dhi = np.array([b.hi for b, _ in groups], dtype=np.int64).reshape(len(groups), dst.ndim)
    by_domain_t = tuple(by_domain)
    devs = [topo._device[r] for r in dst.ranks]
    overlaps = None if disjoint(tuple(b for b, _ in groups), dst.ndim) else overlaps_of(groups, by_domain_t, dlo, dhi)
    return _DestinationSide(groups, by_domain_t, dlo, dhi, overlaps, len(set(devs)) < len(devs))


@cache(max_size=4096)
def context(src: Layout, dst: Layout, topo: Topology) -> Context:
    topo.check_ranks(src.ranks, "the source layout")
    topo.check_ranks(dst.ranks, "the destination layout")
    s, d = _source_side(src, topo), _destination_side(dst, topo)
    return Context(
        src,
        dst,
        topo,
        s.sidx,
        d.groups,
        d.by_domain,
        s.holders_in,
        s.on_device,
        d.dlo,
        d.dhi,
        d.overlaps,
        d.shared_devices,
    )


def fan_link(ctx: Context, a: int, b: int) -> Link:
    """The link of a fan-out inside one domain: a same-device copy when the two ranks share a device."""
    if ctx.shared_devices and ctx.topo.device_of(a) == ctx.topo.device_of(b):
        return Link.SAME_DEVICE
    return Link.FAST
