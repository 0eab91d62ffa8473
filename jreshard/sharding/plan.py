"""Plan: every byte movement of a transfer, its statistics, and each rank's program.

The planner that builds one is :mod:`jreshard.sharding.planner`.

A :class:`Plan` holds one :class:`TensorPlan` per tensor. All pieces that one
sender sends one receiver at one stage, across all tensors, travel as one
:class:`Message`; inside it the pieces are in (tensor, unit, emission) order,
which both sides derive from the plan alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jreshard.options import Options
from jreshard.sharding.bounds import network_lower_bound
from jreshard.sharding.box import Box
from jreshard.sharding.rows import Move, Phase, TensorPlan, TensorSpec
from jreshard.sharding.topology import Link, Topology

__all__ = ["Message", "Piece", "Plan", "PlanStats", "RankProgram", "program_of"]


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """One part of a message: a box of a tensor, in global coordinates."""

    tensor: int
    box: Box
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """All pieces ``src`` sends ``dst`` at ``stage``, in a fixed order."""

    stage: int
    src: int
    dst: int
    link: Link
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclasses.dataclass(frozen=True, slots=True)
class RankProgram:
    """What one rank does: local copies into its destination shards, then, stage
    by stage, the messages it sends and receives.

    ``local`` are landings from a source shard on the rank's device (the sender's
    buffer is in this process). A fan-out between two destination ranks that share
    a device is labelled ``Link.LOCAL`` but travels as a message, at its stage. ``sends`` and ``recvs`` are sorted by
    ``(stage, peer)``.
    """

    rank: int
    local: tuple[Move, ...]
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({m.stage for m in self.sends} | {m.stage for m in self.recvs}))


@dataclasses.dataclass(frozen=True, slots=True)
class PlanStats:
    """Whole-plan statistics (bytes, counts). See ``docs/metrics.md``.

    Attributes:
      network_bytes, fast_bytes, local_bytes: bytes moved over each link kind.
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
    local_bytes: int
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
            f"(bound {s.network_bytes_lower_bound}), fast={s.fast_bytes} B, local={s.local_bytes} B, "
            f"{s.messages} messages)"
        )

    def draw(self, tensor: int | str = 0, ax: Any = None, **kwargs: Any) -> Any:
        """Draw one tensor's source and destination shards and what moves where (matplotlib).

        See :func:`jreshard.draw.draw_plan` for ``dims`` and ``max_copies``. Returns the Axes.
        """
        from jreshard.draw import draw_plan  # a thin method: the drawing (and matplotlib) lives in draw.py

        return draw_plan(self, tensor, ax, **kwargs)

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
        """Per-rank bytes: ``{"network_send": {rank: bytes}, "network_recv", "fast_send", "fast_recv", "local"}``."""
        c = self._columns
        out: dict[str, dict[int, int]] = {}
        for name, link, who in (
            ("network_send", Link.NETWORK, "src"),
            ("network_recv", Link.NETWORK, "dst"),
            ("fast_send", Link.FAST, "src"),
            ("fast_recv", Link.FAST, "dst"),
            ("local", Link.LOCAL, "dst"),
        ):
            m = c["link"] == link
            ranks, inv = np.unique(c[who][m], return_inverse=True)
            sums = np.bincount(inv, weights=c["nbytes"][m], minlength=len(ranks))
            out[name] = {int(r): int(v) for r, v in zip(ranks, sums, strict=True)}
        return out

    def message_keys(self) -> np.ndarray:
        """Distinct ``(stage, src, dst, link)`` rows of the transfers that travel as messages
        (all but the local landings from a source shard)."""
        c = self._columns
        m = (c["link"] != Link.LOCAL) | (c["phase"] != Phase.LAND)
        keys = np.stack([c["stage"][m], c["src"][m], c["dst"][m], c["link"][m]], axis=1).astype(np.int64)
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
            local_bytes=by_link[Link.LOCAL],
            network_bytes_lower_bound=self.network_lower_bound(),
            relay_bytes=int(c["nbytes"][c["phase"] == Phase.RELAY].sum()),
            max_rank_network_send_bytes=max(loads["network_send"].values(), default=0),
            max_rank_network_recv_bytes=max(loads["network_recv"].values(), default=0),
            max_rank_fast_send_bytes=max(loads["fast_send"].values(), default=0),
            max_rank_fast_recv_bytes=max(loads["fast_recv"].values(), default=0),
            messages=len(keys),
            network_messages=int(np.sum(keys[:, 3] == Link.NETWORK)) if len(keys) else 0,
            stages=int(c["stage"].max()) + 1 if len(c["stage"]) else 0,
            destination_bytes=sum(sum(b.volume for b in t.dst.boxes) * t.dst.itemsize for t in self.tensors),
        )

    def program(self, rank: int) -> RankProgram:
        """The part of this plan that ``rank`` runs."""
        parts = [tp.select((tp.src == rank) | (tp.dst == rank)) for tp in self.tensor_plans]
        return program_of(rank, parts)


_LINKS = tuple(Link)
_PHASES = tuple(Phase)


def program_of(
    rank: int, parts: Sequence[TensorPlan], boxes: Sequence[Sequence[Box] | None] | None = None
) -> RankProgram:
    """The :class:`RankProgram` of ``rank`` from the rows of each tensor that involve it.

    ``boxes[t]``, where given, are the rows' boxes of tensor ``t`` as :class:`Box` values already
    built (tensors with equal layouts share them), so that they are not built again.
    """
    local: list[Move] = []
    sends: dict[tuple[int, int], list[Piece]] = {}
    recvs: dict[tuple[int, int], list[Piece]] = {}
    links: dict[tuple[int, int, int], Link] = {}
    trusted = Box.trusted
    for t, tp in enumerate(parts):
        if not len(tp):
            continue
        given = boxes[t] if boxes is not None else None
        box_list = (
            given if given is not None else list(map(trusted, map(tuple, tp.lo.tolist()), map(tuple, tp.hi.tolist())))
        )
        # Whole columns to Python ints at once: far faster than indexing numpy scalars row by row.
        cols = zip(
            tp.src.tolist(),
            tp.dst.tolist(),
            tp.link.tolist(),
            tp.phase.tolist(),
            tp.stage.tolist(),
            box_list,
            tp.nbytes.tolist(),
            strict=True,
        )
        for src, dst, lk, ph, stage, box, nb in cols:
            link = _LINKS[lk]
            if lk == Link.LOCAL and ph == Phase.LAND:  # from a source shard on the rank's device
                if dst == rank:
                    local.append(Move(t, src, dst, box, link, _PHASES[ph], stage, nb))
                continue
            if src == rank:
                sends.setdefault((stage, dst), []).append(Piece(t, box, nb))
                links[(stage, src, dst)] = link
            if dst == rank:
                recvs.setdefault((stage, src), []).append(Piece(t, box, nb))
                links[(stage, src, dst)] = link
    return RankProgram(
        rank,
        tuple(local),
        tuple(Message(s, rank, p, links[(s, rank, p)], tuple(v)) for (s, p), v in sorted(sends.items())),
        tuple(Message(s, p, rank, links[(s, p, rank)], tuple(v)) for (s, p), v in sorted(recvs.items())),
    )
