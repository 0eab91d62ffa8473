"""One refit between two processes: its plan, its shards, and the one call into the engine.

Every refit of elastic refit is between exactly two processes, a *source*
(the trainer, or a replica that already holds the version) and one
*destination* replica, so one replica's failure touches no other transfer.
Ranks are numbered source devices first, then destination devices; each
side is its own fast-link domain. Both processes compute the same plan from
the two declarations (the dicts of :mod:`jreshard.refit_decl`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from jreshard.elastic.sockcomm import SocketComm
from jreshard.elastic.types import CatchUp
from jreshard.elastic.wire import Channel
from jreshard.options import Options
from jreshard.refit_decl import declare_local, group_layouts, leaf_differences, validate

__all__ = [
    "Pair",
    "check_like",
    "check_pair",
    "choose_source",
    "leaves_by_name",
    "pair_plan",
    "run_pair",
    "source_shards",
    "target_devices",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Pair:
    """The plan of one source process to one destination process (immutable)."""

    plan: Any  # jreshard.Plan
    topology: Any  # jreshard.Topology
    names: tuple[str, ...]
    src_ranks: int  # the destination's first rank

    def predicted_seconds(self) -> float:
        """The cost model's *predicted* time of this refit."""
        from jreshard import cost

        return float(cost.predict(self.plan, self.topology).seconds)


def _as(role: str, decl: Mapping[str, Any]) -> dict:
    return {**decl, "role": role, "domain": None}


def leaves_by_name(tree: Any) -> list[tuple[str, Any]]:
    """``[(key path, leaf)]`` in the tree's order (the names declarations use)."""
    import jax

    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p) or "x", a) for p, a in leaves]


def check_like(tree: Any, decl: dict, role: str, devices: Sequence[Any], who: str) -> None:
    """Raise ``ValueError`` naming each leaf and field where ``tree`` differs from the declaration."""
    now = declare_local(role, tree, devices, None)
    if now["errors"]:
        raise ValueError(f"{who}: " + "; ".join(now["errors"]))
    diff = leaf_differences(now["params"], decl["params"])
    if diff:
        raise ValueError(f"{who}: the tree does not match the declaration: " + "; ".join(diff))


def check_pair(src: Mapping[str, Any], dst: Mapping[str, Any]) -> list[str]:
    """Every problem between a source declaration and a destination declaration (empty: they agree)."""
    return validate({0: _as("source", src), 1: _as("destination", dst)})


def pair_plan(src: Mapping[str, Any], dst: Mapping[str, Any], options: Options, links: Mapping[str, float]) -> Pair:
    """The plan from ``src``'s declaration to ``dst``'s (cached: the same pair plans once)."""
    key = json.dumps([_as("source", src), _as("destination", dst), sorted(links.items())], sort_keys=True)
    return _pair_plan(key, options)


@functools.lru_cache(maxsize=64)
def _pair_plan(key: str, options: Options) -> Pair:
    from jreshard import Topology
    from jreshard.sharding.program import plan_layouts

    s, d, links = json.loads(key)
    names, pairs, domains, _, base = group_layouts({0: s, 1: d})
    topology = Topology.from_domains(domains, devices={r: r for r in domains}, **dict(links))
    return Pair(plan_layouts(pairs, topology, options, names), topology, tuple(names), base[1])


_TIE = 0.01  # predicted times within 1% are a tie, and a tie goes to the peer (keeps the trainer's links free)


def choose_source(
    prefer: CatchUp,
    trainer: Mapping[str, Any] | None,
    peers: Mapping[str, Mapping[str, Any]],
    joiner: Mapping[str, Any],
    options: Options,
    links: Mapping[str, float],
) -> str | None:
    """Where a joiner catches up from: the name of a peer, or ``None`` for the trainer.

    Args:
      prefer: the trainer's :class:`CatchUp` setting.
      trainer: the trainer's declaration, or ``None`` when its copy of the version is gone.
      peers: ``{name: declaration}`` of the replicas that hold the version.
      joiner: the joiner's declaration.
      options, links: as for :func:`pair_plan`.

    Returns:
      ``AUTO``: the peer whose plan the cost model predicts cheapest, if it is within 1% of the
      trainer's plan or cheaper; ``PEER``: the first peer; ``TRAINER``: ``None``. Without peers,
      ``None``; without the trainer's copy, any peer.
    """
    if not peers:
        return None
    if trainer is None or prefer is CatchUp.PEER:
        return next(iter(peers))
    if prefer is CatchUp.TRAINER:
        return None
    cost = {n: pair_plan(d, joiner, options, links).predicted_seconds() for n, d in peers.items()}
    best = min(cost, key=lambda n: cost[n])
    mine = pair_plan(trainer, joiner, options, links).predicted_seconds()
    return best if cost[best] <= mine * (1 + _TIE) else None


def source_shards(pair: Pair, tree_leaves: Sequence[tuple[str, Any]], devices: Sequence[Any]) -> dict:
    """``{(tensor, rank): single-device array}``: this source process's shards of ``tree_leaves``."""
    index = {n: t for t, n in enumerate(pair.names)}
    out = {}
    for name, a in tree_leaves:
        t = index[name]
        ranks = set(pair.plan.tensors[t].src.ranks)
        for sh in a.addressable_shards:
            if sh.device in devices and devices.index(sh.device) in ranks:
                out[(t, devices.index(sh.device))] = sh.data
    return out


def target_devices(pair: Pair, tree_leaves: Sequence[tuple[str, Any]], devices: Sequence[Any]) -> dict:
    """``{(tensor, rank): device}``: the destination shards this process makes."""
    index = {n: t for t, n in enumerate(pair.names)}
    return {
        (index[name], pair.src_ranks + devices.index(d)): d
        for name, a in tree_leaves
        for d in a.sharding.addressable_devices
    }


def run_pair(pair: Pair, channel: Channel, *, source: bool, shards: Mapping, options: Options) -> dict:
    """Run this process's side of ``pair`` over ``channel``: the only call into the engine.

    Args:
      pair: the plan both processes computed.
      channel: the connection to the other process.
      source: whether this process is the source side.
      shards: ``source_shards(...)`` on the source side, ``target_devices(...)`` on the destination.
      options: chunking, staging and ``timeout_s``.

    Returns:
      ``{(tensor, rank): new single-device array}`` on the destination side (fresh buffers), ``{}`` on the source.
    """
    from jreshard.multi import run_plan

    n = len(pair.topology.ranks)
    mine = range(pair.src_ranks) if source else range(pair.src_ranks, n)
    theirs = range(pair.src_ranks, n) if source else range(pair.src_ranks)
    comm = SocketComm(mine, dict.fromkeys(theirs, channel))
    out, _ = run_plan(pair.plan, comm, shards if source else {}, {} if source else shards, options=options)
    return out
