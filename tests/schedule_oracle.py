"""The whole-plan scheduler: every chunk of every rank of a plan placed in its round by first fit, from the
whole plan at once. The library schedules pair by pair (``jreshard.schedule.pairsched``, each process
its own ranks, agreed with its peers) and views by ``jreshard.schedule.viewsched``; this one is kept
here as an oracle and as a quick way to get a valid schedule of a plan in a test.

Chunk ``c`` of a message goes in the first round that is

- after chunk ``c - 1`` of the same message,
- after every round in which its sender received bytes it forwards (for a stage ``s >= 1`` chunk: the
  sender's received chunks of stages ``< s`` whose boxes meet the chunk's boxes),
- and where both ends still have staging room (``options.staging_bytes`` per rank).

A chunk that is one contiguous run of its shard is sent or received in place; the others are packed
into, or unpacked from, the rank's staging arena, each staged chunk at a multiple of ``STAGE_ALIGN``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping

import numpy as np

from jreshard.options import Options
from jreshard.schedule import kernels
from jreshard.schedule.steps import (
    DST,
    SRC,
    STAGE_ALIGN,
    STAGING,
    Schedule,
    Step,
    Wire,
    _copy_tables,
    _Shapes,
    buffer_index,
    chunk_pieces,
    first_fit,
    tag_of,
)
from jreshard.sharding.box import Box, intersect
from jreshard.sharding.caches import cache
from jreshard.sharding.plan import Message, Plan

__all__ = ["build_schedule"]


def _chunks_of(m: Message, shapes: _Shapes, chunk_bytes: int) -> list[list[tuple[int, Box]]]:
    return chunk_pieces(((p.tensor, kernels.byte_box(p.box, shapes.items[p.tensor])) for p in m.pieces), chunk_bytes)


def _in_place(chunk: list[tuple[int, Box]], rank: int, side: int, shapes: _Shapes) -> tuple[int, int] | None:
    """``(buffer index, byte offset)`` when the chunk is one contiguous run of the shard."""
    if len(chunk) != 1:
        return None
    t, bb = chunk[0]
    outer, rel = shapes.relative(t, rank, side, bb)
    if not rel.is_contiguous_in(outer):
        return None
    strides = [1] * len(outer)
    for d in range(len(outer) - 2, -1, -1):
        strides[d] = strides[d + 1] * outer[d + 1]
    return buffer_index(t, side), sum(a * s for a, s in zip(rel.lo, strides, strict=True))


@cache(max_size=32)
def _schedule_cached(key: tuple, plan: Plan, chunk_bytes: int, staging_bytes: int) -> Schedule:
    shapes = _Shapes(plan.tensors)
    ranks = sorted({r for t in plan.tensors for r in (*t.src.ranks, *t.dst.ranks)})
    rank_plans = plan.rank_plans(ranks)
    msgs = sorted((m for p in rank_plans.values() for m in p.sends), key=lambda m: (m.stage, m.src, m.dst))
    align = STAGE_ALIGN if staging_bytes % STAGE_ALIGN == 0 else 1  # then a padded chunk still fits

    def padded(n: int) -> int:
        return -(-n // align) * align

    use: dict[int, list[int]] = {}
    got: dict[tuple[int, int], list[tuple[Box, int, int]]] = {}  # (rank, tensor) -> (byte box, stage, round)
    ops: dict[int, dict[int, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    nrounds = 0
    for m in msgs:
        side = SRC if m.stage == 0 else DST
        prev = -1
        for c, chunk in enumerate(_chunks_of(m, shapes, chunk_bytes)):
            n = sum(b.volume for _, b in chunk)
            lb = prev + 1
            if m.stage > 0:
                for t, bb in chunk:
                    for gb, gs, gr in got.get((m.src, t), ()):
                        if gs < m.stage and gr >= lb - 1 and intersect(gb, bb) is not None:
                            lb = gr + 1
            send_ip = _in_place(chunk, m.src, side, shapes)
            recv_ip = _in_place(chunk, m.dst, DST, shapes)
            na, nb = (0 if send_ip else padded(n)), (0 if recv_ip else padded(n))
            rnd = first_fit(use, m.src, na, m.dst, nb, lb, staging_bytes)
            prev, nrounds = rnd, max(nrounds, rnd + 1)
            for t, bb in chunk:
                got.setdefault((m.dst, t), []).append((bb, m.stage, rnd))
            tag = tag_of(m.stage, c)
            ops[m.src][rnd].append(("send", m.dst, tag, m.link, n, chunk, side, send_ip))
            ops[m.dst][rnd].append(("recv", m.src, tag, m.link, n, chunk, DST, recv_ip))
    steps, staging = _steps(ops, shapes, padded)
    copies = {r: _copy_tables(p, shapes) for r, p in rank_plans.items() if p.copies}
    return Schedule(rounds=nrounds, steps=steps, copies=copies, staging=staging, ntensors=len(plan.tensors))


Op = tuple  # ("send" | "recv", peer, tag, link, nbytes, chunk, side, in_place)


def _steps(
    ops: Mapping[int, Mapping[int, list[Op]]], shapes: _Shapes, padded: Callable[[int], int]
) -> tuple[dict[int, dict[int, Step]], dict[int, int]]:
    """Each rank's :class:`Step` per round from its operations, and the most staging it holds."""
    steps: dict[int, dict[int, Step]] = {}
    staging: dict[int, int] = {}
    for r, by_round in ops.items():
        steps[r], peak = {}, 0
        for rnd, lst in sorted(by_round.items()):
            pos = 0
            rows: dict[str, list[tuple[int, tuple[int, ...], Box, int]]] = {"send": [], "recv": []}
            wires: dict[str, list[Wire]] = {"send": [], "recv": []}
            for kind, peer, tag, link, n, chunk, side, ip in lst:
                if ip is not None:
                    wires[kind].append(Wire(peer, tag, link, n, ip[0], ip[1]))
                    continue
                wires[kind].append(Wire(peer, tag, link, n, STAGING, pos))
                for t, bb in chunk:
                    outer, rel = shapes.relative(t, r, side, bb)
                    rows[kind].append((buffer_index(t, side), outer, rel, pos))
                    pos += bb.volume
                peak = max(peak, pos)
                pos = padded(pos)
            steps[r][rnd] = Step(_table(rows["send"]), _table(rows["recv"]), tuple(wires["send"]), tuple(wires["recv"]))
        staging[r] = peak
    return steps, staging


def _table(rows: list[tuple[int, tuple[int, ...], Box, int]]) -> np.ndarray:
    parts = [kernels.build_table([(b, o, box)], staging_offset=pos) for b, o, box, pos in rows]
    if not parts:
        return np.zeros((0, kernels.COLUMNS), np.int64)
    out = np.concatenate(parts)
    out.setflags(write=False)
    return out


def build_schedule(plan: Plan, options: Options | None = None) -> Schedule:
    """The rounds of every rank of ``plan`` (cached by the plan's inputs and the chunking options).

    Raises:
      ValueError: ``options.chunk_bytes`` is smaller than the widest item of the plan.
    """
    options = options or plan.options
    widest = max((t.src.itemsize for t in plan.tensors), default=1)
    if options.chunk_bytes < widest:
        raise ValueError(f"Options: chunk_bytes={options.chunk_bytes} is smaller than an item of {widest} bytes")
    key = (plan.kind, plan.tensors, plan.topology, plan.options.plan_key())
    return _schedule_cached(key, plan, options.chunk_bytes, options.staging_bytes)
