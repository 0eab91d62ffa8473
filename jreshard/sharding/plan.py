"""Plan: every byte movement of a transfer, its statistics, and each rank's part of it (a :class:`RankPlan`).

The planner that builds one is :mod:`jreshard.sharding.planner`.

A :class:`Plan` holds one :class:`TensorPlan` per tensor. All pieces that one
sender sends one receiver at one stage, across all tensors, travel as one
:class:`Message`; inside it the pieces are in (tensor, unit, emission) order,
which both sides derive from the plan alone.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np

from jreshard.options import Options
from jreshard.sharding.bounds import network_lower_bound
from jreshard.sharding.layout import Layout
from jreshard.sharding.rankplan import Message, Piece, RankPlan, columns_rank_plan, padded
from jreshard.sharding.rows import Move, Phase, TensorPlan, TensorSpec
from jreshard.sharding.topology import Link, Topology

__all__ = ["Message", "Piece", "Plan", "PlanStats", "RankPlan", "rank_plan_of"]


@dataclasses.dataclass(frozen=True, slots=True)
class PlanStats:
    """Whole-plan statistics (bytes, counts). See ``docs/metrics.md``.

    Attributes:
      network_bytes, fast_bytes, same_device_bytes: bytes moved over each link kind.
      network_bytes_lower_bound: ``Σ_G Σ_beta |beta \\ U(G)|`` bytes, computed apart from the planner.
      relay_bytes: network bytes sent by destinations forwarding to other domains.
      max_rank_network_send_bytes, max_rank_network_recv_bytes: the busiest NIC, each way.
      max_rank_fast_send_bytes, max_rank_fast_recv_bytes: the busiest fast link, each way.
      messages: point-to-point messages (all pieces between one pair at one stage are one).
      network_messages: those that cross the network.
      stages: dependency stages.
      destination_bytes: the bytes the destination shards hold in all.
    """

    network_bytes: int
    fast_bytes: int
    same_device_bytes: int
    network_bytes_lower_bound: int
    relay_bytes: int
    max_rank_network_send_bytes: int
    max_rank_network_recv_bytes: int
    max_rank_fast_send_bytes: int
    max_rank_fast_recv_bytes: int
    messages: int
    network_messages: int
    stages: int
    destination_bytes: int


def _unique_rows(keys: np.ndarray) -> np.ndarray:
    """The distinct rows of an ``(n, 4)`` array of non-negative ints, sorted."""
    if not len(keys):
        return keys.reshape(0, 4)
    # Rows of non-negative ints sort like their mixed-radix codes: a 1-d unique is far
    # faster than np.unique(axis=0), and gives the same rows in the same order.
    radix = [int(v) + 1 for v in keys.max(axis=0)]
    if math.prod(radix) >= 1 << 62:
        return np.unique(keys, axis=0)
    code = ((keys[:, 0] * radix[1] + keys[:, 1]) * radix[2] + keys[:, 2]) * radix[3] + keys[:, 3]
    code = np.unique(code)
    out = np.empty((len(code), 4), dtype=np.int64)
    for col in (3, 2, 1):
        code, out[:, col] = np.divmod(code, radix[col])
    out[:, 0] = code
    return out


def _distinct_keys(tp: TensorPlan) -> np.ndarray:
    """Distinct ``(stage, src, dst, link)`` of one tensor's rows that travel as messages."""
    m = (tp.link != Link.SAME_DEVICE) | (tp.phase != Phase.LAND)
    return _unique_rows(np.stack([tp.stage[m], tp.src[m], tp.dst[m], tp.link[m]], axis=1).astype(np.int64))


def _box_bytes(lay: Layout) -> int:
    """The bytes all of a layout's boxes hold together (replicas counted each)."""
    n = len(lay.boxes)
    lo = np.fromiter(itertools.chain.from_iterable(b.lo for b in lay.boxes), np.int64, n * lay.ndim)
    hi = np.fromiter(itertools.chain.from_iterable(b.hi for b in lay.boxes), np.int64, n * lay.ndim)
    return int(np.prod((hi - lo).reshape(n, lay.ndim), axis=1).sum()) * lay.itemsize


def _concat(parts: Sequence[TensorPlan], field: str) -> np.ndarray:
    arrays = [getattr(tp, field) for tp in parts]
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)


