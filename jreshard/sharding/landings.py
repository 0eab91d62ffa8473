"""The first step of planning one destination replica group: what each domain has, and what it needs.

For group ``u`` (box ``beta``, its holders by domain) and the pieces of ``beta``
(``beta ∩ sigma_j``), every domain ``G`` that holds ``beta`` either has a replica
of a piece inside (its holders get it on their device or over fast links, emitted here),
takes part of it from an earlier group that overlaps ``u`` in ``G`` (``overlap.py``),
or needs it over the network. :func:`domain_needs` emits the first two kinds of
rows and returns the third: per domain the pieces it needs, per piece the domains
that need it.

Most domains of a large job hold no replica of most pieces (a source box lives on
a few domains), so the common case, no overlapping destination groups, walks only
the (piece, domain) pairs that do have a replica inside, and shares one list of
pieces among every domain that has none.
"""

from __future__ import annotations

from jreshard.sharding.box import Box
from jreshard.sharding.context import Context
from jreshard.sharding.overlap import take_from_earlier
from jreshard.sharding.rows import Emitter, Phase, Row
from jreshard.sharding.topology import Link

__all__ = ["Needs", "domain_needs"]

# (holders of u per domain, the network pieces each domain needs (piece index, box), the domains that
# need each piece over the network, the (piece, domain) pairs that take part of the piece from earlier groups)
Needs = tuple[
    dict[int, tuple[int, ...]],
    dict[int, tuple[tuple[int, Box], ...]],
    list[list[int]],
    set[tuple[int, int]],
]


def _land_inside(
    ctx: Context, u: int, g: int, k: int, pbox: Box, j: int, holders: tuple[int, ...], out: Emitter
) -> None:
    """The rows that bring piece ``k`` (source box ``j``) to ``holders`` from the replicas in their domain ``g``."""
    inside = ctx.holders_in[j][g]
    only = out.only
    if only is not None and only not in holders and only not in inside:
        return  # no row of this landing involves only (a same-device replica is inside too)
    device_of = ctx.topo.device_of
    for q, r in enumerate(holders):
        h = ctx.on_device[j].get(device_of(r))
        if h is not None:
            out.add(Row(h, r, Link.SAME_DEVICE, Phase.LAND, 0, u, pbox))
        else:
            out.pick(inside, q + k, r, Link.FAST, Phase.LAND, 0, u, pbox)


def domain_needs(ctx: Context, u: int, pcs: list[tuple[Box, int]], out: Emitter) -> Needs:
    """Emit the landings of group ``u``'s pieces ``pcs`` from replicas inside each domain (and from
    earlier groups), and return what must cross the network (see the module docstring)."""
    doms = ctx.by_domain[u]
    ranks_of = dict(doms)
    if ctx.overlaps is not None:
        return _with_overlaps(ctx, u, pcs, out, ranks_of)
    # Which domains of u hold a replica of each piece: only those pairs are walked.
    inside_at: dict[int, list[int]] = {}  # domain -> the pieces it has a replica of, ascending
    inside_of: list[set[int] | None] = []  # piece -> the domains of u with a replica of it
    for k, (_, j) in enumerate(pcs):
        got = None
        for g in ctx.holders_in[j]:
            if g in ranks_of:
                inside_at.setdefault(g, []).append(k)
                if got is None:
                    got = set()
                got.add(g)
        inside_of.append(got)
    every = tuple((k, pbox) for k, (pbox, _) in enumerate(pcs))
    nets: dict[int, tuple[tuple[int, Box], ...]] = {}
    for g, holders in doms:
        ins = inside_at.get(g)
        if ins is None:
            if every:
                nets[g] = every  # one tuple shared by every domain without a replica of any piece
            continue
        for k in ins:
            pbox, j = pcs[k]
            _land_inside(ctx, u, g, k, pbox, j, holders, out)
        if len(ins) < len(pcs):
            have = set(ins)
            nets[g] = tuple(p for p in every if p[0] not in have)
    all_doms = [g for g, _ in doms]
    need = [all_doms if ins is None else [g for g in all_doms if g not in ins] for ins in inside_of]
    return ranks_of, nets, need, set()


def _with_overlaps(
    ctx: Context, u: int, pcs: list[tuple[Box, int]], out: Emitter, ranks_of: dict[int, tuple[int, ...]]
) -> Needs:
    """:func:`domain_needs` when destination groups overlap: every (domain, piece) in turn."""
    ov = ctx.overlaps
    assert ov is not None
    need: list[list[int]] = [[] for _ in pcs]
    nets: dict[int, tuple[tuple[int, Box], ...]] = {}
    partial: set[tuple[int, int]] = set()  # (piece, domain): the domain takes part of the piece from earlier groups
    for g, holders in ctx.by_domain[u]:
        net: list[tuple[int, Box]] = []
        for k, (pbox, j) in enumerate(pcs):
            if ctx.holders_in[j].get(g):
                _land_inside(ctx, u, g, k, pbox, j, holders, out)
                continue
            if g in ov.earlier[u]:
                rest = take_from_earlier(ov, ctx.groups, ctx.topo, u, g, holders, k, pbox, out)
                if rest != [pbox]:
                    partial.add((k, g))
                net.extend((k, b) for b in rest)
                if rest:
                    need[k].append(g)
                continue
            net.append((k, pbox))
            need[k].append(g)
        if net:
            nets[g] = tuple(net)
    return ranks_of, nets, need, partial
