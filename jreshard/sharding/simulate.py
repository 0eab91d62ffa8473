"""Predict a refit too large to hold as one :class:`Plan`: tensor by tensor, from the planner's templates.

Tensors with the same layout pair share one template (``units.py``): its rows are
planned once and stamped for each replica rotation. The cost model needs only
per-rank port loads and the distinct messages (:class:`~jreshard.sharding.cost.LoadTable`),
so each layout pair's template is planned, its fixed rows added once for all its
tensors, its rotating rows stamped for each rotation in use (a rotation that ``m``
tensors share is added once, ``m`` times over), and the template dropped. Memory is
one template at a time, not the whole plan.

The result equals ``predict(plan_layouts(pairs, ...))``, and its :class:`PlanStats` equal
``plan_layouts(pairs, ...).stats()`` (tests check both), so ``python -m jreshard plan`` and
``simulate`` answer for refits whose whole plan would not fit in memory.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from jreshard.options import Options
from jreshard.sharding.bounds import network_lower_bound
from jreshard.sharding.cost import LoadTable, Port, Prediction, predict_loads
from jreshard.sharding.plan import PlanStats, _box_bytes
from jreshard.sharding.planner import LayoutPair, prepare_pairs
from jreshard.sharding.rows import Phase
from jreshard.sharding.topology import Link, Topology
from jreshard.sharding.units import rotation_of, template_of

__all__ = ["Simulation", "simulate_layouts"]


@dataclasses.dataclass(frozen=True, slots=True)
class Simulation:
    """A predicted refit, with the bytes it moves.

    Attributes:
      prediction: the cost model's :class:`Prediction` (predicted, not measured).
      network_bytes, fast_bytes, same_device_bytes: bytes moved over each link kind.
      network_bytes_lower_bound: the union bound of ``bounds.py``, summed over tensors.
      rows: byte movements in the plan (never held at once).
      stats: the whole plan's :class:`PlanStats`, equal to ``plan_layouts(...).stats()``.
    """

    prediction: Prediction
    network_bytes: int
    fast_bytes: int
    same_device_bytes: int
    network_bytes_lower_bound: int
    rows: int
    stats: PlanStats


def simulate_layouts(
    pairs: Sequence[LayoutPair],
    topology: Topology | None = None,
    options: Options | None = None,
    names: Sequence[str] | None = None,
) -> Simulation:
    """Predict moving each tensor from its source to its destination layout, one layout pair at a time.

    Example:
      >>> import numpy as np
      >>> from jreshard.sharding.layout import Layout
      >>> a = Layout.from_mesh(np.arange(4), ("x",), ("x",), (8, 4), "float32")
      >>> b = Layout.from_mesh(np.arange(4, 8), ("x",), (None, "x"), (8, 4), "float32")
      >>> sim = simulate_layouts([(a, b)] * 3, Topology.uniform(range(8), 4))
      >>> sim.network_bytes == sim.network_bytes_lower_bound == 3 * 8 * 4 * 4
      True
    """
    pairs, topology, options = prepare_pairs(pairs, topology, options, names)
    ranks = sorted({r for s, d in pairs for r in (*s.ranks, *d.ranks)})
    acc = LoadTable.empty(np.asarray(ranks, dtype=np.int64))
    by_pair: dict[LayoutPair, list[int]] = {}
    for t, pair in enumerate(pairs):
        by_pair.setdefault(pair, []).append(t)
    key_opts = Options(relays=options.relays, min_stripe_bytes=options.min_stripe_bytes)
    by_link = dict.fromkeys(Link, 0)
    bound = rows = relay = held = 0
    own: list[np.ndarray] = []  # (stage, src, dst) codes of same-device rows that still travel as messages
    for (src, dst), tensors in by_pair.items():
        tmpl = template_of(src, dst, topology, key_opts)
        rots = collections.Counter(rotation_of(src, dst, topology, t) for t in tensors)
        tp = tmpl.plan
        # Rows with a fixed sender are the same in every tensor: added once, len(tensors) times over.
        # Only the rows whose sender rotates (the landings) are stamped, once per rotation in use.
        fixed = tp.src >= 0
        acc.add(tp.src[fixed], tp.dst[fixed], tp.link[fixed], tp.stage[fixed], tp.nbytes[fixed], len(tensors))
        own_same_device = (tp.link == Link.SAME_DEVICE) & (tp.phase != Phase.LAND)  # a message, as the plan counts them
        own.append(_codes(ranks, tp.stage, tp.src, tp.dst, fixed & own_same_device))
        chosen = np.flatnonzero(~fixed)
        if len(chosen):
            cols = tp.dst[chosen], tp.link[chosen], tp.stage[chosen], tp.nbytes[chosen]
            for rot, times in sorted(rots.items()):
                stamped = tmpl.stamp(rot).src[chosen]
                acc.add(stamped, *cols, times)
                own.append(_codes(ranks, tp.stage[chosen], stamped, tp.dst[chosen], own_same_device[chosen]))
        for lk in Link:
            by_link[lk] += int(tp.nbytes[tp.link == lk].sum()) * len(tensors)
        bound += network_lower_bound(src, dst, topology) * len(tensors)
        rows += len(tp) * len(tensors)
        relay += int(tp.nbytes[tp.phase == Phase.RELAY].sum()) * len(tensors)
        held += _box_bytes(dst) * len(tensors)
    _, links, _ = acc.messages()
    load = acc.load
    stats = PlanStats(
        network_bytes=by_link[Link.NETWORK],
        fast_bytes=by_link[Link.FAST],
        same_device_bytes=by_link[Link.SAME_DEVICE],
        network_bytes_lower_bound=bound,
        relay_bytes=relay,
        max_rank_network_send_bytes=int(load[Port.NETWORK_SEND].max(initial=0)),
        max_rank_network_recv_bytes=int(load[Port.NETWORK_RECV].max(initial=0)),
        max_rank_fast_send_bytes=int(load[Port.FAST_SEND].max(initial=0)),
        max_rank_fast_recv_bytes=int(load[Port.FAST_RECV].max(initial=0)),
        messages=len(links) + len(np.unique(np.concatenate(own))) if own else len(links),
        network_messages=int(np.sum(links == Link.NETWORK)),
        stages=acc.stages,
        destination_bytes=held,
    )
    return Simulation(
        prediction=predict_loads(acc, topology, int(options.chunk_bytes)),
        network_bytes=stats.network_bytes,
        fast_bytes=stats.fast_bytes,
        same_device_bytes=stats.same_device_bytes,
        network_bytes_lower_bound=bound,
        rows=rows,
        stats=stats,
    )


def _codes(ranks: list[int], stage: np.ndarray, src: np.ndarray, dst: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``(stage * n + src) * n + dst`` (rank positions) of the rows in ``mask``, distinct."""
    n = len(ranks)
    where = np.asarray(ranks, np.int64)
    si, di = np.searchsorted(where, src[mask]), np.searchsorted(where, dst[mask])
    return np.unique((stage[mask].astype(np.int64) * n + si) * n + di)
