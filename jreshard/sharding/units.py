"""The planner's core: the rows of one tensor's plan, one destination replica group at a time.

The unit of planning is one distinct destination box ``beta`` of one tensor,
across every domain ``G`` that holds it (``R(beta, G)`` are its holders there).
For each piece ``p = beta ∩ sigma_j`` (``sigma_j`` a disjoint source box with
replicas ``H_j``):

1. Same device first: a holder of ``beta`` on the same device as a replica copies ``p``
   there.
2. If ``G`` has a replica of ``p`` (``p ⊆ U(G)``), every other holder gets it over
   fast links from a replica in ``G``, the replicas taken in turn.
3. Otherwise ``p`` must cross the network into ``G``, once. The network pieces of
   ``beta`` in ``G`` are laid end to end and cut into ``|R(beta, G)|`` near-equal
   byte ranges (pieces striped along their outermost dimension of extent > 1), so
   every receiving NIC lands a near-equal share; each lander then fans its stripes
   out to the other holders over fast links.
4. The domains that need ``p`` over the network get it from the replicas ``H_j``
   taken in turn (source NIC balance). When they outnumber the replicas and
   relays are on, they form ``|H_j|`` chains: each replica sends ``p`` once, to
   the first domain of its chain, whose landers forward it to the next.

So each byte of ``beta \\ U(G)`` enters ``G`` exactly once: network bytes equal the
lower bound ``Σ_G Σ_beta |beta \\ U(G)|`` (see ``bounds.py``). A unit depends only
on its tensor's layouts, the topology and a rotation, so every rank computes the
same plan with no communication, and one rank's plan needs only the units it
takes part in.

Stages order the dependencies: a transfer at stage ``s`` only sends bytes its
sender held before (stage 0) or received at a stage ``< s``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jreshard.errors import LayoutMismatchError
from jreshard.options import Options
from jreshard.sharding.box import Box, intersect
from jreshard.sharding.caches import cache
from jreshard.sharding.context import Context, context, fan_link
from jreshard.sharding.landings import domain_needs
from jreshard.sharding.layout import Layout
from jreshard.sharding.pieces import overlapping, pieces_of
from jreshard.sharding.rows import Emitter, Phase, Row, TensorPlan, TensorTemplate
from jreshard.sharding.topology import Link, Topology

__all__ = [
    "check_pair",
    "plan_rows",
    "plan_tensor",
    "plan_tensor_for_rank",
    "rank_rows",
    "rank_template",
    "rotation_of",
    "rotations",
    "stripe",
    "template_of",
    "units_of_rank",
]


def check_pair(src: Layout, dst: Layout, name: str) -> None:
    """Raise LayoutMismatchError when ``src`` and ``dst`` disagree on shape or dtype."""
    if src.shape != dst.shape:
        raise LayoutMismatchError(
            f"tensor {name}: source shape {src.shape} != destination shape {dst.shape}",
            src=src.shape,
            dst=dst.shape,
            what="shape",
        )
    if src.dtype != dst.dtype:
        raise LayoutMismatchError(
            f"tensor {name}: source dtype {src.dtype} != destination dtype {dst.dtype}",
            src=src.dtype,
            dst=dst.dtype,
            what="dtype",
        )


def stripe(pieces: Sequence[tuple[int, Box]], k: int, itemsize: int, min_bytes: int) -> list[tuple[int, Box, int]]:
    """Cut ``pieces`` (laid end to end) into ``k`` near-equal byte ranges.

    Returns ``(piece_index, sub_box, lander)`` triples covering every piece
    exactly once. A piece is cut only along its first dimension of extent > 1,
    at row boundaries, and never into parts smaller than ``min_bytes``; lander
    ``q`` takes the bytes nearest to ``[q*T/k, (q+1)*T/k)`` of the total ``T``.
    """
    out: list[tuple[int, Box, int]] = []
    total = sum(b.volume for _, b in pieces) * itemsize
    if k <= 1 or total == 0:
        return [(i, b, 0) for i, b in pieces]
    pos, cursor = 0, 0
    floor = 2 * max(min_bytes, 1)
    trusted = Box.trusted
    for i, box in pieces:
        rest: Box | None = box  # the part of the piece not yet given to a lander, as bounds and a Box made on demand
        lo, hi = box.lo, box.hi
        shape = [b - a for a, b in zip(lo, hi, strict=True)]
        nbytes = math.prod(shape) * itemsize
        while True:
            while pos < k - 1 and (pos + 1) * total <= cursor * k:
                pos += 1
            space = ((pos + 1) * total) / k - cursor
            d = -1
            for e, n in enumerate(shape):
                if n > 1:
                    d = e
                    break
            if pos == k - 1 or d < 0 or nbytes <= space or nbytes < floor:
                out.append((i, rest if rest is not None else trusted(lo, hi), pos))
                cursor += nbytes
                break
            row = nbytes // shape[d]
            rows = round(space / row)
            if rows == 0:
                pos += 1
                continue
            rows = max(rows, -(-min_bytes // row))
            if rows >= shape[d] or (shape[d] - rows) * row < min_bytes:
                out.append((i, rest if rest is not None else trusted(lo, hi), pos))
                cursor += nbytes
                break
            at = lo[d] + rows
            out.append((i, trusted(lo, (*hi[:d], at, *hi[d + 1 :])), pos))
            lo = (*lo[:d], at, *lo[d + 1 :])
            rest = None
            shape[d] -= rows
            nbytes -= rows * row
            cursor += rows * row
            pos += 1
    return out


def _plan_unit(ctx: Context, u: int, opts: Options, out: Emitter) -> None:
    """Emit the rows of destination replica group ``u`` into ``out`` (module docstring).

    With ``out.only`` set, emit just the rows that send from or arrive at rank
    ``only``, in the same order: hops of a chain that ``only`` takes no part in
    are skipped, except for the landings it may send as a replica.
    """
    only = out.only
    beta, _ = ctx.groups[u]
    itemsize = ctx.src.itemsize
    pcs = pieces_of(beta, ctx.sidx)
    ranks_of, nets, need, partial = domain_needs(ctx, u, pcs, out)
    shared = ctx.shared_devices
    fan = Phase.FANOUT
    # stripe() is a pure function of (pieces, landers): domains with equal inputs share one result,
    # and a domain's stripes are cut only when a row needs them. by_piece[g][k]: the (sub_box, lander)
    # stripes of piece k in domain g, in stripe order. Domains often share one tuple of pieces:
    # by_id finds its result without hashing the tuple again.
    striped: dict[tuple, dict[int, list[tuple[Box, int]]]] = {}
    by_id: dict[tuple[int, int], dict[int, list[tuple[Box, int]]]] = {}
    by_piece: dict[int, dict[int, list[tuple[Box, int]]]] = {}

    def stripes_of(g: int) -> dict[int, list[tuple[Box, int]]]:
        got = by_piece.get(g)
        if got is None:
            net, landers = nets[g], len(ranks_of[g])
            got = by_id.get((id(net), landers))
            if got is None:
                got = striped.get((net, landers))
                if got is None:
                    got = {}
                    for kk, b, q in stripe(net, landers, itemsize, opts.min_stripe_bytes):
                        got.setdefault(kk, []).append((b, q))
                    striped[(net, landers)] = got
                by_id[(id(net), landers)] = got
            by_piece[g] = got
        return got

    dom_only = None if only is None else next((g for g, hs in ranks_of.items() if only in hs), None)
    for k, doms in enumerate(need):
        if not doms:
            continue
        replicas = ctx.sidx.holders[pcs[k][1]]
        bystander = only is not None and only not in replicas  # then only rows of only's own domain involve it
        if bystander and dom_only not in doms:
            continue  # only neither sends nor receives piece k over the network
        # A domain that takes part of the piece from an earlier group holds no whole piece to relay:
        # it gets the rest straight from the replicas.
        whole = [g for g in doms if (k, g) not in partial] if partial else doms
        s, m = len(replicas), len(whole)
        if opts.relays and m > s:
            chains = [whole[c * m // s : (c + 1) * m // s] for c in range(s)]
        else:
            chains = [[g] for g in whole]
        if partial:
            chains += [[g] for g in doms if (k, g) in partial]
        turn = k  # the emitter adds the rotation
        for chain in chains:
            if bystander and dom_only not in chain:
                turn += len(stripes_of(chain[0]).get(k, ()))  # its landings only advance the rotation
                continue
            prev: tuple[tuple[int, ...], list[tuple[Box, int]]] | None = None
            hops = range(len(chain))
            if bystander:
                # Only two hops can involve only: landing in (or relayed into) its domain, and the relay
                # out of it. The hop before needs only its stripes; the head's turn matters only if it is
                # only's domain.
                i = chain.index(dom_only)  # type: ignore[arg-type]  # a bystander has a domain
                hops = range(i, min(i + 2, len(chain)))
                if i > 0:
                    prev = (ranks_of[chain[i - 1]], stripes_of(chain[i - 1]).get(k, []))
            for hop in hops:
                g = chain[hop]
                holders = ranks_of[g]
                if only is not None and only not in holders and (prev is None or only not in prev[0]):
                    # No row of this hop involves ``only`` except a landing it sends as a replica;
                    # the landings still advance ``turn``.
                    mine = stripes_of(g).get(k, []) if prev is None or hop + 1 < len(chain) else []
                    if prev is None:
                        if only not in replicas:
                            turn += len(mine)  # the landings only advance the rotation
                        else:
                            for b, q in mine:
                                out.pick(replicas, turn, holders[q], Link.NETWORK, Phase.LAND, 0, u, b)
                                turn += 1
                    prev = (holders, mine)
                    continue
                mine = stripes_of(g).get(k, [])
                if prev is None:
                    for b, q in mine:
                        out.pick(replicas, turn, holders[q], Link.NETWORK, Phase.LAND, 0, u, b)
                        turn += 1
                elif prev[1] is mine:
                    # Both hops cut piece k alike (one shared stripe() result), and the stripes of a
                    # piece are disjoint: stripe b meets only itself, so the relay is lander q -> lander q.
                    prev_holders = prev[0]
                    for b, q in mine:
                        out.add(Row(prev_holders[q], holders[q], Link.NETWORK, Phase.RELAY, hop, u, b))
                else:
                    prev_holders, prev_mine = prev
                    for b, q in mine:
                        for pb, pq in prev_mine:
                            if only is not None and prev_holders[pq] != only and holders[q] != only:
                                continue
                            x = intersect(b, pb)
                            if x is not None:
                                out.add(Row(prev_holders[pq], holders[q], Link.NETWORK, Phase.RELAY, hop, u, x))
                rows = out.rows
                for b, q in mine:
                    lander = holders[q]
                    if only is None or lander == only:
                        if not shared:  # one block row: the same box to every other holder
                            if len(holders) > 1:
                                rows.append(Row(lander, holders[:q] + holders[q + 1 :], Link.FAST, fan, hop + 1, u, b))
                            continue
                        for qq, r in enumerate(holders):
                            if qq != q:
                                rows.append(Row(lander, r, fan_link(ctx, lander, r), fan, hop + 1, u, b))
                    elif only in holders and holders.index(only) != q:
                        rows.append(Row(lander, only, fan_link(ctx, lander, only), fan, hop + 1, u, b))
                prev = (holders, mine)
            if bystander:
                break  # the one chain through only's domain is done: no later chain involves only


@cache(max_size=4096)
def _rotation_period(ctx: Context) -> int | None:
    """Rotations act modulo the replica counts; beyond 64 distinct values, don't share."""
    p = 1
    for hs in ctx.sidx.holders:
        p = math.lcm(p, len(hs))
    for inside in ctx.holders_in:
        for v in inside.values():
            p = math.lcm(p, len(v))
    return p if p <= 64 else None


