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
from jreshard.engine.buffers import CpuBuffers, aligned_empty
from jreshard.engine.comm import LANDED, STARTING, WAITING, Communicator, NativeGroups, PreparedGroups, hook_point
from jreshard.engine.recording import RecordingComm
from jreshard.engine.rounds import Shards, execute
from jreshard.errors import PeerError, TransferError
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder
from jreshard.schedule import kernels
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


class _NoRows(CpuBuffers):
    """Host buffers whose rows the replay does not run compiled: each pack and unpack from Python."""

    __slots__ = ()
    native_rows = False


def _step(sched, comm, src, dst, opts, buffers=None):
    rep = ReportBuilder(Backend.MPI)
    execute(sched, comm, Shards(src=src, dst=dst), options=opts, buffers=buffers or CpuBuffers(), report=rep)
    return rep.build()


# How a step's operations run: the compiled replay drives the prepared groups ("compiled"), or the groups run from
# Python with the packs and unpacks compiled ("rows": NIXL's prepared groups), or everything from Python ("python").
MODES = ["compiled", "rows", "python"]


def _counted(r: replay.Replay, mode: str, steps: int) -> None:
    built = replay.compiled_replay()
    assert r.native_steps == (steps if mode == "compiled" and built else 0)
    assert r.rows_steps == (steps if mode == "rows" and built else 0)


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


def test_a_schedule_replayed_over_a_new_communicator_each_step_compiles_its_operations_once(monkeypatch):
    """An elastic refit makes a communicator per version: the schedule's operations (every table compacted for the
    compiled loop) are built on the first and shared by the next, each of which prepares its own requests, bit
    exact; ``jreshard.clear_caches()`` lets them go."""
    import jreshard
    from jreshard.engine import rounds

    built = []
    monkeypatch.setattr(rounds, "ops_of", lambda *a: built.append(1) or replay.ops_of(*a))
    pairs, topo = _pairs()
    opts = Options(chunk_bytes=1024, staging_bytes=16384)
    sched = build_schedule(plan_layouts(pairs, topo, opts), opts)
    dst = _dst(pairs)
    comms = []
    for step in range(3):
        if step == 2:
            jreshard.clear_caches()
        comms.append(_self_comm(topo))
        globals_ = [_global(s, 10 * step + t) for t, (s, _) in enumerate(pairs)]
        report = _step(sched, comms[-1], _src(pairs, globals_), dst, opts)
        _check(pairs, globals_, dst)
        assert report.replayed_rounds == 0  # each communicator's first step prepares its requests
        assert len(built) == (1 if step < 2 else 2)
    assert _replay_of(comms[0]).ops is _replay_of(comms[1]).ops is not _replay_of(comms[2]).ops
    for comm in comms:
        comm.close()


class _Watched(PreparedGroups):
    """``inner`` observed (:attr:`PreparedGroups.observes`): at every hook it checks that the bytes of every message
    still watched are as they were when watched began (a group's sends from its ``starting``, its receives from
    its ``landed``), through the hook point the schedule says they stay (``sends_kept``, ``recvs_kept``), and that
    every message landed as it was sent."""

    observes = True

    def __init__(self, inner, groups, native: bool):
        self._inner, self._groups = inner, list(groups)
        self.native = inner.native if native else None
        self.hooks: list[tuple] = []
        self.left: list[int] = []
        self._buffers = ()
        self._watched: list[tuple[int, list, list[bytes], str]] = []  # (through point, rows, bytes, what)
        self._sent: dict[tuple[int, int, int], list[bytes]] = {}

    def bind(self, addresses, sizes, buffers):
        self._inner.bind(addresses, sizes, buffers)
        self._buffers = buffers

    def finish(self):
        self._inner.finish()
        self.left.append(len(self._watched))  # bytes watched past the step's last hook (checked by the test)
        self._watched = []
        self._buffers = ()

    def start(self, group, timeout_s):
        self._inner.start(group, timeout_s)

    def wait(self, group):
        self._inner.wait(group)

    def abort(self, group, why):
        self._inner.abort(group, why)

    def failed(self, group, code, request, value, timeout_s):
        self._inner.failed(group, code, request, value, timeout_s)

    def release(self):
        self._inner.release()

    def _bytes(self, rows) -> list[bytes]:
        return [bytes(self._buffers[b][o : o + n]) for _, _, _, b, o, n in rows]

    def _hook(self, group, moment, watch=None, kept=None):
        point = hook_point(group, moment)
        self.hooks.append((group, moment, kept))
        self._watched = [w for w in self._watched if w[0] >= point]
        for through, rows, was, what in self._watched:
            assert self._bytes(rows) == was, f"the {what} changed before hook {point}, though kept through {through}"
        self._watched = [w for w in self._watched if w[0] > point]
        if watch is not None and kept > point:  # kept through this hook only: nothing more to watch
            rows, what = watch
            self._watched.append((kept, rows, self._bytes(rows), what))

    def starting(self, group, sends_kept):
        sends = self._groups[group][0]
        for row, b in zip(sends, self._bytes(sends), strict=True):
            self._sent.setdefault(row[:3], []).append(b)
        assert sends_kept >= hook_point(group, LANDED)  # at least until the group's wait returned
        self._hook(group, STARTING, (sends, f"sends of group {group}"), sends_kept)

    def waiting(self, group):
        self._hook(group, WAITING)

    def landed(self, group, recvs_kept):
        recvs = self._groups[group][1]
        for row, b in zip(recvs, self._bytes(recvs), strict=True):
            assert self._sent[row[:3]].pop(0) == b, f"message {row[:3]} landed other than it was sent"
        assert recvs_kept >= hook_point(group, LANDED)
        self._hook(group, LANDED, (recvs, f"receives of group {group}"), recvs_kept)


