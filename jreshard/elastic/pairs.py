"""One refit between two processes: its plan, its shards, and the one call into the engine.

Every refit of elastic refit is between exactly two processes, a *source*
(the trainer, or a replica that already holds the version) and one
*destination* replica, so one replica's failure touches no other transfer.
Ranks are numbered source devices first, then destination devices; each
side is its own fast-link domain. Both processes compute the same plan from
the two declarations (the dicts of :mod:`jreshard.refit.decl`).

A replica may declare views of the trainer's parameters, as a :class:`jreshard.RefitGroup`'s
destination does: leaves of another dtype (casts) and a ``recipe``. A pair from the trainer to
such a replica moves views: lowered and scheduled once (:mod:`jreshard.refit.views`, cached with
the plan), run through the one round loop. A pair from a peer replica copies the arrays the peer
holds, which are already in the destination's form, as plain arrays; it is only made between
replicas of the same form (:func:`same_form`: the same names, shapes, dtypes and recipe).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jreshard.elastic.types import CatchUp
from jreshard.engine.deltarounds import DeltaRefit
from jreshard.engine.rounds import ExecStats
from jreshard.net.channel import Channel
from jreshard.options import Options
from jreshard.refit.decl import (
    GroupViews,
    declare_leaves,
    group_layouts,
    group_views,
    leaf_differences,
    needs_views,
    tree_key,
    validate,
)
from jreshard.types import PyTree

if TYPE_CHECKING:
    from jreshard.schedule.viewsched import ViewSchedule
    from jreshard.sharding.topology import Topology

__all__ = [
    "Pair",
    "PairViews",
    "check_like",
    "check_pair",
    "choose_source",
    "leaves_by_name",
    "pair_plan",
    "run_pair",
    "same_form",
    "source_shards",
    "target_devices",
]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class PairViews:
    """What a pair that moves views runs (immutable): the views, their lowering, the engine's schedule."""

    group: GroupViews
    lowerings: tuple[Any, ...]  # jreshard.views.lowering.LeafLowering, one per destination leaf
    schedule: ViewSchedule


@dataclasses.dataclass(frozen=True, slots=True)
class Pair:
    """The plan of one source (trainer, or replica) to one destination replica (immutable).

    Processes are numbered sources first, then destinations; ``bases[p]`` is process ``p``'s
    first rank, its devices taking the ranks after it in declaration order. A pair moves plain
    arrays (``plan``, ``views is None``) or views (``views``, ``plan is None``).
    """

    plan: Any  # a Plan, or None where the pair moves views
    topology: Topology
    names: tuple[str, ...]  # the source's leaf names, in tensor order
    bases: tuple[int, ...]
    n_src: int  # the number of source processes
    dst_names: tuple[str, ...] = ()  # the destination's leaf names, in tensor order (plain: ``names``)
    views: PairViews | None = None
    options: Options | None = None

    def ranks(self, process: int) -> range:
        """The ranks of ``process``."""
        end = self.bases[process + 1] if process + 1 < len(self.bases) else len(self.topology.ranks)
        return range(self.bases[process], end)

    def src_ranks(self, t: int) -> tuple[int, ...]:
        """The ranks that hold source tensor ``t``."""
        if self.views is not None:
            return tuple(self.views.group.layouts[t].ranks)
        return tuple(self.plan.tensors[t].src.ranks)

    def predicted_seconds(self) -> float:
        """The cost model's *predicted* time of this refit."""
        from jreshard import cost

        if self.views is not None:
            from jreshard.refit.views import predict_group

            assert self.options is not None
            pv = self.views
            return float(predict_group(pv.schedule, pv.lowerings, self.topology, self.options).seconds)
        return float(cost.predict(self.plan, self.topology).seconds)


def leaves_by_name(tree: PyTree) -> list[tuple[str, Any]]:
    """``[(key path, leaf)]`` in the tree's order (the names declarations use)."""
    import jax

    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p) or "x", a) for p, a in leaves]