def _rotation(ctx: Context, tensor_index: int) -> int:
    period = _rotation_period(ctx)
    return tensor_index % period if period else tensor_index


def rotations(src: Layout, dst: Layout, topo: Topology, tensor_indices: Sequence[int]) -> np.ndarray:
    """The replica rotation of each tensor index, for tensors with layouts ``src`` and ``dst``."""
    period = _rotation_period(context(src, dst, topo))
    idx = np.asarray(tensor_indices, dtype=np.int64)
    return idx % period if period else idx


@cache(max_size=1024)
def _template(src: Layout, dst: Layout, topo: Topology, opts: Options) -> TensorTemplate:
    """Every row of the tensor, replica choices open: planned once per layout pair, stamped per tensor."""
    ctx = context(src, dst, topo)
    out = Emitter(None)
    for u in range(len(ctx.groups)):
        _plan_unit(ctx, u, opts, out)
    return out.template(src.ndim, src.itemsize)


@cache(max_size=4096)
def _tensor_plan(src: Layout, dst: Layout, topo: Topology, opts: Options, rot: int) -> TensorPlan:
    return _template(src, dst, topo, opts).stamp(rot)


def template_of(src: Layout, dst: Layout, topo: Topology, opts: Options) -> TensorTemplate:
    """A layout pair's template, planned afresh and not kept (for simulations too large to cache)."""
    return _template.__wrapped__(src, dst, topo, opts)  # type: ignore[attr-defined]


