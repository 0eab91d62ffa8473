"""The pair-paced scheduler as first written (one Python object per chunk piece): the oracle the
vectorised builder in ``jreshard.schedule.pairsched`` is compared against, step table for step table."""

from __future__ import annotations

import collections
from collections.abc import Generator, Mapping, Sequence

import numpy as np
from schedule_oracle import _in_place, _steps

from jreshard.options import Options
from jreshard.schedule import kernels
from jreshard.schedule.pairsched import COUNT_IN, COUNT_OUT, ROUNDS, Key, Outgoing, Wanted, pair_chunk_bytes
from jreshard.schedule.steps import (
    DST,
    SRC,
    STAGE_ALIGN,
    Schedule,
    _copy_tables,
    _Shapes,
    chunk_pieces,
    tag_of,
)
from jreshard.sharding.box import Box
from jreshard.sharding.plan import Message, RankPlan
from jreshard.sharding.rows import TensorSpec


def _byte_chunks(m: Message, shapes: _Shapes, size: int) -> list[list[tuple[int, Box]]]:
    return chunk_pieces(((p.tensor, kernels.byte_box(p.box, shapes.items[p.tensor])) for p in m.pieces), size)


def pair_paced(
    tensors: Sequence[TensorSpec], rank_plans: Mapping[int, RankPlan], options: Options
) -> Generator[tuple[Outgoing, Wanted], dict[Key, np.ndarray], Schedule]:
    """:func:`jreshard.schedule.pairsched.pair_paced`, the same conversation, one object per chunk piece."""
    shapes = _Shapes(tensors)
    widest = max((t.src.itemsize for t in tensors), default=1)
    mine = sorted(rank_plans)
    n_out = {r: len({m.dst for m in rank_plans[r].sends}) for r in mine}
    n_in = {r: len({m.src for m in rank_plans[r].recvs}) for r in mine}
    for r in mine:
        if n_out[r] + n_in[r] > options.max_group_ops:
            raise ValueError(
                f"pair-paced rounds: rank {r} has {n_out[r]} + {n_in[r]} peers, more than "
                f"max_group_ops={options.max_group_ops} operations in one round"
            )
    # 1. Peer counts and bytes.
    b_out = {r: sum(m.nbytes for m in rank_plans[r].sends) for r in mine}
    b_in = {r: sum(m.nbytes for m in rank_plans[r].recvs) for r in mine}
    pair: dict[tuple[int, int], int] = collections.defaultdict(int)  # (sender, receiver) -> bytes, all stages
    for r in mine:
        for m in (*rank_plans[r].sends, *rank_plans[r].recvs):
            pair[(m.src, m.dst)] += m.nbytes
    out: dict[tuple[int, int, int], np.ndarray] = {}
    want: dict[tuple[int, int, int], int] = {}
    for r in mine:
        for m in rank_plans[r].sends:
            out[(r, m.dst, COUNT_OUT)] = np.array([n_out[r], -1, b_out[r]], np.int64)
            want[(m.dst, r, COUNT_IN)] = 3
        for m in rank_plans[r].recvs:
            out[(r, m.src, COUNT_IN)] = np.array([n_in[r], -1, b_in[r]], np.int64)
            want[(m.src, r, COUNT_OUT)] = 3
    got = yield out, want
    size: dict[tuple[int, int], int] = {}  # (sender, receiver) -> the pair's chunk bytes
    for r in mine:
        for m in rank_plans[r].sends:
            them = got[(m.dst, r, COUNT_IN)]
            ends = (n_out[r], b_out[r]), (int(them[0]), int(them[2]))
            size[(r, m.dst)] = pair_chunk_bytes(*ends, pair[(r, m.dst)], options, widest)
        for m in rank_plans[r].recvs:
            them = got[(m.src, r, COUNT_OUT)]
            ends = (int(them[0]), int(them[2])), (n_in[r], b_in[r])
            size[(m.src, r)] = pair_chunk_bytes(*ends, pair[(m.src, r)], options, widest)
    align = STAGE_ALIGN if options.staging_bytes % STAGE_ALIGN == 0 else 1

    def padded(n: int) -> int:
        return -(-n // align) * align

    # 2. Rounds, stage by stage.
    arrived: dict[tuple[int, int], list[tuple[Box, int]]] = {}  # (rank, tensor) -> (byte box, round) received
    index: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    next_round: dict[tuple[int, int], int] = collections.defaultdict(int)  # (sender, receiver) -> first free round
    ops: dict[int, dict[int, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    stages = sorted({m.stage for r in mine for m in (*rank_plans[r].sends, *rank_plans[r].recvs)})
    for s in stages:
        out, want = {}, {}
        recv_chunks: dict[tuple[int, int], tuple[Message, list]] = {}
        for r in mine:
            for m in rank_plans[r].sends:
                if m.stage != s:
                    continue
                side = SRC if s == 0 else DST
                placed: list[int] = []
                for k, chunk in enumerate(_byte_chunks(m, shapes, size[(r, m.dst)])):
                    lb = next_round[(r, m.dst)]
                    if s > 0:  # after every round in which r received bytes this chunk forwards
                        for t, bb in chunk:
                            lb = max(lb, _after(index.get((r, t)), bb))
                    next_round[(r, m.dst)] = lb + 1
                    placed.append(lb)
                    n = sum(b.volume for _, b in chunk)
                    ops[r][lb].append(
                        ("send", m.dst, tag_of(s, k), m.link, n, chunk, side, _in_place(chunk, r, side, shapes))
                    )
                out[(r, m.dst, ROUNDS + s)] = np.array(placed, np.int64)
            for m in rank_plans[r].recvs:
                if m.stage == s:
                    chunks = _byte_chunks(m, shapes, size[(m.src, r)])
                    recv_chunks[(m.src, r)] = (m, chunks)
                    want[(m.src, r, ROUNDS + s)] = len(chunks)
        got = yield out, want
        for (a, r), (m, chunks) in recv_chunks.items():
            for k, (chunk, rnd) in enumerate(zip(chunks, got[(a, r, ROUNDS + s)].tolist(), strict=True)):
                n = sum(b.volume for _, b in chunk)
                ops[r][rnd].append(("recv", a, tag_of(s, k), m.link, n, chunk, DST, _in_place(chunk, r, DST, shapes)))
                for t, bb in chunk:
                    arrived.setdefault((r, t), []).append((bb, rnd))
        # Every arrival so far is at a stage below the next one's: index them for its causality checks.
        index = {key: _arrivals(v) for key, v in arrived.items()}
    steps, staging = _steps(ops, shapes, padded)
    copies = {r: _copy_tables(rank_plans[r], shapes) for r in mine if rank_plans[r].copies}
    rounds = 1 + max((rnd for by in steps.values() for rnd in by), default=-1)
    return Schedule(rounds=rounds, steps=steps, copies=copies, staging=staging, ntensors=len(tensors))


def _arrivals(got: list[tuple[Box, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte boxes received (``(n, d)`` bounds) and their rounds, as arrays."""
    n, d = len(got), len(got[0][0].lo)
    lo = np.array([b.lo for b, _ in got], np.int64).reshape(n, d)
    hi = np.array([b.hi for b, _ in got], np.int64).reshape(n, d)
    return lo, hi, np.array([r for _, r in got], np.int64)


def _after(arrivals: tuple[np.ndarray, np.ndarray, np.ndarray] | None, bb: Box) -> int:
    """The round after the last one in which any byte of ``bb`` arrived (0 when none did)."""
    if arrivals is None:
        return 0
    lo, hi, rounds = arrivals
    hit = np.all((lo < np.asarray(bb.hi)) & (hi > np.asarray(bb.lo)), axis=1)
    return int(rounds[hit].max()) + 1 if hit.any() else 0
