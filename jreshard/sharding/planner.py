"""The planner: a :class:`Plan` for layout pairs, or one rank's :class:`RankPlan` without the whole plan.

Each tensor's rows come from :mod:`jreshard.sharding.units` (one destination
replica group at a time); tensors with equal layouts, topology and options share
their rows (planned once, stamped for each tensor, up to the replica rotation
that spreads many tensors over the source replicas).
"""

from __future__ import annotations

from collections.abc import Sequence

from jreshard.options import Options
from jreshard.sharding.caches import cache, register_clear
from jreshard.sharding.layout import Layout
from jreshard.sharding.plan import Plan
from jreshard.sharding.rankplan import RankPlan, stamped_rank_plan
from jreshard.sharding.rows import TensorSpec
from jreshard.sharding.topology import Topology
from jreshard.sharding.units import check_pair, plan_tensor, rank_template, rotations

__all__ = [
    "LayoutPair",
    "check_pairs",
    "default_topology",
    "plan_layouts",
    "prepare_pairs",
    "rank_plan",
    "rank_plans",
    "tensor_names",
]

LayoutPair = tuple[Layout, Layout]  # (source layout, destination layout) of one tensor


def check_pairs(pairs: Sequence[LayoutPair], topology: Topology, names: Sequence[str]) -> None:
    """Raise when a pair disagrees on shape or dtype, or names a rank the topology lacks."""
    seen: set[int] = set()  # ids of the layouts checked against the topology (equal layouts are one object)
    pairs_seen: set[tuple[int, int]] = set()  # tensors of one layout pair share the two objects: check once
    for (src, dst), name in zip(pairs, names, strict=True):
        key = (id(src), id(dst))
        if key in pairs_seen:
            continue
        pairs_seen.add(key)
        check_pair(src, dst, name)
        if id(src) not in seen:
            if not _ranks_known(src, topology):
                topology.check_ranks(src.ranks, f"the source layout of tensor {name}")
            seen.add(id(src))
        if id(dst) not in seen:
            if not _ranks_known(dst, topology):
                topology.check_ranks(dst.ranks, f"the destination layout of tensor {name}")
            seen.add(id(dst))


@cache(max_size=8192)
def _ranks_known(layout: Layout, topology: Topology) -> bool:
    """Whether the topology has every rank of the layout (remembered: a refit asks again every step)."""
    return topology._domain.keys() >= set(layout.ranks)


def default_topology(pairs: Sequence[LayoutPair]) -> Topology:
    """Every rank its own device and its own domain: each move between ranks is
    counted as network traffic (the conservative view when nothing is known)."""
    ranks = sorted({r for s, d in pairs for r in (*s.ranks, *d.ranks)})
    return Topology.from_domains({r: r for r in ranks}, devices={r: r for r in ranks})


def tensor_names(pairs: Sequence[LayoutPair], names: Sequence[str] | None) -> tuple[str, ...]:
    """``names`` as a tuple (``"0"``, ``"1"``, ... by default), one per pair."""
    if names is None:
        return tuple(str(i) for i in range(len(pairs)))
    names = tuple(names)
    if len(names) != len(pairs):
        raise ValueError(f"names has {len(names)} entries for {len(pairs)} tensors")
    return names


_CANONICAL: dict[Layout, Layout] = {}  # each layout value -> the first object seen with it
_SEEN: dict[int, tuple[Layout, Layout]] = {}  # id(layout) -> (layout, its canonical); holding it keeps the id valid
_MAX_SEEN = 8192


def _clear_canonical() -> None:
    _CANONICAL.clear()
    _SEEN.clear()


register_clear(_clear_canonical)


def _canonical_layout(lay: Layout) -> Layout:
    hit = _SEEN.get(id(lay))
    if hit is not None and hit[0] is lay:
        return hit[1]
    if len(_SEEN) >= _MAX_SEEN or len(_CANONICAL) >= _MAX_SEEN:
        _clear_canonical()
    got = _CANONICAL.setdefault(lay, lay)
    _SEEN[id(lay)] = (lay, got)
    return got


def _canonical(pairs: Sequence[LayoutPair]) -> tuple[LayoutPair, ...]:
    """The pairs with every layout replaced by the first equal layout seen (an equal value).

    Cache lookups then compare layouts by identity: equal layouts built anew (one
    ``Layout`` object per tensor, say) are compared deeply once per object, not once
    per tensor on every lookup. Bounded, and emptied by ``clear_caches()``.
    """
    memo: dict[tuple[int, int], LayoutPair] = {}  # tensors of one layout pair often share the two objects
    out = []
    for s, d in pairs:
        key = (id(s), id(d))
        got = memo.get(key)
        if got is None:
            got = memo[key] = (_canonical_layout(s), _canonical_layout(d))
        out.append(got)
    return tuple(out)