class _Wrapping(Communicator):
    """``inner``'s ranks and pacing; prepared groups only (what ``prepare`` makes of ``inner``'s is the subclass's)."""

    def __init__(self, inner):
        self.inner, self.posts_ahead, self.pipelines_packs = inner, inner.posts_ahead, inner.pipelines_packs

    @property
    def local_ranks(self):
        return self.inner.local_ranks

    def exchange(self, sends, recvs, *, timeout_s):  # pragma: no cover - prepared groups only
        raise AssertionError("prepared groups only")


class _WatchedComm(_Wrapping):
    watcher = _Watched  # what prepare wraps the inner prepared groups in

    def __init__(self, inner, native: bool):
        super().__init__(inner)
        self.native, self.prepared = native, []

    def prepare(self, groups):
        p = self.watcher(self.inner.prepare(groups), groups, self.native)
        self.prepared.append(p)
        return p


_WATCHED_CASES = (  # _watched_steps's source and destination specs, chunk bytes and staging chunks
    st.sampled_from([(None, "x"), ("x", None)]),
    st.sampled_from([(None, "tp"), ("tp", None)]),
    st.sampled_from([64, 256]),
    st.integers(2, 8),
)


def _watched_steps(comm_type, mode, src_spec, dst_spec, chunk, staging_chunks):
    """Two steps (the one that prepares, then a replay) of a column- or row-sharded tensor into TP2 x DP2 over
    ``comm_type`` (a :class:`_WatchedComm`) run in ``mode``, each checked; ``(its watcher, the replay, comm)``."""
    src = Layout.from_mesh(np.arange(4), ("x",), src_spec, (24, 40), "float32")
    dst = Layout.from_mesh(np.arange(2, 6).reshape(2, 2), ("dp", "tp"), dst_spec, (24, 40), "float32")
    pairs, topo = [(src, dst)], Topology.uniform(range(8), domain_size=4)
    opts = Options(chunk_bytes=chunk, staging_bytes=chunk * staging_chunks)
    sched = build_schedule(plan_layouts(pairs, topo, opts), opts)
    comm = comm_type(_self_comm(topo), mode == "compiled")
    for step in range(2):
        g = [_global(src, step)]
        out = _dst(pairs)
        _step(sched, comm, _src(pairs, g), out, opts, _NoRows() if mode == "python" else None)
        _check(pairs, g, out)
    (watched,) = comm.prepared
    r = _replay_of(comm)
    _counted(r, mode, 2)
    return watched, r, comm


@pytest.mark.parametrize("mode", MODES)
@given(*_WATCHED_CASES)
def test_observed_groups_see_every_hook_in_order_and_the_bytes_stay_where_the_schedule_says(
    mode, src_spec, dst_spec, chunk, staging_chunks
):
    watched, r, comm = _watched_steps(_WatchedComm, mode, src_spec, dst_spec, chunk, staging_chunks)
    n = len(r.ops.groups)
    want = [(gr, m) for gr in range(n) for m in (STARTING, WAITING, LANDED)]
    assert [h[:2] for h in watched.hooks] == want * 2  # every group's three hooks, in order, each step
    assert watched.left == [0, 0]  # nothing is said to stay past the step's last hook
    for gr, m, kept in watched.hooks:
        assert kept is None or kept == r.ops.kept[gr][0 if m == STARTING else 1]
    comm.inner.close()


