"""The message-passing engine over RecordingComm: values, bytes per link, staging, pipelining, causality."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedule_oracle import build_schedule

from jreshard.engine import rounds as rounds_module
from jreshard.engine.buffers import CpuBuffers
from jreshard.engine.comm import Posted, RecvOp, SendOp
from jreshard.engine.loopback import LocalComm
from jreshard.engine.recording import RecordingComm
from jreshard.engine.rounds import Shards, compile_rounds, execute
from jreshard.errors import PeerError, TransferError
from jreshard.options import Backend, Options
from jreshard.report import ReportBuilder
from jreshard.schedule import kernels
from jreshard.schedule.ranksteps import RankSteps
from jreshard.schedule.steps import STAGE_ALIGN, STAGING, chunk_pieces
from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import numpy_dtype
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Link, Topology

SENTINEL = 0xA5


def _global(lay: Layout, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=lay.nbytes, dtype=np.uint8)
    return raw.view(lay.np_dtype).reshape(lay.shape) if lay.nbytes else np.zeros(lay.shape, lay.np_dtype)


def _shards(pairs, globals_):
    src, dst = {}, {}
    for t, ((s, d), g) in enumerate(zip(pairs, globals_, strict=True)):
        for r, b in zip(s.ranks, s.boxes, strict=True):
            src[(t, r)] = np.ascontiguousarray(g[b.slices()]).reshape(-1).view(np.uint8)
        for r, b in zip(d.ranks, d.boxes, strict=True):
            dst[(t, r)] = np.full(b.volume * d.itemsize, SENTINEL, np.uint8)
    return Shards(src=src, dst=dst)


class _Late(Posted):
    """A group of :class:`PostingComm`: its bytes move when it is waited on, the latest a transport may."""

    def __init__(self, comm: PostingComm, sends, recvs, buffers, timeout_s: float):
        self._comm, self._args, self._timeout_s = comm, (sends, recvs, buffers), timeout_s

    def wait(self) -> None:
        self._comm.log.append("wait")
        RecordingComm.exchange_rows(self._comm, *self._args, timeout_s=self._timeout_s)

    def abort(self, why: str) -> None:
        self._comm.aborted.append(why)


class PostingComm(RecordingComm):
    """A RecordingComm that posts ahead: a started group's bytes move only when it is waited on, so a pack
    that runs meanwhile into an arena the group still sends from or receives into would change what arrives."""

    posts_ahead = True

    def __init__(self, ranks, topology):
        super().__init__(ranks, topology)
        self.log: list[str] = []
        self.aborted: list[str] = []

    def exchange_rows(self, sends, recvs, buffers, *, timeout_s):
        self.log.append("exchange")
        super().exchange_rows(sends, recvs, buffers, timeout_s=timeout_s)

    def start_rows(self, sends, recvs, buffers, *, timeout_s):
        self.log.append("start")
        return _Late(self, sends, recvs, buffers, timeout_s)


class _LoggedBuffers(CpuBuffers):
    """CpuBuffers that log each pack in the communicator's log (and fail the ``fail_at``-th, when given)."""

    def __init__(self, log: list[str], fail_at: int | None = None):
        super().__init__()
        self._log, self._fail_at, self._packs = log, fail_at, 0

    def pack(self, table, buffers, staging):
        self._packs += 1
        if self._packs == self._fail_at:
            raise ValueError("planted pack failure")
        self._log.append("pack")
        super().pack(table, buffers, staging)


def _run(pairs, topo, options, seed=0, comm_type=RecordingComm):
    plan = plan_layouts(pairs, topo, options)
    globals_ = [_global(s, seed + t) for t, (s, _) in enumerate(pairs)]
    shards = _shards(pairs, globals_)
    comm = comm_type(ranks=topo.ranks, topology=topo)
    buffers = _LoggedBuffers(comm.log) if isinstance(comm, PostingComm) else None
    stats = execute(build_schedule(plan, options), comm, shards, options=options, buffers=buffers)
    for t, ((_, d), g) in enumerate(zip(pairs, globals_, strict=True)):
        for r, b in zip(d.ranks, d.boxes, strict=True):
            got = shards.dst[(t, r)].view(d.np_dtype).reshape(b.shape)
            want = np.ascontiguousarray(g[b.slices()]).reshape(-1).view(np.uint8)
            np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want)
    return plan, comm, stats


