"""Rank plans held as columns: equal to rank plans built the plain way from the plan's moves.

``plan.rank_plan(r)`` and ``rank_plan(..., r)`` both build a ``RankTable``; here a
rank plan is rebuilt from ``plan.transfers()`` one move at a time (the definition of a
rank plan), and the objects the table yields must equal it. The planner's stripe cutter
is checked against a plain reference the same way.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from strategies import plan_case

from jreshard.options import Options
from jreshard.sharding.box import Box
from jreshard.sharding.layout import Layout
from jreshard.sharding.plan import Message, Piece, Plan
from jreshard.sharding.planner import plan_layouts, rank_plan, rank_plans
from jreshard.sharding.rankplan import COPY, RECV, SEND
from jreshard.sharding.rows import Move, Phase
from jreshard.sharding.topology import Link
from jreshard.sharding.units import stripe


def reference_rank_plan(plan: Plan, rank: int) -> tuple[tuple[Move, ...], tuple[Message, ...], tuple[Message, ...]]:
    """``(local, sends, recvs)`` of ``rank``, from the plan's moves in emission order."""
    local: list[Move] = []
    sends: dict[tuple[int, int], list[Piece]] = {}
    recvs: dict[tuple[int, int], list[Piece]] = {}
    links: dict[tuple[int, int, int], Link] = {}
    for mv in plan.transfers():
        if mv.link == Link.SAME_DEVICE and mv.phase == Phase.LAND:
            if mv.dst == rank:
                local.append(mv)
            continue
        piece = Piece(mv.tensor, mv.box, mv.nbytes)
        if mv.src == rank:
            sends.setdefault((mv.stage, mv.dst), []).append(piece)
            links.setdefault((mv.stage, mv.src, mv.dst), mv.link)
        if mv.dst == rank:
            recvs.setdefault((mv.stage, mv.src), []).append(piece)
            links.setdefault((mv.stage, mv.src, mv.dst), mv.link)
    return (
        tuple(local),
        tuple(Message(s, rank, p, links[(s, rank, p)], tuple(v)) for (s, p), v in sorted(sends.items())),
        tuple(Message(s, p, rank, links[(s, p, rank)], tuple(v)) for (s, p), v in sorted(recvs.items())),
    )


def _pairs(src: Layout, dst: Layout) -> list[tuple[Layout, Layout]]:
    """The case's pair twice and reversed, plus a 1-d tensor over the same ranks (rank plans mix
    tensors of different dimensions, whose bounds the table pads)."""
    n = 2 * len(dst.ranks)
    one_d = (
        Layout.replicated(src.ranks, (n,), "float32"),
        Layout.from_mesh(np.array(dst.ranks), ("x",), ("x",), (n,), "float32"),
    )
    return [(src, dst), one_d, (src, dst), (dst, src)]


@given(plan_case())
def test_rank_plans_equal_the_plain_construction(case):
    src, dst, topo, opts = case
    o = Options(**opts)
    pairs = _pairs(src, dst)
    whole = plan_layouts(pairs, topo, o)
    everyone = sorted(set(src.ranks) | set(dst.ranks))
    local = rank_plans(pairs, everyone, topo, o)
    for r in everyone:
        want = reference_rank_plan(whole, r)
        for rp in (whole.rank_plan(r), local[r], rank_plan(pairs, r, topo, o)):
            assert (rp.copies, rp.sends, rp.recvs) == want
            assert rp.stages == tuple(sorted({m.stage for m in (*want[1], *want[2])}))


@given(plan_case())
def test_table_columns_agree_with_the_objects(case):
    src, dst, topo, opts = case
    pairs = _pairs(src, dst)
    whole = plan_layouts(pairs, topo, Options(**opts))
    for r in sorted(set(src.ranks) | set(dst.ranks)):
        rp = whole.rank_plan(r)
        t = rp.table
        assert int(t.cuts[0]) == len(rp.copies) == int(np.sum(t.kind == COPY))
        assert len(t.cuts) - 1 == len(rp.sends) + len(rp.recvs)
        assert np.all(np.diff(t.cuts) > 0) and int(t.cuts[-1]) == len(t)
        msgs = (*rp.sends, *rp.recvs)
        for m, a, b in zip(msgs, t.cuts[:-1].tolist(), t.cuts[1:].tolist(), strict=True):
            assert set(t.kind[a:b].tolist()) == {SEND if m.src == r else RECV}
            assert int(t.nbytes[a:b].sum()) == m.nbytes
            assert t.tensor[a:b].tolist() == [p.tensor for p in m.pieces]
        assert int(t.nbytes[t.kind == SEND].sum()) == sum(m.nbytes for m in rp.sends)
        assert int(t.nbytes[t.kind == RECV].sum()) == sum(m.nbytes for m in rp.recvs)
        assert rp == whole.rank_plan(r) and hash(rp) == hash(whole.rank_plan(r))


def reference_stripe(pieces, k, itemsize, min_bytes):
    """The stripe cutter written plainly on boxes (the definition ``units.stripe`` must match)."""
    out = []
    total = sum(b.volume for _, b in pieces) * itemsize
    if k <= 1 or total == 0:
        return [(i, b, 0) for i, b in pieces]
    pos, cursor = 0, 0
    for i, box in pieces:
        rest = box
        while True:
            while pos < k - 1 and (pos + 1) * total <= cursor * k:
                pos += 1
            shape = rest.shape
            nbytes = math.prod(shape) * itemsize
            space = ((pos + 1) * total) / k - cursor
            d = next((e for e, n in enumerate(shape) if n > 1), None)
            if pos == k - 1 or d is None or nbytes <= space or nbytes < 2 * max(min_bytes, 1):
                out.append((i, rest, pos))
                cursor += nbytes
                break
            row = nbytes // shape[d]
            rows = round(space / row)
            if rows == 0:
                pos += 1
                continue
            rows = max(rows, -(-min_bytes // row))
            if rows >= shape[d] or (shape[d] - rows) * row < min_bytes:
                out.append((i, rest, pos))
                cursor += nbytes
                break
            head, rest = rest.split(d, rest.lo[d] + rows)
            out.append((i, head, pos))
            cursor += rows * row
            pos += 1
    return out


@st.composite
def _pieces(draw):
    ndim = draw(st.integers(1, 3))
    out = []
    for i in range(draw(st.integers(0, 5))):
        lo = tuple(draw(st.integers(0, 4)) for _ in range(ndim))
        hi = tuple(a + draw(st.integers(0, 6)) for a in lo)
        out.append((i, Box(lo, hi)))
    return out


@given(_pieces(), st.integers(1, 9), st.sampled_from([1, 2, 4]), st.sampled_from([0, 1, 8, 64]))
def test_stripe_matches_the_plain_cutter(pieces, k, itemsize, min_bytes):
    assert stripe(pieces, k, itemsize, min_bytes) == reference_stripe(pieces, k, itemsize, min_bytes)