def check_like(
    tree: PyTree, decl: dict, role: str, devices: Sequence[Any], who: str, memo: dict | None = None
) -> list[tuple[str, Any]]:
    """Raise ``ValueError`` naming each leaf and field where ``tree`` differs from the declaration; returns
    ``tree``'s ``[(key path, leaf)]`` (:func:`leaves_by_name`), from its one flattening.

    ``memo``: a dict the caller keeps for one declaration; a tree with the key (:func:`~jreshard.refit.decl.tree_key`)
    of the last one that matched is not declared again, and the leaves' names are read once per tree structure.
    """
    import jax

    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    key = tree_key(flat, treedef) if memo is not None else None
    if key is None or memo is None or memo.get("key") != key:
        now = declare_leaves(role, flat, devices, None)
        if now["errors"]:
            raise ValueError(f"{who}: " + "; ".join(now["errors"]))
        diff = leaf_differences(now["params"], decl["params"])
        if diff:
            raise ValueError(f"{who}: the tree does not match the declaration: " + "; ".join(diff))
        if memo is not None:
            memo["key"] = key
    if memo is None:
        return [(jax.tree_util.keystr(p) or "x", a) for p, a in flat]
    if "treedef" not in memo or memo["treedef"] != treedef:
        memo["treedef"], memo["names"] = treedef, [jax.tree_util.keystr(p) or "x" for p, _ in flat]
    return list(zip(memo["names"], (a for _, a in flat), strict=True))


def _decls(
    src: Sequence[Mapping[str, Any]], dst: Sequence[Mapping[str, Any]], *, peer: bool = False
) -> dict[int, dict]:
    """Each process its own fast-link domain: no plan sends a byte between two destination processes.

    ``peer``: the source is a replica, whose arrays are already the destination's form; the
    recipes (how both were made from the trainer's) are dropped, and the pair is plain arrays.
    """
    roles = [("source", d) for d in src] + [("destination", d) for d in dst]
    out = {p: {**d, "role": role, "domain": None} for p, (role, d) in enumerate(roles)}
    for d in out.values():
        if peer or d["role"] == "source":
            d.pop("recipe", None)
    return out