class _ByMessage(_Watched):
    """:class:`_Watched` that asks for every message (:attr:`PreparedGroups.by_message`) and checks each hand-over:
    a send's bytes when packed are those it has as its group starts (final), a receive's when unpacked are those
    that landed (nothing wrote them since); each message is handed over once a step."""

    by_message = True

    def __init__(self, inner, groups, native: bool):
        super().__init__(inner, groups, native)
        self.handed: list[tuple[str, int, int]] = []
        self._packed: dict[tuple[int, int], bytes] = {}
        self._landed: dict[int, list[bytes]] = {}

    def packed(self, group, sends):
        rows = self._groups[group][0]
        for k in sends:
            self.handed.append(("send", group, k))
            self._packed[group, k] = self._bytes([rows[k]])[0]

    def starting(self, group, sends_kept):
        rows = self._groups[group][0]
        for k, b in enumerate(self._bytes(rows)):
            assert self._packed.pop((group, k)) == b, f"send {k} of group {group} changed after it was handed over"
        super().starting(group, sends_kept)

    def landed(self, group, recvs_kept):
        super().landed(group, recvs_kept)
        self._landed[group] = self._bytes(self._groups[group][1])

    def unpacked(self, group, recvs):
        rows = self._groups[group][1]
        for k in recvs:
            self.handed.append(("recv", group, k))
            assert self._bytes([rows[k]])[0] == self._landed[group][k], f"receive {k} of group {group} was overwritten"


class _ByMessageComm(_WatchedComm):
    watcher = _ByMessage


@pytest.mark.parametrize("mode", MODES)
@given(*_WATCHED_CASES)
def test_groups_that_read_every_message_get_each_once_final_and_as_landed(mode, src_spec, dst_spec, chunk, staging):
    """By message (:attr:`PreparedGroups.by_message`), every send and receive of every group is handed over exactly
    once a step, a send with its final bytes (right after its last pack where the packs are compiled), a receive
    as it landed (right after its last unpack); the cut operations write the same bytes, and their packs are the
    whole packs' rows, cut."""
    watched, r, comm = _watched_steps(_ByMessageComm, mode, src_spec, dst_spec, chunk, staging)
    every = sorted(
        (what, gr, k)
        for gr, (sends, recvs) in enumerate(r.ops.groups)
        for what, rows in (("send", sends), ("recv", recvs))
        for k in range(len(rows))
    )
    assert sorted(watched.handed) == sorted(every * 2)  # each message once a step
    if mode != "python" and replay.compiled_replay():
        fine = replay.by_message(r.ops)
        assert fine is not None and (fine.after or fine.unpacked)  # packs and unpacks cut at messages
        whole = {tuple(row) for op in r.ops.ops if op[0] in (replay.PACK, replay.UNPACK) for row in op[1].tolist()}
        assert all(tuple(row) in whole for t in fine.tables[::2] for row in t.tolist())  # the whole ops' rows, cut
    comm.inner.close()


class _FailingHook(_ByMessage):
    """:class:`_ByMessage` whose ``nth`` packed hook raises; it notes whether a group was posted then (the groups are
    started and waited on from Python: the "rows" mode) and which groups were given up."""

    nth = 3

    def __init__(self, inner, groups, native: bool):
        super().__init__(inner, groups, native)
        self.calls, self.posted, self.aborted, self.posted_at_failure = 0, -1, [], None

    def start(self, group, timeout_s):
        super().start(group, timeout_s)
        self.posted = group

    def wait(self, group):
        super().wait(group)
        self.posted = -1

    def abort(self, group, why):
        self.aborted.append(group)
        super().abort(group, why)

    def packed(self, group, sends):
        self.calls += 1
        if self.calls == self.nth:
            self.posted_at_failure = self.posted
            raise RuntimeError("the digest failed")
        super().packed(group, sends)


class _FailingComm(_WatchedComm):
    watcher = _FailingHook


