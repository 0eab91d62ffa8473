"""Prepared refits: the engine's rounds prepared once and replayed, over MPI in one process (``COMM_SELF``: every
message an in-process copy of the compiled replay) and against the engine's unprepared rounds."""

from __future__ import annotations

import ctypes
import signal
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedule_oracle import build_schedule

from jreshard.engine import replay
from jreshard.engine.buffers import CpuBuffers
from jreshard.engine.comm import Communicator, NativeGroups, PreparedGroups
from jreshard.engine.recording import RecordingComm
from jreshard.engine.rounds import Shards, execute
from jreshard.errors import PeerError, TransferError
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder
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
    # schedule is rebound; the step-1 buffers, kept alive and refilled, must not change (checked with every row
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
def test_a_destination_the_prepared_schedule_cannot_write_is_refused_before_any_byte_moves(spoil, message):
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


def test_a_new_layout_or_dtype_is_a_new_schedule_and_the_old_one_still_replays():
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


# The compiled loop's failures, over a stand-in transport made of C functions with MPI's signatures (no MPI): a
# start that posts nothing (libc's usleep: returns 0, sleeps a microsecond a request), a poll that never completes
# its request (libc's sched_yield: returns 0, leaves the flag clear), a start that fails (libc's abs: returns the
# request count), and a poll that completes with a short receive.
_LIBC = ctypes.CDLL(None)
_TEST = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.c_void_p)
_COUNT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.POINTER(ctypes.c_int))


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


_NEVER = _address(_LIBC.sched_yield)


class _StandInGroups(PreparedGroups):
    """One request per message, started and polled by the given C functions; records what the engine asks."""

    def __init__(self, groups, start, test, count):
        spans, expect, at = [], [], 0
        for sends, recvs in groups:
            spans.append((at, at + len(sends) + len(recvs), 0, 0))
            expect += [-1] * len(sends) + [row[5] for row in recvs]
            at += len(sends) + len(recvs)
        self.native = NativeGroups(
            groups=np.array(spans, np.int64).reshape(-1, 4),
            copies=np.zeros((0, 5), np.int64),
            requests=np.zeros(4 * at, np.uint8),
            req_size=4,
            expect=np.array(expect, np.int64),
            status=np.zeros(64, np.uint8),
            status_size=64,
            byte_type=0,
            start=start,
            test=test,
            count=count,
        )
        self.calls: list[tuple] = []

    def bind(self, addresses, sizes, buffers):
        self.calls.append(("bind",))

    def start(self, group, timeout_s):  # pragma: no cover - the compiled loop starts the groups
        raise AssertionError("the stand-in runs in the compiled loop only")

    wait = start

    def abort(self, group, why):
        self.calls.append(("abort", group, why))

    def failed(self, group, code, request, value, timeout_s):
        self.calls.append(("failed", group, code, request, value))
        raise PeerError(f"stand-in failure {code} in group {group}")

    def release(self):
        self.calls.append(("release",))


class _StandInComm(Communicator):
    def __init__(self, fns):
        self.fns, self.prepared = fns, None

    @property
    def local_ranks(self):
        return (1,)

    def exchange(self, sends, recvs, *, timeout_s):  # pragma: no cover
        raise AssertionError("prepared groups only")

    def prepare(self, groups):
        self.prepared = _StandInGroups(groups, *self.fns)
        return self.prepared


def _receiver_step(fns, timeout_s):
    """Rank 1 receives a (16, 16) float32 tensor from rank 0 over the stand-in transport."""
    src = Layout.replicated([0], (16, 16), "float32")
    dst = Layout.replicated([1], (16, 16), "float32")
    topo = Topology.uniform(range(2), domain_size=1)
    opts = Options(chunk_bytes=256, staging_bytes=4096, timeout_s=timeout_s)
    sched = build_schedule(plan_layouts([(src, dst)], topo, opts), opts)
    comm = _StandInComm(fns)
    shards = Shards(src={}, dst={(0, 1): np.zeros(1024, np.uint8)})
    return comm, lambda: execute(sched, comm, shards, options=opts, buffers=CpuBuffers())


needs_native = pytest.mark.skipif(not replay.compiled_replay(), reason="the compiled replay was not built")


@needs_native
def test_the_compiled_loop_stops_at_its_deadline_and_hands_the_group_back():
    usleep = _address(_LIBC.usleep)
    comm, step = _receiver_step((usleep, _NEVER, usleep), timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="stand-in failure 1 in group 0"):
        step()
    assert 0.3 <= time.monotonic() - t0 < 5.0
    assert ("failed", 0, 1, -1, 0) in comm.prepared.calls


@needs_native
def test_the_compiled_loop_reports_a_start_the_transport_refused():
    usleep = _address(_LIBC.usleep)
    comm, step = _receiver_step((_address(_LIBC.abs), _NEVER, usleep), timeout_s=5.0)
    with pytest.raises(PeerError, match="stand-in failure 2"):
        step()
    (failed,) = [c for c in comm.prepared.calls if c[0] == "failed"]
    assert failed[2] == 2 and failed[4] > 0  # FAIL_TRANSPORT, with the code the start returned


@needs_native
def test_the_compiled_loop_refuses_a_receive_of_other_than_the_planned_bytes():
    def completes(request, flag, status):
        flag[0] = 1
        return 0

    def one_byte_short(status, datatype, got):
        got[0] = 255  # every message of the plan carries 256 bytes
        return 0

    keep = (_TEST(completes), _COUNT(one_byte_short))  # alive while the loop may call them
    usleep = _address(_LIBC.usleep)
    comm, step = _receiver_step((usleep, _address(keep[0]), _address(keep[1])), timeout_s=5.0)
    with pytest.raises(PeerError, match="stand-in failure 3"):
        step()
    (failed,) = [c for c in comm.prepared.calls if c[0] == "failed"]
    assert failed[2] == 3 and failed[4] == 255  # FAIL_SIZE: the request, and the bytes it got


@needs_native
def test_a_signal_while_the_compiled_loop_waits_gives_the_group_up_and_raises():
    usleep = _address(_LIBC.usleep)
    comm, step = _receiver_step((usleep, _NEVER, usleep), timeout_s=60.0)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            step()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t0 < 5.0  # seen within the loop's 50 ms signal checks, not at the 60 s deadline
    assert [c[:2] for c in comm.prepared.calls if c[0] == "abort"] == [("abort", 0)]


def test_a_communicator_with_prepared_refits_is_freed_when_its_last_reference_goes():
    # The replays are cached in a weak mapping keyed by the communicator: nothing they hold may keep it alive.
    import gc
    import weakref

    pairs, topo = _pairs()
    opts = Options(chunk_bytes=1024, staging_bytes=16384)
    sched = build_schedule(plan_layouts(pairs, topo, opts), opts)
    comm = _self_comm(topo)
    g = [_global(s, t) for t, (s, _) in enumerate(pairs)]
    _step(sched, comm, _src(pairs, g), _dst(pairs), opts)
    assert len(replay._by_comm[comm]) == 1
    gone = weakref.ref(comm)
    del comm
    gc.collect()
    assert gone() is None