def rotation_of(src: Layout, dst: Layout, topo: Topology, tensor_index: int) -> int:
    """The replica rotation of tensor ``tensor_index`` (a pure function of its layouts and index)."""
    return _rotation(context(src, dst, topo), tensor_index)


def plan_rows(src: Layout, dst: Layout, topo: Topology, opts: Options, rot: int) -> TensorPlan:
    """The rows for rotation ``rot``, planned directly (no template): the reference the templates must equal."""
    ctx = context(src, dst, topo)
    out = Emitter(rot)
    for u in range(len(ctx.groups)):
        _plan_unit(ctx, u, opts, out)
    return TensorPlan.from_rows(out.rows, src.ndim, src.itemsize)


def plan_tensor(src: Layout, dst: Layout, topo: Topology, opts: Options, tensor_index: int = 0) -> TensorPlan:
    """The plan of one tensor; ``tensor_index`` rotates replica choices so that
    many tensors with the same layouts spread over the replicas."""
    return _tensor_plan(src, dst, topo, opts, _rotation(context(src, dst, topo), tensor_index))


def units_of_rank(src: Layout, dst: Layout, topo: Topology, rank: int) -> list[int]:
    """The destination replica groups whose unit involves ``rank``: the group it
    holds, and every group whose box meets a box ``rank`` holds as a source."""
    ctx = context(src, dst, topo)
    units: set[int] = set()
    idx = src._index()
    if rank in idx:
        units.update(overlapping(ctx.dlo, ctx.dhi, idx[rank]).tolist())
        if src.ndim == 0:
            units.update(range(len(ctx.groups)))
    didx = dst._index()
    if rank in didx:
        units.add(next(u for u, (b, rs) in enumerate(ctx.groups) if b == didx[rank]))
        if ctx.overlaps is not None:  # later groups that take what they share with rank's box from it
            units.update(overlapping(ctx.dlo, ctx.dhi, didx[rank]).tolist())
    return sorted(units)