def test_a_hook_that_fails_between_packs_raises_and_gives_up_only_a_posted_group():
    """By message, a hook runs after packs, which may run while a group is posted (packed ahead): one that raises
    there gives that group up, and its error is the step's. This schedule (every rank in one process) packs no round
    ahead, so the test checks the error and that no group is given up that was not posted; a hook failing while a
    group is posted is not reached here."""
    src = Layout.from_mesh(np.arange(4), ("x",), (None, "x"), (64, 64), "float32")
    dst = Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), (64, 64), "float32")
    pairs, topo = [(src, dst)], Topology.uniform(range(8), domain_size=4)
    opts = Options(chunk_bytes=256, staging_bytes=8192)
    sched = build_schedule(plan_layouts(pairs, topo, opts), opts)
    comm = _FailingComm(_self_comm(topo), native=False)  # its groups from Python: the test sees them posted
    with pytest.raises(RuntimeError, match="the digest failed"):
        _step(sched, comm, _src(pairs, [_global(src, 0)]), _dst(pairs), opts)
    (hook,) = comm.prepared
    assert hook.calls == hook.nth
    assert hook.aborted == ([] if hook.posted_at_failure in (None, -1) else [hook.posted_at_failure])
    comm.inner.close()


@given(st.lists(st.tuples(st.integers(1, kernels.MAX_DIMS), st.booleans()), min_size=1, max_size=12))
def test_where_records_puts_each_row_is_where_compact_wrote_it(rows):
    """:func:`replay._records` (where a cut run of rows starts in the compacted rows) against :func:`replay._compact`
    itself, over tables of byte rows and cast rows of every number of dimensions: each row's buffer and size are
    at its offset, and the last offset is the compacted length."""
    k = kernels
    table = np.zeros((len(rows), k.COLUMNS), np.int64)
    for i, (nd, cast) in enumerate(rows):
        table[i, [k.BUF, k.OFF, k.STAGE, k.NBYTES, k.NDIM]] = [i + 1, 7 * i, 11 * i, 100 + i, nd]
        table[i, k.SHAPE0 : k.SHAPE0 + nd] = 2
        table[i, k.STRIDE0 : k.STRIDE0 + nd] = 3
        table[i, k.CAST] = k.PACK_CAST if cast else 0
    compact, at = replay._compact(table), replay._records(table)
    assert at[-1] == len(compact)
    assert compact[at[:-1]].tolist() == table[:, k.BUF].tolist()
    assert compact[at[:-1] + 3].tolist() == table[:, k.NBYTES].tolist()


class _PythonLoop(_Wrapping):
    """``inner``, its prepared groups without the compiled replay (the replay's Python loop runs them)."""

    def prepare(self, groups):
        prepared = self.inner.prepare(groups)
        prepared.native = None
        return prepared


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "worker"])
@pytest.mark.parametrize("flip", [None, 3])
def test_a_digested_prepared_refit_digests_every_crossing_message_as_sent_and_as_landed(mode, overlap, flip):
    """The engine's rounds over MPI in one process (every message an in-process copy), digested as if ranks 0-3 (the
    sources) were one process and ranks 4-7 another: one step digests what 0-3 send to 4-7, a second what 4-7
    received from 0-3. The prepared groups run in the compiled replay, or from Python with the rows compiled, or in
    the Python loop, the digests inline or on the worker; every stream's two digests agree, but the one whose message
    had a byte flipped as it landed."""
    from _faulty_comm import FlipComm

    from jreshard.engine.digest import DigestComm, Digests, mismatches, plain

    pairs, topo = _pairs()
    opts = Options(chunk_bytes=1024, staging_bytes=16384)
    sched = build_schedule(plan_layouts(pairs, topo, opts), opts)
    g = [_global(s, t) for t, (s, _) in enumerate(pairs)]
    streams = []
    for side in (range(4), range(4, 8)):
        inner = _self_comm(topo)
        wire = FlipComm(inner, nth=10**9, prepared=True, local=side) if flip and side == range(4, 8) else inner
        comm = DigestComm(wire if mode == "compiled" else _PythonLoop(wire))
        comm._mine = frozenset(side)  # this side's ranks: messages from or to the others are digested
        comm.overlap = overlap
        digests = Digests(side, plain(), "hash")
        for step in range(2):  # the step that prepares, then a replay
            comm.begin(digests if step else Digests(side, plain(), "hash"))
            if step and isinstance(wire, FlipComm):
                wire.seen, wire.nth = 0, flip  # the replay's step flips
            dst = _dst(pairs)
            _step(sched, comm, _src(pairs, g), dst, opts, _NoRows() if mode == "python" else None)
            comm.finish()
            comm.end()
            if not flip:
                _check(pairs, g, dst)
        _counted(_replay_of(comm), mode, 2)
        streams.append(digests.streams())
        comm.close()
    crossing = lambda m: {k: v for k, v in m.items() if int(k.split(">")[0]) < 4 <= int(k.split(">")[1])}  # noqa: E731
    sent, landed = crossing(streams[0]["sent"]), crossing(streams[1]["landed"])
    assert set(sent) == set(landed) and len(sent) >= 4  # the streams from the sources into the destinations
    bad = mismatches(sent, landed)
    assert len(bad) == (1 if flip else 0) and all(why == "differ" for _, _, why in bad), bad
    if flip:
        assert wire.flipped == 1