def check_pair(src: Sequence[Mapping[str, Any]], dst: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every problem between the trainer processes' declarations and a replica's (empty: they agree).

    The replica may declare casts and a recipe (``refit_decl.validate(..., views=True)``).
    """
    return validate(_decls(src, dst), views=True)


def same_form(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    """Whether two replicas' declarations (one per process) hold the same tensors: the same names, shapes,
    dtypes and recipe, whatever their meshes. A replica of the same form as one holding a version can
    copy it from there as plain arrays.

    Example:
      >>> w = ["['w']", [4], "bfloat16", [[0, [0], [4]]]]
      >>> same_form([{"params": [w]}], [{"params": [w[:3] + [[[0, [0], [2]]]]]}])
      True
      >>> same_form([{"params": [w]}], [{"params": [w[:2] + ["float32", w[3]]]}])
      False
    """

    def form(decls: Sequence[Mapping[str, Any]]) -> tuple:
        first = decls[0]
        return [p[:3] for p in first["params"]], first.get("recipe") or {}

    return bool(a) and bool(b) and form(a) == form(b)


def pair_plan(
    src: Sequence[Mapping[str, Any]],
    dst: Sequence[Mapping[str, Any]],
    options: Options,
    links: Mapping[str, float],
    *,
    peer: bool = False,
) -> Pair:
    """The plan from the source processes' declarations to the destination's (cached by its inputs).

    ``peer``: the source is a replica of the same form (:func:`same_form`), copied as plain arrays;
    otherwise it is the trainer, and a destination that declares casts or a recipe gets a pair that
    moves views. Relays are off: a byte never travels between two processes of the destination
    replica, so each process of it needs a connection to the source processes only.

    Raises:
      JReshardError: the views cannot be lowered onto these layouts.
      ValueError: ``options.chunk_bytes`` is below an item on the wire of the views.
    """
    key = json.dumps([_decls(src, dst, peer=peer), len(src), sorted(links.items())], sort_keys=True)
    return _pair_plan(key, _planned(options))


def _planned(options: Options) -> Options:
    """The options a pair is scheduled with: relays off, and messages cut small enough to digest each in the cache
    (every message of a pair is MACed: :func:`jreshard.refit.boxes.digested`)."""
    from jreshard.refit import boxes

    return boxes.digested(dataclasses.replace(options, relays=False))


@functools.lru_cache(maxsize=64)
def _pair_plan(key: str, options: Options) -> Pair:
    from jreshard import Topology
    from jreshard.sharding.planner import plan_layouts

    decls, n_src, links = json.loads(key)
    decls = {int(p): d for p, d in decls.items()}
    if needs_views(decls):
        from jreshard.refit.views import lower_group, schedule_group

        gv = group_views(decls)
        topology = Topology.from_domains(gv.domains, devices={r: r for r in gv.domains}, **dict(links))
        lowerings = lower_group(gv, topology)
        views = PairViews(gv, tuple(lowerings), schedule_group(gv, lowerings, topology, options))
        bases = tuple(gv.base[p] for p in sorted(decls))
        return Pair(None, topology, gv.src_names, bases, n_src, gv.dst_names, views, options)
    names, pairs, domains, _, base = group_layouts(decls)
    topology = Topology.from_domains(domains, devices={r: r for r in domains}, **dict(links))
    plan = plan_layouts(pairs, topology, options, names)
    return Pair(plan, topology, tuple(names), tuple(base[p] for p in sorted(decls)), n_src, tuple(names), None, options)


_TIE = 0.01  # predicted times within 1% are a tie, and a tie goes to the peer (keeps the trainer's links free)


def choose_source(
    prefer: CatchUp,
    trainer: Sequence[Mapping[str, Any]] | None,
    peers: Mapping[str, Sequence[Mapping[str, Any]]],
    joiner: Sequence[Mapping[str, Any]],
    options: Options,
    links: Mapping[str, float],
) -> str | None:
    """Where a joiner catches up from: the name of a peer, or ``None`` for the trainer.

    Only a peer of the joiner's form (:func:`same_form`) can serve it: it holds the tensors the
    joiner declares (cast, fused, quantised alike) and copies them as plain arrays. A joiner whose
    declaration differs from every peer's takes the version from the trainer.

    Args:
      prefer: the trainer's :class:`CatchUp` setting.
      trainer: the trainer's declarations, one per process, or ``None`` when its copy of the version is gone.
      peers: ``{name: [declaration per process]}`` of the replicas that hold the version.
      joiner: the joiner's declarations, one per process.
      options, links: as for :func:`pair_plan`.

    Returns:
      Among the peers of the joiner's form: ``AUTO``: the peer whose plan the cost model predicts
      cheapest, if it is within 1% of the trainer's (views included) or cheaper; ``PEER``: the
      first; ``TRAINER``: ``None``. Without such peers, ``None``; without the trainer's copy, any of them.
    """
    peers = {n: d for n, d in peers.items() if same_form(d, joiner)}
    if not peers:
        return None
    if trainer is None or prefer is CatchUp.PEER:
        return next(iter(peers))
    if prefer is CatchUp.TRAINER:
        return None
    cost = {n: pair_plan(d, joiner, options, links, peer=True).predicted_seconds() for n, d in peers.items()}
    best = min(cost, key=lambda n: cost[n])
    mine = pair_plan(list(trainer), joiner, options, links).predicted_seconds()
    return best if cost[best] <= mine * (1 + _TIE) else None


def source_shards(pair: Pair, tree_leaves: Sequence[tuple[str, Any]], devices: Sequence[Any], process: int) -> dict:
    """``{(tensor, rank): single-device array}``: source ``process``'s shards of ``tree_leaves``."""
    from jreshard.engine.ownership import device_shards

    index = {n: t for t, n in enumerate(pair.names)}
    base = pair.bases[process]
    rank_of = {d: base + i for i, d in enumerate(devices)}
    out = {}
    for name, a in tree_leaves:
        t = index[name]
        ranks = set(pair.src_ranks(t))
        for d, data in device_shards(a):
            r = rank_of.get(d)
            if r is not None and r in ranks:
                out[(t, r)] = data
    return out


def target_devices(pair: Pair, tree_leaves: Sequence[tuple[str, Any]], devices: Sequence[Any], process: int) -> dict:
    """``{(tensor, rank): device}``: the destination shards that destination ``process`` makes."""
    index = {n: t for t, n in enumerate(pair.dst_names)}
    base = pair.bases[pair.n_src + process]
    return {
        (index[name], base + devices.index(d)): d for name, a in tree_leaves for d in a.sharding.addressable_devices
    }


def run_pair(
    pair: Pair,
    process: int,
    channels: Mapping[int, Channel],
    *,
    shards: Mapping,
    options: Options,
    costs: list | None = None,
    delta: DeltaRefit | None = None,
) -> tuple[dict, ExecStats]:
    """Run ``process``'s side of ``pair`` over NIXL: the only call into the engine.

    The bytes move as NIXL WRITEs (:class:`~jreshard.nixl.comm.NixlComm`, this process's shared
    agent); the connections carry the agents' metadata and the receive descriptors. A pair of plain
    arrays runs the per-process schedule; a pair of views runs the views' schedule
    (:func:`jreshard.refit.views.run_group`), both through the one round loop.

    Args:
      pair: the plan every process computed.
      process: this process's number in the pair (sources first, then destinations).
      channels: ``{process: authenticated connection}`` to the processes on the other side that it
        exchanges with.
      shards: ``source_shards(...)`` on a source process, ``target_devices(...)`` on a destination.
      options: chunking, staging and ``timeout_s``.
      costs: if given, the refit's :class:`~jreshard.engine.digest.DigestCost` on this process is appended
        (every message is MACed: :mod:`jreshard.elastic.verify`).
      delta: send what changed since the receivers' bases (:mod:`jreshard.elastic.delta`); both ends alike.

    Returns:
      ``({(tensor, rank): landed shard}, engine statistics)``: on a destination its new shards as the buffers they
      landed in (:data:`~jreshard.engine.driver.Landed`), for the caller to make whole arrays over them
      (:func:`~jreshard.engine.driver.landed_array`); ``{}`` on a source. The statistics count the bytes this
      process's ranks sent.
    """
    from jreshard.call.routes import kit
    from jreshard.elastic.verify import PairDigests
    from jreshard.engine.buffers import CpuBuffers
    from jreshard.engine.driver import receive_schedule, schedule_local

    NixlAgent, NixlComm = kit("nixl").agent, kit("nixl").comm

    source = process < pair.n_src
    remote = {r: ch for p, ch in channels.items() for r in pair.ranks(p)}
    comm = NixlComm(
        NixlAgent.shared(), pair.ranks(process), remote, timeout_s=options.timeout_s, encrypt=options.encrypt
    )
    # every message crossing to the other process is MACed on both sides (or hashed: Options.verify), and
    # the destination compares before anything is staged (jreshard.elastic.verify)
    digests = PairDigests.start(pair, process, channels, comm, options)
    comm.tags = digests.digests is None  # the box MACs check every message
    options = _planned(options)
    sources, targets = (shards, {}) if source else ({}, shards)
    try:
        if pair.views is not None:
            from jreshard.refit.views import run_group

            out = run_group(
                pair.views.group,
                pair.views.schedule,
                digests.comm,
                sources,
                targets,
                options=options,
                delta=delta,
            )
        else:
            # The per-process schedule, as every message-passing path runs: this process's rounds, agreed with
            # the other side's processes by mail over the same connections (relays off, as the plan was made).
            tensors = pair.plan.tensors
            layouts = [(t.src, t.dst) for t in tensors]
            _, _, sched = schedule_local(layouts, list(pair.names), pair.topology, options, comm)
            got, _, stats = receive_schedule(
                tensors, sched, digests.comm, sources, targets, options=options, buffers=CpuBuffers(), delta=delta
            )
            out = (got, stats)
    except BaseException:
        digests.abandon()
        raise
    cost = digests.finish()
    if costs is not None and cost is not None:
        costs.append(cost)
    return out