def _assert_bytes_match_plan(plan, comm, stats):
    s = plan.stats()
    rec = comm.bytes_by_link()
    assert rec[Link.NETWORK] == s.network_bytes
    assert rec[Link.FAST] == s.fast_bytes
    assert rec[Link.SAME_DEVICE] == 0 and stats.same_device_bytes == s.same_device_bytes
    assert stats.sent_bytes[Link.NETWORK] == s.network_bytes
    # Per (sender, receiver): the recorded bytes are the plan's non-local transfers.
    want: dict[tuple[int, int], int] = {}
    for tr in plan.transfers():
        if tr.link != Link.SAME_DEVICE:
            want[(tr.src, tr.dst)] = want.get((tr.src, tr.dst), 0) + tr.nbytes
    assert comm.bytes_by_pair() == {k: v for k, v in want.items() if v}


@st.composite
def layout_case(draw):
    n = 8
    src_n = draw(st.sampled_from([1, 2, 4, 8]))
    dst_n = draw(st.sampled_from([1, 2, 4, 8]))
    mode = draw(st.sampled_from(["disjoint", "same", "overlap"]))
    perm = draw(st.permutations(range(n)))
    src_ranks = perm[:src_n]
    dst_ranks = (
        perm[n - dst_n :] if mode == "disjoint" else perm[:dst_n] if mode == "same" else perm[n // 4 : n // 4 + dst_n]
    )
    ndim = draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "int8", "bool", "float64"]))

    def mesh(ranks):
        a = draw(st.sampled_from([d for d in (1, 2, 4, 8) if len(ranks) % d == 0]))
        axes = ("a", "b")
        m = np.array(ranks).reshape(a, len(ranks) // a)
        spec = []
        free = list(axes)
        for _ in range(ndim):
            k = draw(st.integers(0, len(free)))
            pick = tuple(draw(st.permutations(free))[:k])
            free = [x for x in free if x not in pick]
            spec.append(pick)
        return m, axes, spec

    sm, dm = mesh(src_ranks), mesh(dst_ranks)
    shape = []
    for d in range(ndim):
        need = 1
        for m, axes, spec in (sm, dm):
            sizes = dict(zip(axes, m.shape, strict=True))
            need = np.lcm(need, int(np.prod([sizes[a] for a in spec[d]])))
        shape.append(int(need) * draw(st.integers(1, 3)))
    src = Layout.from_mesh(sm[0], sm[1], sm[2], shape, dtype)
    dst = Layout.from_mesh(dm[0], dm[1], dm[2], shape, dtype)
    domain = draw(st.sampled_from([1, 2, 4, 8]))
    return src, dst, Topology.uniform(range(n), domain_size=domain)


@given(
    st.lists(layout_case(), min_size=1, max_size=3),
    st.sampled_from([16, 64, 1000]),
    st.integers(1, 4),
    st.sampled_from([RecordingComm, PostingComm]),
)
def test_execute_matches_global_and_plan_bytes(cases, chunk, staging_chunks, comm_type):
    topo = cases[0][2]
    pairs = [(s, d) for s, d, _ in cases]
    opts = Options(chunk_bytes=chunk, staging_bytes=chunk * staging_chunks)
    plan, comm, stats = _run(pairs, topo, opts, comm_type=comm_type)
    _assert_bytes_match_plan(plan, comm, stats)
    assert all(v <= opts.staging_bytes for v in stats.peak_staging_bytes.values())
    assert all(r.nbytes <= chunk for r in comm.records)


def test_fanout_of_chunk_k_runs_with_network_chunk_k_plus_1():
    # 4 sources in domain 0; 4 destinations in domain 1 that all hold the whole tensor.
    src = Layout.from_mesh(np.arange(4), ("x",), ("x",), (64, 64), "float32")
    dst = Layout.replicated(range(4, 8), (64, 64), "float32")
    topo = Topology.uniform(range(8), domain_size=4)
    opts = Options(chunk_bytes=1024, staging_bytes=8192)
    plan, comm, stats = _run([(src, dst)], topo, opts)
    _assert_bytes_match_plan(plan, comm, stats)
    assert plan.stats().fast_bytes > 0 and plan.stats().network_bytes == 64 * 64 * 4
    groups = {}
    for r in comm.records:
        groups.setdefault(r.group, set()).add(r.link)
    overlapped = [g for g, links in groups.items() if links == {Link.NETWORK, Link.FAST}]
    assert len(overlapped) >= len(groups) // 2, groups
    assert max(stats.peak_staging_bytes.values()) <= 8192
    assert stats.rounds < 2 * max(1, len({r.group for r in comm.records if r.link == Link.NETWORK}))


def test_relays_forward_only_bytes_already_received():
    # One source replica, 4 destination domains: relays chain through the domains.
    src = Layout.replicated([0], (32, 16), "int32")
    dst = Layout.from_mesh(np.arange(1, 9).reshape(4, 2), ("dp", "tp"), (None, "tp"), (32, 16), "int32")
    topo = Topology.from_domains({0: 0, **{r: 1 + (r - 1) // 2 for r in range(1, 9)}})
    opts = Options(chunk_bytes=128, staging_bytes=256)
    plan, comm, stats = _run([(src, dst)], topo, opts)
    assert plan.stats().relay_bytes > 0
    _assert_bytes_match_plan(plan, comm, stats)


def test_in_place_sends_use_no_staging():
    src = Layout.from_mesh(np.arange(4), ("x",), ("x",), (64, 32), "float32")
    dst = Layout.from_mesh(np.arange(4, 8), ("x",), ("x",), (64, 32), "float32")
    topo = Topology.uniform(range(8), domain_size=4)
    _, comm, stats = _run([(src, dst)], topo, Options(chunk_bytes=1024, staging_bytes=1024))
    assert set(stats.peak_staging_bytes.values()) == {0}
    assert comm.bytes_by_link()[Link.NETWORK] == 64 * 32 * 4


@given(
    st.lists(
        st.tuples(st.lists(st.integers(1, 5), min_size=0, max_size=3), st.sampled_from([1, 2, 4])),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 50),
)
def test_chunks_are_exact_and_cover_every_byte_once(shapes, chunk):
    pieces = [(t, kernels.byte_box(Box.full(s), isz)) for t, (s, isz) in enumerate(shapes)]
    chunks = chunk_pieces(pieces, chunk)
    sizes = [sum(b.volume for _, b in c) for c in chunks]
    total = sum(b.volume for _, b in pieces)
    assert sum(sizes) == total and all(n == chunk for n in sizes[:-1]) and len(chunks) == -(-total // chunk)
    seen = [np.zeros(b.shape, np.int32) for _, b in pieces]
    order = []
    for c in chunks:
        for t, b in c:
            seen[t][b.slices()] += 1
            order.append((t, b.lo))
    assert all((s == 1).all() for s in seen)
    assert order == sorted(order)  # plan order, C order inside each piece


@pytest.mark.parametrize("gone", ["one source", "every source", "a destination"])
def test_missing_buffers_raise_before_writing(gone):
    src = Layout.from_mesh(np.arange(2), ("x",), ("x",), (8,), "float32")
    dst = Layout.from_mesh(np.arange(2, 4), ("x",), (None,), (8,), "float32")
    topo = Topology.uniform(range(4), domain_size=2)
    plan = plan_layouts([(src, dst)], topo)
    shards = _shards([(src, dst)], [_global(src, 0)])
    if gone == "one source":
        del shards.src[(0, 1)]
        want = "source shard of tensor 0 on rank 1"
    elif gone == "every source":
        shards.src.clear()
        want = "source shard of tensor 0 on rank 0"
    else:
        shards.dst.pop((0, 3))
        want = "destination shard of tensor 0 on rank 3"
    with pytest.raises(TransferError, match=want) as info:
        execute(
            build_schedule(plan, plan.options),
            RecordingComm(ranks=range(4), topology=topo),
            shards,
            options=plan.options,
        )
    assert info.value.destination_intact
    assert all((b == SENTINEL).all() for b in shards.dst.values())


def test_schedule_is_cached_and_chunk_must_hold_an_item():
    src = Layout.from_mesh(np.arange(2), ("x",), ("x",), (8,), "float64")
    dst = Layout.from_mesh(np.arange(2, 4), ("x",), (None,), (8,), "float64")
    plan = plan_layouts([(src, dst)], Topology.uniform(range(4), domain_size=2))
    assert build_schedule(plan, Options()) is build_schedule(plan, Options())
    with pytest.raises(ValueError, match="chunk_bytes=4"):
        build_schedule(plan, Options(chunk_bytes=4, staging_bytes=4))


def test_local_comm_rejects_unmatched_ops():
    comm = LocalComm(ranks=[0, 1])
    a = np.zeros(4, np.uint8)
    with pytest.raises(PeerError, match="no matching receive"):
        comm.exchange([SendOp(0, 1, 0, a)], [], timeout_s=1.0)
    with pytest.raises(PeerError, match="expects 3 B"):
        comm.exchange([SendOp(0, 1, 0, a)], [RecvOp(0, 1, 0, np.zeros(3, np.uint8))], timeout_s=1.0)
    with pytest.raises(PeerError, match="ranks \\[5\\]"):
        comm.exchange([SendOp(5, 1, 0, a)], [RecvOp(5, 1, 0, a)], timeout_s=1.0)
    assert numpy_dtype("bfloat16").itemsize == 2


def test_execute_fills_the_report_and_staged_chunks_start_16_byte_aligned():
    src = Layout.from_mesh(np.arange(4), ("x",), ("x",), (24, 20), "float32")
    dst = Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), (24, 20), "float32")
    topo = Topology.uniform(range(8), domain_size=2)
    opts = Options(chunk_bytes=100, staging_bytes=320)
    plan = plan_layouts([(src, dst)], topo, opts)
    shards = _shards([(src, dst)], [_global(src, 1)])
    comm = RecordingComm(ranks=topo.ranks, topology=topo)
    builder = ReportBuilder(Backend.LOCAL, "test")
    stats = execute(build_schedule(plan, opts), comm, shards, options=opts, report=builder)
    rep = builder.build()
    s = plan.stats()
    assert (rep.network_bytes, rep.fast_bytes, rep.same_device_bytes) == (
        s.network_bytes,
        s.fast_bytes,
        s.same_device_bytes,
    )
    assert stats.chunks == len(comm.records) > s.messages  # messages of several chunks each
    assert rep.messages == s.messages  # the report counts the plan's messages, not their chunks
    assert rep.peak_staging_bytes == sum(stats.peak_staging_bytes.values()) > 0
    assert rep.network_s > 0 and rep.total_s >= rep.pack_s + rep.network_s + rep.fanout_s + rep.unpack_s - 1e-6
    sched = build_schedule(plan, opts)
    staged = [w for steps in sched.steps.values() for step in steps.values() for w in (*step.sends, *step.recvs)]
    staged = [w for w in staged if w.buf == STAGING]
    assert staged and all(w.offset % STAGE_ALIGN == 0 for w in staged)
    assert max(sched.staging.values()) <= opts.staging_bytes


def _strided_senders():
    """One float32 (64, 64) replica on rank 0 to four column shards on ranks 1-4: every chunk rank 0 sends
    is a strided box of its source shard, packed, in 4 rounds of 1 KiB chunks."""
    src = Layout.replicated([0], (64, 64), "float32")
    dst = Layout.from_mesh(np.arange(1, 5), ("x",), (None, "x"), (64, 64), "float32")
    return [(src, dst)], Topology.uniform(range(5), domain_size=1), Options(chunk_bytes=1024, staging_bytes=8192)


def _two_arenas(sched, topo, opts):
    """The arenas the engine gives each rank over a posting transport: two where they fit the bound."""
    return tuple(2 if 2 * sched.staging.get(r, 0) <= opts.staging_bytes else 1 for r in topo.ranks)


def test_a_posting_transport_packs_the_next_round_while_this_one_is_on_the_wire():
    pairs, topo, opts = _strided_senders()
    plan, comm, stats = _run(pairs, topo, opts, comm_type=PostingComm)  # values checked against the global array
    _assert_bytes_match_plan(plan, comm, stats)
    sched = build_schedule(plan, opts)
    compiled = compile_rounds(sched, tuple(topo.ranks), _two_arenas(sched, topo, opts), opts.max_group_ops)
    assert len(compiled.rounds) == 4 and compiled.ahead == (False, True, True, True)
    # Rounds 1-3 are packed while the round before is posted: start, pack, wait; the last round is exchanged.
    assert comm.log == ["pack", "start", "pack", "wait", "start", "pack", "wait", "start", "pack", "wait", "exchange"]
    assert max(stats.peak_staging_bytes.values()) <= opts.staging_bytes  # two arenas, within the bound
    assert stats.peak_staging_bytes[0] == 2 * sched.staging[0]
    # A transport that cannot post ahead keeps one arena and packs each round in its own turn.
    _, _, one = _run(pairs, topo, opts)
    assert one.peak_staging_bytes[0] == sched.staging[0]


def test_packing_ahead_into_the_posted_rounds_arena_would_change_what_arrives(monkeypatch):
    # What the test double can catch: with one arena, a pack ahead overwrites chunks the posted group has
    # not sent yet. The engine keeps such rounds in order; forced ahead, the values must come out wrong.
    pairs, topo, _ = _strided_senders()
    one = Options(chunk_bytes=1024, staging_bytes=4096)  # room for one arena only
    _, comm, stats = _run(pairs, topo, one, comm_type=PostingComm)
    assert "start" not in comm.log and stats.peak_staging_bytes[0] == 4096  # one arena: nothing packed ahead
    monkeypatch.setattr(rounds_module, "_compiled", weakref.WeakKeyDictionary())
    monkeypatch.setattr(rounds_module, "_packs_ahead", lambda before, this: bool(this[0]))
    with pytest.raises(AssertionError, match="Arrays are not equal"):
        _run(pairs, topo, one, comm_type=PostingComm)


def test_forwarded_bytes_are_never_packed_ahead():
    # 4 column shards in domain 0, 4 replicas in domain 1: the fan-out packs the column boxes a rank received
    # where forwards do not leave from landed staging (buffers that are not host-ordered, as the GPU's).
    src = Layout.from_mesh(np.arange(4), ("x",), (None, "x"), (64, 64), "float32")
    dst = Layout.replicated(range(4, 8), (64, 64), "float32")
    topo = Topology.uniform(range(8), domain_size=4)
    opts = Options(chunk_bytes=1024, staging_bytes=16384)
    plan, comm, stats = _run([(src, dst)], topo, opts, comm_type=PostingComm)
    _assert_bytes_match_plan(plan, comm, stats)
    sched = build_schedule(plan, opts)
    two = _two_arenas(sched, topo, opts)
    compiled = compile_rounds(sched, tuple(topo.ranks), two, opts.max_group_ops, from_landing=False)
    for (packs, _, _, _), ahead in zip(compiled.rounds, compiled.ahead, strict=True):
        reads_forwarded = any((t[:, kernels.BUF] % 2 == 1).any() for t, _, _ in packs)
        assert not (ahead and reads_forwarded)
    assert _packs_of_forwarded_bytes(compiled) > 0
    # Host-ordered (the run above): each landed chunk goes to the 3 other replicas from its landed staging.
    assert _packs_of_forwarded_bytes(compile_rounds(sched, tuple(topo.ranks), two, opts.max_group_ops)) == 0


def _tp4_to_tp2_dp2():
    """Column shards on ranks 0-3 (domain 0) into TP2 x DP2 on ranks 4-7 (domain 1): each byte lands on one
    replica of its column block and is forwarded to the other (the MPI benchmark's plain case, small)."""
    src = Layout.from_mesh(np.arange(4), ("x",), (None, "x"), (64, 64), "float32")
    dst = Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("dp", "tp"), (None, "tp"), (64, 64), "float32")
    return [(src, dst)], Topology.uniform(range(8), domain_size=4)


def _packs_of_forwarded_bytes(compiled) -> int:
    return sum(int((t[:, kernels.BUF] % 2 == 1).sum()) for packs, _, _, _ in compiled.rounds for t, _, _ in packs)


def test_a_forwarded_chunk_is_sent_from_the_staging_it_landed_in():
    # With two arenas a forward reads the landed chunk's staging in the round after it landed: no pack of
    # the destination shard. The posting double moves a group's bytes only when it is waited on, so a send
    # that read an arena a later pack or receive had written would deliver the wrong bytes (checked in _run).
    pairs, topo = _tp4_to_tp2_dp2()
    opts = Options(chunk_bytes=1024, staging_bytes=16384)
    plan, comm, stats = _run(pairs, topo, opts, comm_type=PostingComm)
    _assert_bytes_match_plan(plan, comm, stats)
    assert stats.sent_bytes[Link.FAST] == plan.stats().fast_bytes > 0
    sched = build_schedule(plan, opts)
    ranks, two = tuple(topo.ranks), _two_arenas(sched, topo, opts)
    assert all(two[r] == 2 for r in range(4, 8))
    assert _packs_of_forwarded_bytes(compile_rounds(sched, ranks, two, opts.max_group_ops)) == 0
    # Each forward reads the arena of the round before its own, at the landed chunk's offset.
    for r in range(4, 8):
        steps = sched.steps[r]
        cols = steps.columns if isinstance(steps, RankSteps) else rounds_module._columns(steps)
        moved, send_round = rounds_module.forwards_from_landing(cols, 2)
        fast = moved.sends[2] == Link.FAST
        assert fast.any() and send_round is not None
        own = np.repeat(moved.rounds, np.diff(moved.send_at))
        assert (send_round[fast] == own[fast] - 1).all() and (send_round[~fast] == own[~fast]).all()
    # Buffers whose work is queued on streams (the GPU's) order a pack into an arena after the unpacks that
    # read it, not after a later send from it: there the forwards are packed from the shard as before.
    from jreshard.cuda.buffers import CupyBuffers

    assert CpuBuffers.host_ordered and not CupyBuffers.host_ordered
    assert _packs_of_forwarded_bytes(compile_rounds(sched, ranks, two, opts.max_group_ops, from_landing=False)) > 0
    # With one arena the next round's receives reuse it, so the forwards are packed from the shard as before.
    assert _packs_of_forwarded_bytes(compile_rounds(sched, ranks, (1,) * 8, opts.max_group_ops)) > 0
    one = Options(chunk_bytes=1024, staging_bytes=sched.staging[4] * 3 // 2)
    _, _, stats1 = _run(pairs, topo, one, comm_type=PostingComm)  # values checked against the global array
    assert stats1.peak_staging_bytes[4] == build_schedule(plan_layouts(pairs, topo, one), one).staging[4]


@given(
    st.sampled_from([(None, "x"), ("x", None)]),
    st.sampled_from([(None, "tp"), ("tp", None), (None, None)]),
    st.sampled_from([2, 4]),
    st.sampled_from(["float32", "bfloat16", "int8"]),
    st.sampled_from([64, 256, 1024]),
    st.integers(2, 24),
    st.integers(0, 3),
    st.sampled_from([4, 2]),
)
def test_forwards_from_landed_staging_deliver_every_byte(
    src_spec, dst_spec, dp, dtype, chunk, staging_chunks, seed, first
):
    # Sources on domain 0, dp replicas of a server layout from rank ``first`` on (on domain 1, or across both
    # with ranks 2 and 3 sources too, packing their sends ahead while they forward): each byte lands once in a
    # domain, then fans out, over the posting double (a group's bytes move when it is waited on): values and
    # bytes exact.
    src = Layout.from_mesh(np.arange(4), ("x",), src_spec, (24, 40), dtype)
    mesh = np.arange(first, first + 4).reshape(dp, 4 // dp)
    dst = Layout.from_mesh(mesh, ("dp", "tp"), dst_spec if dp == 2 else (None, None), (24, 40), dtype)
    topo = Topology.uniform(range(8), domain_size=4)
    opts = Options(chunk_bytes=chunk, staging_bytes=chunk * staging_chunks)
    plan, comm, stats = _run([(src, dst)], topo, opts, seed=seed, comm_type=PostingComm)
    _assert_bytes_match_plan(plan, comm, stats)
    assert all(v <= opts.staging_bytes for v in stats.peak_staging_bytes.values())


def test_a_forward_that_read_its_landing_arena_after_it_was_reused_would_deliver_wrong_bytes(monkeypatch):
    # What the posting double catches: with the alternation guard removed, one arena serves every round, the
    # next round's receives overwrite the landed chunks before the forwards that read them move.
    pairs, topo = _tp4_to_tp2_dp2()
    one = Options(chunk_bytes=1024, staging_bytes=1 << 20)
    real = rounds_module.forwards_from_landing
    monkeypatch.setattr(rounds_module, "_compiled", weakref.WeakKeyDictionary())
    monkeypatch.setattr(rounds_module, "_arenas", lambda buffers, n, device, bound, want: [buffers.staging(n, device)])
    monkeypatch.setattr(rounds_module, "forwards_from_landing", lambda cols, arenas: real(cols, 2))
    with pytest.raises(AssertionError, match="Arrays are not equal"):
        _run(pairs, topo, one, comm_type=PostingComm)


def test_a_pack_that_fails_while_a_group_is_posted_gives_the_group_up():
    pairs, topo, opts = _strided_senders()
    plan = plan_layouts(pairs, topo, opts)
    shards = _shards(pairs, [_global(pairs[0][0], 3)])
    comm = PostingComm(ranks=topo.ranks, topology=topo)
    with pytest.raises(ValueError, match="planted pack failure"):
        execute(build_schedule(plan, opts), comm, shards, options=opts, buffers=_LoggedBuffers(comm.log, fail_at=2))
    assert comm.log == ["pack", "start"] and len(comm.aborted) == 1
    assert "planted pack failure" in comm.aborted[0]
