"""The vectorised pair-paced builder against the scalar one it replaced (``_pairsched_reference``).

Chunk boxes, descriptor rows and whole schedules (every rank's steps, tables, wires, staging and
rounds) must be identical on random layouts, topologies, chunk sizes and process splits.
"""

from __future__ import annotations

import numpy as np
from _pairsched_reference import pair_paced as reference_pair_paced
from hypothesis import given
from hypothesis import strategies as st
from strategies import plan_case
from test_pairsched import build_per_process

from jreshard.options import Options
from jreshard.schedule import kernels
from jreshard.schedule.chunktable import chunk_boxes, contiguous, descriptor_rows
from jreshard.schedule.steps import chunk_pieces
from jreshard.sharding.box import Box


@st.composite
def messages(draw):
    width = draw(st.integers(1, 4))
    nmsg = draw(st.integers(1, 4))
    pieces = []
    for m in range(nmsg):
        for _ in range(draw(st.integers(1, 4))):
            lo = [draw(st.integers(0, 3)) for _ in range(width)]
            shape = [draw(st.integers(0, 5)) for _ in range(width)]
            pieces.append((m, Box(tuple(lo), tuple(a + n for a, n in zip(lo, shape, strict=True)))))
    sizes = [draw(st.integers(1, 60)) for _ in range(nmsg)]
    return width, nmsg, pieces, sizes


@given(messages())
def test_chunk_boxes_equal_chunk_pieces(case):
    width, nmsg, pieces, sizes = case
    lo = np.array([b.lo for _, b in pieces], np.int64).reshape(-1, width)
    hi = np.array([b.hi for _, b in pieces], np.int64).reshape(-1, width)
    cb = chunk_boxes(lo, hi, np.array([m for m, _ in pieces]), np.array(sizes, np.int64), nmsg)
    got = []
    for c in range(len(cb.chunk_msg)):
        a, b = int(cb.chunk_start[c]), int(cb.chunk_start[c + 1])
        boxes = [(int(cb.piece[i]), tuple(cb.lo[i].tolist()), tuple(cb.hi[i].tolist())) for i in range(a, b)]
        got.append((int(cb.chunk_msg[c]), int(cb.chunk_index[c]), int(cb.chunk_bytes[c]), boxes))
    want = []
    for m in range(nmsg):
        mine = [(i, b) for i, (mm, b) in enumerate(pieces) if mm == m]
        for k, chunk in enumerate(chunk_pieces(mine, sizes[m])):
            want.append((m, k, sum(b.volume for _, b in chunk), [(i, b.lo, b.hi) for i, b in chunk]))
    assert got == want


@st.composite
def boxes_in_buffers(draw):
    width = draw(st.integers(1, 4))
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        outer = [draw(st.integers(1, 5)) for _ in range(width)]
        lo = [draw(st.integers(0, n - 1)) for n in outer]
        hi = [draw(st.integers(a + 1, n)) for a, n in zip(lo, outer, strict=True)]
        rows.append((draw(st.integers(0, 7)), tuple(outer), Box(tuple(lo), tuple(hi)), draw(st.integers(0, 99))))
    return width, rows


@given(boxes_in_buffers())
def test_descriptor_rows_equal_build_table(case):
    width, rows = case
    rel = np.array([b.lo for _, _, b, _ in rows], np.int64).reshape(-1, width)
    shape = np.array([b.shape for _, _, b, _ in rows], np.int64).reshape(-1, width)
    outer = np.array([o for _, o, _, _ in rows], np.int64).reshape(-1, width)
    got = descriptor_rows(np.array([r[0] for r in rows]), rel, shape, outer, np.array([r[3] for r in rows]))
    want = np.concatenate([kernels.build_table([(buf, o, b)], staging_offset=at) for buf, o, b, at in rows])
    np.testing.assert_array_equal(got, want)
    flags = contiguous(rel, shape, outer).tolist()
    assert flags == [b.is_contiguous_in(o) for _, o, b, _ in rows]


def _same(a, b):
    assert a.rounds == b.rounds and a.ntensors == b.ntensors
    assert dict(a.staging) == dict(b.staging)
    assert sorted(a.steps) == sorted(b.steps)
    for r in a.steps:
        assert sorted(a.steps[r]) == sorted(b.steps[r]), r
        for rnd, x in a.steps[r].items():
            y = b.steps[r][rnd]
            assert (x.sends, x.recvs) == (y.sends, y.recvs), (r, rnd)
            np.testing.assert_array_equal(x.pack, y.pack)
            np.testing.assert_array_equal(x.unpack, y.unpack)
    assert sorted(a.copies) == sorted(b.copies)
    for r, (keys, st_, dt) in a.copies.items():
        k2, s2, d2 = b.copies[r]
        assert keys == k2
        np.testing.assert_array_equal(st_, s2)
        np.testing.assert_array_equal(dt, d2)


@given(plan_case(), st.data())
def test_vectorised_schedules_equal_the_scalar_builder(case, data):
    src, dst, topo, opts = case
    chunk = data.draw(st.sampled_from([16, 48, 64, 100, 4096]))
    options = Options(**opts, chunk_bytes=chunk, staging_bytes=data.draw(st.sampled_from([4096, 8192, 4100])))
    pairs = [(src, dst), (src, dst), (dst, src)]
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    owner = {r: data.draw(st.integers(0, 2)) for r in ranks}
    groups = [g for g in ([r for r in ranks if owner[r] == p] for p in range(3)) if g]
    new = build_per_process(pairs, topo, options, groups)
    old = build_per_process(pairs, topo, options, groups, builder=reference_pair_paced)
    for i in range(len(groups)):
        _same(new[i], old[i])