@cache(max_size=8192)
def _rank_template(src: Layout, dst: Layout, topo: Topology, opts: Options, rank: int) -> TensorTemplate:
    """The rows that may involve ``rank`` for some rotation, from only the units it takes part in."""
    ctx = context(src, dst, topo)
    out = Emitter(None, only=rank)
    for u in units_of_rank(src, dst, topo, rank):
        _plan_unit(ctx, u, opts, out)
    return out.template(src.ndim, src.itemsize)


def rank_template(src: Layout, dst: Layout, topo: Topology, opts: Options, rank: int) -> TensorTemplate:
    """The rows of one tensor's plan that may involve ``rank`` for some rotation, replica choices open,
    from only the units that rank takes part in (cached per layout pair and rank)."""
    return _rank_template(src, dst, topo, opts, rank)


def rank_rows(
    src: Layout, dst: Layout, topo: Topology, opts: Options, rank: int, tensor_index: int = 0
) -> tuple[TensorPlan, list[Box]]:
    """The rows of one tensor's plan that send from or arrive at ``rank``, and their boxes,
    built from only the units that rank takes part in (one template per layout pair and rank)."""
    tmpl = _rank_template(src, dst, topo, opts, rank)
    tp = tmpl.stamp(_rotation(context(src, dst, topo), tensor_index))
    if not len(tp):
        return tp, []
    keep = (tp.src == rank) | (tp.dst == rank)
    if keep.all():
        return tp, tmpl.boxes
    idx = np.flatnonzero(keep)
    boxes = tmpl.boxes
    return tp.select(idx), [boxes[i] for i in idx.tolist()]


def plan_tensor_for_rank(
    src: Layout, dst: Layout, topo: Topology, opts: Options, rank: int, tensor_index: int = 0
) -> TensorPlan:
    """The rows of one tensor's plan that send from or arrive at ``rank`` (see :func:`rank_rows`)."""
    return rank_rows(src, dst, topo, opts, rank, tensor_index)[0]