class Plan:
    """A transfer plan for a list of tensors over a topology (final).

    Build one with :func:`jreshard.plan`; do not construct directly.
    """

    __slots__ = ("__dict__", "kind", "options", "tensor_plans", "tensors", "topology")

    def __init__(
        self,
        tensors: Sequence[TensorSpec],
        topology: Topology,
        options: Options,
        tensor_plans: Sequence[TensorPlan],
        kind: str = "jreshard",
    ):
        self.tensors = tuple(tensors)
        self.topology = topology
        self.options = options
        self.tensor_plans = tuple(tensor_plans)
        self.kind = kind

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"Plan({self.kind}, {len(self.tensors)} tensors, network={s.network_bytes} B "
            f"(bound {s.network_bytes_lower_bound}), fast={s.fast_bytes} B, same_device={s.same_device_bytes} B, "
            f"{s.messages} messages)"
        )

    def transfers(self) -> Iterator[Move]:
        """Every byte movement, tensor by tensor, in emission order."""
        for t, tp in enumerate(self.tensor_plans):
            for i in range(len(tp)):
                yield Move(
                    t,
                    int(tp.src[i]),
                    int(tp.dst[i]),
                    tp.box(i),
                    Link(int(tp.link[i])),
                    Phase(int(tp.phase[i])),
                    int(tp.stage[i]),
                    int(tp.nbytes[i]),
                )

    @functools.cached_property
    def _columns(self) -> dict[str, np.ndarray]:
        cols = {f: _concat(self.tensor_plans, f) for f in ("src", "dst", "link", "phase", "stage", "nbytes")}
        cols["tensor"] = np.concatenate(
            [np.full(len(tp), t, dtype=np.int64) for t, tp in enumerate(self.tensor_plans)] or [np.zeros(0, np.int64)]
        )
        return cols

    def network_lower_bound(self) -> int:
        return sum(network_lower_bound(t.src, t.dst, self.topology) for t in self.tensors)

    def rank_loads(self) -> dict[str, dict[int, int]]:
        """Per-rank bytes: ``{"network_send": {rank: bytes}, "network_recv", "fast_send", "fast_recv",
        "same_device"}``."""
        c = self._columns
        out: dict[str, dict[int, int]] = {}
        for name, link, who in (
            ("network_send", Link.NETWORK, "src"),
            ("network_recv", Link.NETWORK, "dst"),
            ("fast_send", Link.FAST, "src"),
            ("fast_recv", Link.FAST, "dst"),
            ("same_device", Link.SAME_DEVICE, "dst"),
        ):
            m = c["link"] == link
            who_m = c[who][m]
            # Ranks are small non-negative ints: one bincount, no sort.
            sums = np.bincount(who_m, weights=c["nbytes"][m]) if len(who_m) else np.zeros(0)
            seen = np.bincount(who_m) if len(who_m) else np.zeros(0, np.int64)
            ranks = np.flatnonzero(seen)
            out[name] = dict(zip(ranks.tolist(), sums[ranks].astype(np.int64).tolist(), strict=True))
        return out

    def message_keys(self) -> np.ndarray:
        """Distinct ``(stage, src, dst, link)`` rows of the transfers that travel as messages
        (all but the same-device landings from a source shard)."""
        parts: dict[int, np.ndarray] = {}  # id(tensor plan) -> its distinct keys: stamped tensors repeat
        for tp in self.tensor_plans:
            if id(tp) not in parts:
                parts[id(tp)] = _distinct_keys(tp)
        keys = np.concatenate(list(parts.values())) if parts else np.zeros((0, 4), np.int64)
        return _unique_rows(keys)

    def stats(self) -> PlanStats:
        """Bytes by link kind, the lower bound, per-rank maxima and message counts (computed once)."""
        return self._stats

    @functools.cached_property
    def _stats(self) -> PlanStats:
        c = self._columns
        loads = self.rank_loads()
        keys = self.message_keys()
        by_link = {lk: int(c["nbytes"][c["link"] == lk].sum()) for lk in Link}
        return PlanStats(
            network_bytes=by_link[Link.NETWORK],
            fast_bytes=by_link[Link.FAST],
            same_device_bytes=by_link[Link.SAME_DEVICE],
            network_bytes_lower_bound=self.network_lower_bound(),
            relay_bytes=int(c["nbytes"][c["phase"] == Phase.RELAY].sum()),
            max_rank_network_send_bytes=max(loads["network_send"].values(), default=0),
            max_rank_network_recv_bytes=max(loads["network_recv"].values(), default=0),
            max_rank_fast_send_bytes=max(loads["fast_send"].values(), default=0),
            max_rank_fast_recv_bytes=max(loads["fast_recv"].values(), default=0),
            messages=len(keys),
            network_messages=int(np.sum(keys[:, 3] == Link.NETWORK)) if len(keys) else 0,
            stages=int(c["stage"].max()) + 1 if len(c["stage"]) else 0,
            destination_bytes=self._destination_bytes(),
        )

    def _destination_bytes(self) -> int:
        per: dict[int, int] = {}  # id(layout) -> its bytes: tensors share layouts
        total = 0
        for t in self.tensors:
            got = per.get(id(t.dst))
            if got is None:
                got = per[id(t.dst)] = _box_bytes(t.dst)
            total += got
        return total

    @functools.cached_property
    def _bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every row's box bounds, zero-padded to the most dimensions, its tensor's dimensions and its
        position among its tensor's rows."""
        width = max((t.src.ndim for t in self.tensors), default=0)
        lo = padded([tp.lo for tp in self.tensor_plans], width)
        hi = padded([tp.hi for tp in self.tensor_plans], width)
        ndim = np.repeat(np.array([t.src.ndim for t in self.tensors], np.int8), [len(tp) for tp in self.tensor_plans])
        order = np.concatenate([np.arange(len(tp)) for tp in self.tensor_plans] or [np.zeros(0, np.int64)])
        return lo, hi, ndim, order

    def _rank_plan_of_rows(self, rank: int, rows: np.ndarray) -> RankPlan:
        c = self._columns
        lo, hi, ndim, order = self._bounds
        cols = {f: c[f][rows] for f in ("src", "dst", "link", "phase", "stage", "nbytes", "tensor")}
        cols["order"] = order[rows]
        return columns_rank_plan(rank, cols, lo[rows], hi[rows], ndim[rows])

    def rank_plan(self, rank: int) -> RankPlan:
        """The part of this plan that ``rank`` runs."""
        c = self._columns
        return self._rank_plan_of_rows(rank, np.flatnonzero((c["src"] == rank) | (c["dst"] == rank)))

    def rank_plans(self, ranks: Sequence[int] | None = None) -> dict[int, RankPlan]:
        """``{rank: self.rank_plan(rank)}`` for ``ranks`` (default: every rank of the plan).

        One pass over the rows groups them by rank (one stable sort), instead of
        scanning every row once per rank.
        """
        if ranks is None:
            ranks = sorted({r for t in self.tensors for r in (*t.src.ranks, *t.dst.ranks)})
        want = sorted(set(ranks))
        c = self._columns
        n = len(c["src"])
        # Each row belongs to its sender and its receiver (once when they are the same rank).
        idx = np.arange(n, dtype=np.int64)
        who = np.concatenate([c["src"], c["dst"][c["dst"] != c["src"]]])
        at = np.concatenate([idx, idx[c["dst"] != c["src"]]])
        keep = np.isin(who, np.asarray(want, dtype=np.int64))
        who, at = who[keep], at[keep]
        order = np.argsort(who, kind="stable")
        who, at = who[order], at[order]
        bounds = np.searchsorted(who, [*want, max(want, default=0) + 1]) if want else np.zeros(0, np.int64)
        return {r: self._rank_plan_of_rows(r, np.sort(at[bounds[i] : bounds[i + 1]])) for i, r in enumerate(want)}


def rank_plan_of(rank: int, parts: Sequence[TensorPlan]) -> RankPlan:
    """The :class:`RankPlan` of ``rank`` from the rows of each tensor (``parts[t]``, in emission
    order) that involve it."""
    width = max((tp.lo.shape[1] for tp in parts), default=0)
    cols = {f: _concat(parts, f) for f in ("src", "dst", "link", "phase", "stage", "nbytes")}
    cols["tensor"] = np.repeat(np.arange(len(parts), dtype=np.int64), [len(tp) for tp in parts])
    cols["order"] = np.concatenate([np.arange(len(tp)) for tp in parts] or [np.zeros(0, np.int64)])
    ndim = np.repeat(np.array([tp.lo.shape[1] for tp in parts], np.int8), [len(tp) for tp in parts])
    lo = padded([tp.lo for tp in parts], width)
    hi = padded([tp.hi for tp in parts], width)
    return columns_rank_plan(rank, cols, lo, hi, ndim)
