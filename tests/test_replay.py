"""Prepared refits: the engine's rounds prepared once and replayed, over MPI in one process (``COMM_SELF``: every
message a local copy of the compiled replay) and against the engine's unprepared rounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jreshard.engine import replay
from jreshard.engine.buffers import CpuBuffers
from jreshard.engine.recording import RecordingComm
from jreshard.engine.rounds import Shards, execute
from jreshard.errors import TransferError
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder
from jreshard.schedule.steps import build_schedule
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Topology

MPI = pytest.importorskip("mpi4py.MPI")
from jreshard.mpi.comm import MpiComm  # noqa: E402

SENTINEL = 0xA5


def _global(lay: Layout, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, size=lay.nbytes, dtype=np.uint8)
    return raw.view(lay.np_dtype).reshape(lay.shape)


def _src(pairs, globals_) -> dict:
    return {
        (t, r): np.ascontiguousarray(g[b.slices()]).reshape(-1).view(np.uint8)
        for t, ((s, _), g) in enumerate(zip(pairs, globals_, strict=True))
        for r, b in zip(s.ranks, s.boxes, strict=True)
    }


def _dst(pairs) -> dict:
    return {
        (t, r): np.full(b.volume * d.itemsize, SENTINEL, np.uint8)
        for t, (_, d) in enumerate(pairs)
        for r, b in zip(d.ranks, d.boxes, strict=True)
    }


def _check(pairs, globals_, dst) -> None:
    for t, ((_, d), g) in enumerate(zip(pairs, globals_, strict=True)):
        for r, b in zip(d.ranks, d.boxes, strict=True):
            want = np.ascontiguousarray(g[b.slices()]).reshape(-1).view(np.uint8)
            np.testing.assert_array_equal(dst[(t, r)], want)


def _pairs():
    """Column shards on ranks 0-3 into TP2 x DP2 on ranks 4-7 (strided packs, landing and fan-out), and a
    replicated bfloat16 tensor into row shards (contiguous, sent in place)."""
    src = Layout.from_mesh(np.arange(4), ("x",), (None, "x"), (64, 64), "float32")
    dst = Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), (64, 64), "float32")
    rep = Layout.replicated(range(4), (32, 16), "bfloat16")
    rows = Layout.from_mesh(np.arange(4, 8), ("x",), ("x", None), (32, 16), "bfloat16")
    return [(src, dst), (rep, rows)], Topology.uniform(range(8), domain_size=4)


def _self_comm(topo) -> MpiComm:
    return MpiComm(MPI.COMM_SELF, dict.fromkeys(topo.ranks, 0))


def _step(sched, comm, src, dst, opts):
    rep = ReportBuilder(Backend.MPI)
    execute(sched, comm, Shards(src=src, dst=dst), options=opts, buffers=CpuBuffers(), report=rep)
    return rep.build()


def _replay_of(comm) -> replay.Replay:
    (r,) = replay._by_comm[comm].values()
    return r


def test_a_refit_prepares_once_then_replays_in_the_compiled_loop_bit_exact():
    pairs, topo = _pairs()
    opts = Options(chunk_bytes=1024, staging_bytes=16384)
    sched = build_schedule(plan_layouts(pairs, topo, opts), opts)
    comm = _self_comm(topo)
    dst = _dst(pairs)
    for step in range(4):
        globals_ = [_global(s, 10 * step + t) for t, (s, _) in enumerate(pairs)]
        report = _step(sched, comm, _src(pairs, globals_), dst, opts)
        _check(pairs, globals_, dst)
        assert report.rounds > 0 and report.replayed_rounds == (0 if step == 0 else report.rounds)
    r = _replay_of(comm)
    assert r.steps == 4 and r.native_steps == (4 if replay.compiled_replay() else 0)
    comm.close()
    assert not replay._by_comm.get(comm)  # closing the communicator released its prepared requests


def test_moved_buffers_are_rebound_and_the_old_ones_never_written(monkeypatch):
    # Step 2 hands the engine new source and destination buffers (new addresses): every pointer of the prepared
    # program is rebound; the step-1 buffers, kept alive and refilled, must not change (checked with every row
    # validated again, JRESHARD_CHECK_BOUNDS=1, and without).
    pairs, topo = _pairs()
    opts = Options(chunk_bytes=1024, staging_bytes=16384)
    sched = build_schedule(plan_layouts(pairs, topo, opts), opts)
    for check in ("1", ""):
        monkeypatch.setenv("JRESHARD_CHECK_BOUNDS", check)
        comm = _self_comm(topo)
        g1 = [_global(s, t) for t, (s, _) in enumerate(pairs)]
        src1, dst1 = _src(pairs, g1), _dst(pairs)
        _step(sched, comm, src1, dst1, opts)
        _check(pairs, g1, dst1)
        for b in dst1.values():
            b[:] = SENTINEL
        g2 = [_global(s, 100 + t) for t, (s, _) in enumerate(pairs)]
        src2, dst2 = _src(pairs, g2), _dst(pairs)
        report = _step(sched, comm, src2, dst2, opts)
        _check(pairs, g2, dst2)
        assert report.replayed_rounds == report.rounds
        assert all((b == SENTINEL).all() for b in dst1.values())  # nothing went through a stale pointer
        comm.close()


def _shorter(dst: dict, key) -> None:
    dst[key] = dst[key][:-1]  # one byte short: the last row into it would write past its end


def _read_only(dst: dict, key) -> None:
    dst[key].setflags(write=False)


@pytest.mark.parametrize(
    ("spoil", "message"),
    [(_shorter, r"nothing was written|would leave buffer"), (_read_only, "read-only")],
    ids=["a byte short", "read-only"],
)
def test_a_destination_the_prepared_program_cannot_write_is_refused_before_any_byte_moves(spoil, message):
    pairs, topo = _pairs()
    opts = Options(chunk_bytes=1024, staging_bytes=16384)
    sched = build_schedule(plan_layouts(pairs, topo, opts), opts)
    comm = _self_comm(topo)
    g = [_global(s, t) for t, (s, _) in enumerate(pairs)]
    _step(sched, comm, _src(pairs, g), _dst(pairs), opts)  # prepared against buffers that fit
    dst = _dst(pairs)
    spoil(dst, (0, 5))
    with pytest.raises(TransferError, match=message) as err:
        _step(sched, comm, _src(pairs, g), dst, opts)
    assert err.value.destination_intact
    assert all((b == SENTINEL).all() for b in dst.values())
    comm.close()


def test_a_new_layout_or_dtype_is_a_new_program_and_the_old_one_still_replays():
    pairs, topo = _pairs()
    opts = Options(chunk_bytes=1024, staging_bytes=16384)
    comm = _self_comm(topo)
    other = [
        (
            Layout.from_mesh(np.arange(4), ("x",), ("x", None), (64, 64), "int8"),
            Layout.from_mesh(np.arange(4, 8), ("x",), (None, "x"), (64, 64), "int8"),
        )
    ]
    first = build_schedule(plan_layouts(pairs, topo, opts), opts)
    second = build_schedule(plan_layouts(other, topo, opts), opts)
    for sched, ps, replayed in ((first, pairs, False), (second, other, False), (first, pairs, True)):
        g = [_global(s, 7 + t) for t, (s, _) in enumerate(ps)]
        dst = _dst(ps)
        report = _step(sched, comm, _src(ps, g), dst, opts)
        _check(ps, g, dst)
        assert report.replayed_rounds == (report.rounds if replayed else 0)
    assert len(replay._by_comm[comm]) == 2
    comm.close()


@given(
    st.sampled_from([(None, "x"), ("x", None)]),
    st.sampled_from([(None, "tp"), ("tp", None), (None, None)]),
    st.sampled_from([2, 4]),
    st.sampled_from(["float32", "bfloat16", "int8", "float64", "bool"]),
    st.sampled_from([64, 256, 1024]),
    st.integers(2, 24),
    st.integers(0, 3),
)
def test_prepared_and_unprepared_rounds_write_the_same_bytes(
    src_spec, dst_spec, dp, dtype, chunk, staging_chunks, seed
):
    src = Layout.from_mesh(np.arange(4), ("x",), src_spec, (24, 40), dtype)
    mesh = np.arange(2, 6).reshape(dp, 4 // dp)
    dst = Layout.from_mesh(mesh, ("dp", "tp"), dst_spec if dp == 2 else (None, None), (24, 40), dtype)
    pairs, topo = [(src, dst)], Topology.uniform(range(8), domain_size=4)
    opts = Options(chunk_bytes=chunk, staging_bytes=chunk * staging_chunks)
    sched = build_schedule(plan_layouts(pairs, topo, opts), opts)
    g = [_global(src, seed)]
    unprepared = _dst(pairs)
    execute(
        sched, RecordingComm(ranks=topo.ranks, topology=topo), Shards(src=_src(pairs, g), dst=unprepared), options=opts
    )
    comm = _self_comm(topo)
    for _ in range(2):  # the step that prepares, then a replay
        prepared = _dst(pairs)
        _step(sched, comm, _src(pairs, g), prepared, opts)
        for k in unprepared:
            np.testing.assert_array_equal(prepared[k], unprepared[k])
    _check(pairs, g, prepared)
    comm.close()