@pytest.mark.parametrize("mode", ["compiled", "python"])
def test_a_cast_refit_of_views_replays_in_the_compiled_loop_bit_exact(mode):
    """A refit of views that casts on both ends (a fused float32 -> bfloat16 ``qkv`` packed as bfloat16 by its
    senders, a bfloat16 -> float32 leaf widened by its receivers) replays every step after the first in the
    compiled loop, its cast rows compiled; each step's shards equal ``views.transfer``'s bit for bit, as the
    Python loop's do."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import views
    from jreshard.engine.viewrun import run_view_schedule
    from jreshard.schedule.viewsched import view_schedule
    from jreshard.views.lowering import lower_tree

    devs = np.array(jax.devices())
    fsdp = NamedSharding(Mesh(devs[:4], ("fsdp",)), P(None, "fsdp"))
    tp = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
    topo = Topology.uniform(range(8), domain_size=2)
    opts = Options(chunk_bytes=512, staging_bytes=8192)
    comm = _self_comm(topo)
    buffers = CpuBuffers() if mode == "compiled" else _NoRows()
    outs: dict = {}
    vs = None
    for step in range(3):
        rng = np.random.default_rng(step)
        q, k = (jax.device_put(rng.standard_normal((16, n)).astype(np.float32), fsdp) for n in (16, 8))
        low_bf16 = jax.device_put(rng.standard_normal((16, 8)).astype(jnp.bfloat16), fsdp)
        tree = [
            views.astype(views.concat([q, k], axis=1, groups=2), jnp.bfloat16),
            views.astype(low_bf16, jnp.float32),
        ]
        leaves = [leaf for v in tree for leaf in v.leaves()]
        layouts = [Layout.from_sharding(leaf.source.sharding, leaf.shape, leaf.dtype) for leaf in leaves]
        dsts = [Layout.from_sharding(tp, v.shape, v.dtype) for v in tree]
        lows = lower_tree(tree, leaves, layouts, dsts, topo)
        if vs is None:  # one schedule for every step, as a refit keeps it
            vs = view_schedule(lows, layouts, dsts, topo, opts, [None, None], pipelined=True)
        src = {
            (i, s.device.id): np.ascontiguousarray(np.asarray(s.data)).reshape(-1).view(np.uint8)
            for i, leaf in enumerate(leaves)
            for s in leaf.source.addressable_shards
        }
        for t, d in enumerate(dsts):
            for r in d.ranks:
                outs.setdefault((t, r), aligned_empty(d.box_of(r).volume * d.np_dtype.itemsize))[:] = SENTINEL
        run_view_schedule(vs, tree, layouts, dsts, comm, src, outs, options=opts, buffers=buffers)
        for t, (v, d) in enumerate(zip(tree, dsts, strict=True)):
            want = views.transfer(v, tp)
            for s in want.addressable_shards:
                got = outs[(t, s.device.id)].view(d.np_dtype).reshape(d.box_of(s.device.id).shape)
                np.testing.assert_array_equal(got.view(np.uint8), np.asarray(s.data).view(np.uint8))
    r = _replay_of(comm)
    built = replay.compiled_replay()
    assert r.steps == 3 and r.native_steps == (3 if mode == "compiled" and built else 0)
    packs = {op[0]: set() for op in r.ops.ops if op[0] in (replay.PACK, replay.UNPACK)}
    for op in r.ops.ops:
        if op[0] in packs:
            packs[op[0]] |= set(np.unique(op[1][:, kernels.CAST]).tolist()) - {0}
    pack, unpack = (kernels.chain_code(c) for c in (("float32", "bfloat16"), ("bfloat16", "float32")))
    assert packs == {replay.PACK: {pack}, replay.UNPACK: {unpack}}  # both casts ran, each in its direction
    comm.close()