def _check_inputs(topology: object, options: object) -> None:
    Topology.check_arg(topology)
    Options.of(options)


def prepare_pairs(
    pairs: Sequence[LayoutPair], topology: Topology | None, options: Options | None, names: Sequence[str] | None
) -> tuple[tuple[LayoutPair, ...], Topology, Options]:
    """Check the arguments and return the canonical pairs, the topology and the options (defaults filled in)."""
    _check_inputs(topology, options)
    pairs = _canonical(pairs)
    topology = topology or default_topology(pairs)
    options = options or Options()
    check_pairs(pairs, topology, tensor_names(pairs, names))
    return pairs, topology, options


@cache(max_size=128)
def _plan_cached(pairs: tuple[LayoutPair, ...], topology: Topology, options: Options, names: tuple[str, ...]) -> Plan:
    check_pairs(pairs, topology, names)
    tps = [plan_tensor(s, d, topology, options, t) for t, (s, d) in enumerate(pairs)]
    return Plan([TensorSpec(n, s, d) for n, (s, d) in zip(names, pairs, strict=True)], topology, options, tps)


def plan_layouts(
    pairs: Sequence[LayoutPair],
    topology: Topology | None = None,
    options: Options | None = None,
    names: Sequence[str] | None = None,
) -> Plan:
    """Plan moving each tensor from its source layout to its destination layout.

    Plans are cached by their inputs: asking again for the same layouts,
    topology and planning options returns the same :class:`Plan`.

    Raises:
      TypeError: ``topology`` or ``options`` is not a Topology / Options.
    """
    _check_inputs(topology, options)
    pairs = _canonical(pairs)
    topology = topology or default_topology(pairs)
    options = options or Options()
    key_opts = Options(relays=options.relays, min_stripe_bytes=options.min_stripe_bytes)
    p = _plan_cached(pairs, topology, key_opts, tensor_names(pairs, names))
    if p.options != options:
        p = Plan(p.tensors, p.topology, options, p.tensor_plans, p.kind)
    return p


def rank_plan(
    pairs: Sequence[LayoutPair],
    rank: int,
    topology: Topology | None = None,
    options: Options | None = None,
    names: Sequence[str] | None = None,
) -> RankPlan:
    """One rank's plan, built from only the units that rank takes part in.

    Equal to ``plan_layouts(...).rank_plan(rank)`` without planning other ranks' units.
    Cached by its inputs, like plans.
    """
    pairs, topology, options = prepare_pairs(pairs, topology, options, names)
    key_opts = Options(relays=options.relays, min_stripe_bytes=options.min_stripe_bytes)
    return _rank_plan_cached(pairs, rank, topology, key_opts)


@cache(max_size=256)
def _rank_plan_cached(pairs: tuple[LayoutPair, ...], rank: int, topology: Topology, options: Options) -> RankPlan:
    by_pair: dict[LayoutPair, list[int]] = {}
    for t, pair in enumerate(pairs):
        by_pair.setdefault(pair, []).append(t)
    blocks = []
    for (s, d), tensors in by_pair.items():
        if rank not in s._index() and rank not in d._index():
            continue  # every row of this pair is between two other ranks
        blocks.append((rank_template(s, d, topology, options, rank), tensors, rotations(s, d, topology, tensors)))
    width = max((s.ndim for s, _ in pairs), default=0)
    return stamped_rank_plan(rank, blocks, width)


def rank_plans(
    pairs: Sequence[LayoutPair],
    ranks: Sequence[int],
    topology: Topology | None = None,
    options: Options | None = None,
    names: Sequence[str] | None = None,
) -> dict[int, RankPlan]:
    """The plans of the ranks one process drives, ``{rank: RankPlan}``, without the whole plan.

    Each equals ``plan_layouts(...).rank_plan(rank)``: what the rank sends, receives (from
    whom, at which stage, the pieces in order) and copies on its device.
    """
    pairs, topology, options = prepare_pairs(pairs, topology, options, names)
    key_opts = Options(relays=options.relays, min_stripe_bytes=options.min_stripe_bytes)
    return {rank: _rank_plan_cached(pairs, rank, topology, key_opts) for rank in sorted(set(ranks))}
