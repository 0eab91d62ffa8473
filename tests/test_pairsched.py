"""Pair-paced rounds: each process builds the schedule of its own ranks from their rank plans alone.

Processes are simulated: each runs the builder for its ranks on rank plans from
``rank_plans`` (never the whole plan), and a mail board delivers a payload only
once its sender has posted it. The schedules must match end to end (every send a
receive in the same round, same tag and bytes), keep every rank within its staging,
and, run by the engine, deliver every destination byte.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi_launch import launch, need_mpi, program, results
from strategies import plan_case

from jreshard.engine.loopback import LocalComm
from jreshard.engine.mail import comm_mail
from jreshard.engine.rounds import Shards, execute
from jreshard.options import Options
from jreshard.schedule.pairsched import pair_chunk_bytes, pair_paced, pair_schedule
from jreshard.schedule.steps import STAGING, Schedule
from jreshard.sharding.caches import clear_caches
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts, rank_plans
from jreshard.sharding.rows import TensorSpec
from jreshard.sharding.topology import Topology

OPTS = Options(chunk_bytes=64, staging_bytes=4096)


def build_per_process(pairs, topo, options, groups, builder=pair_paced):
    """Each process's schedule, built from its own ranks' plans; payloads go through a mail board."""
    tensors = [TensorSpec(str(t), s, d) for t, (s, d) in enumerate(pairs)]
    talks = {i: builder(tensors, rank_plans(pairs, g, topo, options), options) for i, g in enumerate(groups)}
    board: dict = {}
    waiting = {i: next(t) for i, t in talks.items()}  # process -> (what it posted, what it waits for)
    for out, _ in waiting.values():
        board.update(out)
    done: dict[int, Schedule] = {}
    while waiting:
        ready = [i for i, (_, want) in waiting.items() if all(k in board for k in want)]
        assert ready, f"no process can go on: they wait for {[sorted(w)[:3] for _, w in waiting.values()]}"
        for i in ready:
            _, want = waiting.pop(i)
            got = {}
            for k, n in want.items():
                assert len(board[k]) == n, f"payload {k} has {len(board[k])} values, the receiver expects {n}"
                got[k] = board[k]
            try:
                out, want2 = talks[i].send(got)
            except StopIteration as stop:
                done[i] = stop.value
                continue
            board.update(out)
            waiting[i] = (out, want2)
    return done


def merged(schedules):
    """One schedule of every process's ranks, for LocalComm (one process: each round runs as one group)."""
    steps, copies, staging = {}, {}, {}
    for s in schedules:
        steps.update(s.steps)
        copies.update(s.copies)
        staging.update(s.staging)
    n = max((s.ntensors for s in schedules), default=0)
    return Schedule(max((s.rounds for s in schedules), default=0), steps, copies, staging, n, groups={})


def check_groups(per_process, options):
    """No rank has more than max_group_ops operations in one exchange group of its process."""
    for sched in per_process:
        for r, by_round in sched.steps.items():
            for rnd, step in by_round.items():
                cut = sched.groups.get(rnd)
                if cut is None:  # the round runs as one group
                    assert len(step.sends) + len(step.recvs) <= options.max_group_ops
                    continue
                keys = collections.Counter(cut[(r, w.peer, w.tag)] for w in step.sends)
                keys.update(cut[(w.peer, r, w.tag)] for w in step.recvs)
                assert max(keys.values()) <= options.max_group_ops, (r, rnd, keys)


def check_matched(sched, options):
    sends, recvs = collections.Counter(), collections.Counter()
    for r, by_round in sched.steps.items():
        for rnd, step in by_round.items():
            sends.update((r, w.peer, rnd, w.tag, w.nbytes) for w in step.sends)
            recvs.update((w.peer, r, rnd, w.tag, w.nbytes) for w in step.recvs)
            staged = sum(w.nbytes for w in (*step.sends, *step.recvs) if w.buf == STAGING)
            assert staged <= options.staging_bytes
    assert sends == recvs
    for r, peak in sched.staging.items():
        assert peak <= options.staging_bytes, (r, peak)


def _global(lay: Layout, seed: int) -> np.ndarray:
    raw = np.random.default_rng(seed).integers(0, 256, size=lay.nbytes, dtype=np.uint8)
    return raw.view(lay.np_dtype).reshape(lay.shape) if lay.nbytes else np.zeros(lay.shape, lay.np_dtype)


def run_and_check(pairs, topo, options, sched):
    values = [_global(s, t) for t, (s, _) in enumerate(pairs)]
    src, dst = {}, {}
    for t, ((s, d), g) in enumerate(zip(pairs, values, strict=True)):
        for r, b in zip(s.ranks, s.boxes, strict=True):
            src[(t, r)] = np.ascontiguousarray(g[b.slices()]).reshape(-1).view(np.uint8)
        for r, b in zip(d.ranks, d.boxes, strict=True):
            dst[(t, r)] = np.full(b.volume * d.itemsize, 0xA5, np.uint8)
    execute(sched, LocalComm(topo.ranks), Shards(src=src, dst=dst), options=options)
    for t, ((_, d), g) in enumerate(zip(pairs, values, strict=True)):
        for r, b in zip(d.ranks, d.boxes, strict=True):
            want = np.ascontiguousarray(g[b.slices()]).reshape(-1).view(np.uint8)
            np.testing.assert_array_equal(dst[(t, r)], want)


@given(plan_case(), st.data())
def test_per_process_schedules_match_and_deliver(case, data):
    src, dst, topo, opts = case
    options = Options(**opts, chunk_bytes=OPTS.chunk_bytes, staging_bytes=OPTS.staging_bytes)
    pairs = [(src, dst), (src, dst), (dst, src)]
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    owner = {r: data.draw(st.integers(0, 3)) for r in ranks}  # which process drives each rank
    groups = [g for g in ([r for r in ranks if owner[r] == p] for p in range(4)) if g]
    per_process = build_per_process(pairs, topo, options, groups)
    assert len(per_process) == len(groups)
    check_groups(per_process.values(), options)
    sched = merged(list(per_process.values()))
    check_matched(sched, options)
    run_and_check(pairs, topo, options, sched)
    # A rank's rounds do not depend on which process drives it, or on which other ranks that process drives.
    alone = merged(list(build_per_process(pairs, topo, options, [ranks]).values()))
    assert alone.rounds == sched.rounds
    for r in ranks:
        assert _wires(alone, r) == _wires(sched, r)


def _wires(sched, rank):
    return {rnd: (step.sends, step.recvs) for rnd, step in sched.steps.get(rank, {}).items()}


def test_a_relay_chain_forwards_only_what_arrived():
    """Four domains need one replica's bytes: relays and fan-outs run in later rounds than their bytes land."""
    shape = (64, 8)
    src = Layout.from_mesh(np.arange(2), ("x",), ("x",), shape, "float32")
    dst = Layout.replicated(range(2, 18), shape, "float32")
    topo = Topology.from_domains({0: 0, 1: 0, **{r: 1 + (r - 2) // 4 for r in range(2, 18)}})
    pairs = [(src, dst)]
    per_process = build_per_process(pairs, topo, OPTS, [[r] for r in range(18)])
    sched = merged(list(per_process.values()))
    check_matched(sched, OPTS)
    run_and_check(pairs, topo, OPTS, sched)
    assert sched.rounds > 2  # the chain is pipelined over several rounds


def test_one_process_through_a_communicator():
    shape = (32, 6)
    src = Layout.from_mesh(np.arange(4), ("x",), ("x",), shape, "int32")
    dst = Layout.from_mesh(np.arange(4, 8).reshape(2, 2), ("a", "b"), ("b", "a"), shape, "int32")
    topo = Topology.uniform(range(8), 4)
    pairs = [(src, dst), (src, dst)]
    tensors = [TensorSpec(str(t), s, d) for t, (s, d) in enumerate(pairs)]
    comm = LocalComm(range(8))
    sched = pair_schedule(tensors, rank_plans(pairs, range(8), topo, OPTS), OPTS, comm_mail(comm, 5.0))
    check_matched(sched, OPTS)
    assert max(sched.staging.values()) > 0  # column shards: chunks are packed into the staging arena
    run_and_check(pairs, topo, OPTS, sched)


@pytest.mark.parametrize("max_ops", [2, 3, 5])
def test_ranks_with_many_peers_run_rounds_in_bounded_groups(max_ops):
    """Sixteen sources each send every destination a part: a destination's round holds more operations
    than max_group_ops, so its process cuts it into groups keyed alike at both ends of every chunk."""
    shape = (64, 16)
    src = Layout.from_mesh(np.arange(16), ("x",), ("x",), shape, "float32")
    dst = Layout.from_mesh(np.arange(16, 24), ("y",), (None, "y"), shape, "float32")
    topo = Topology.uniform(range(24), domain_size=24)
    options = Options(chunk_bytes=64, staging_bytes=4096, max_group_ops=max_ops)
    groups = [list(range(0, 8)), list(range(8, 16)), list(range(16, 20)), list(range(20, 24))]
    per_process = build_per_process([(src, dst)], topo, options, groups)
    check_groups(per_process.values(), options)
    assert any(s.groups for s in per_process.values())  # some rounds were cut
    sched = merged(list(per_process.values()))
    check_matched(sched, options)
    run_and_check([(src, dst)], topo, options, sched)
    # Both ends of every cut chunk put it in the same group.
    key = {}
    for s in per_process.values():
        for rnd, cut in s.groups.items():
            for op, k in cut.items():
                assert key.setdefault((rnd, op), k) == k


def test_pair_paced_rounds_need_two_operations_per_group():
    src = Layout.from_mesh(np.arange(2), ("x",), ("x",), (8,), "float32")
    dst = Layout.replicated(range(2, 4), (8,), "float32")
    topo = Topology.uniform(range(4), domain_size=2)
    with pytest.raises(ValueError, match="max_group_ops=1"):
        build_per_process([(src, dst)], topo, Options(max_group_ops=1), [[0, 1, 2, 3]])


def test_a_kept_schedule_replays_its_mail():
    """Asked again with its key, the schedule is not rebuilt but sends the same mail, so peers that did
    rebuild it (after clear_caches) get every payload they wait for."""
    shape = (32, 6)
    src = Layout.from_mesh(np.arange(4), ("x",), ("x",), shape, "int32")
    dst = Layout.replicated(range(4, 8), shape, "int32")
    topo = Topology.uniform(range(8), 2)
    tensors = [TensorSpec("w", src, dst)]
    plans = rank_plans([(src, dst)], range(8), topo, OPTS)
    comm = LocalComm(range(8))
    said = []

    def mail(out, want):
        said[-1].append(({k: v.tolist() for k, v in out.items()}, dict(want)))
        return comm_mail(comm, 5.0)(out, want)

    clear_caches()
    scheds = []
    for _ in range(2):
        said.append([])
        scheds.append(pair_schedule(tensors, plans, OPTS, mail, key="w"))
    assert scheds[0] is scheds[1] and said[0] == said[1] and len(said[0]) >= 2
    clear_caches()
    said.append([])
    again = pair_schedule(tensors, plans, OPTS, mail, key="w")
    assert again is not scheds[0] and said[2] == said[0]
    assert _wires(again, 5) == _wires(scheds[0], 5)


def test_pair_chunks_share_the_staging():
    o = Options(chunk_bytes=1 << 20, staging_bytes=1 << 20)
    assert pair_chunk_bytes((4, 400), (2, 200), 100, o, 4) == (1 << 20) // 8  # even: half the staging / 4 peers
    assert pair_chunk_bytes((4, 400), (1, 100), 100, o, 4) == (1 << 20) // 8  # the sender's share decides
    # A pair that carries all of both ends' bytes gets most of their staging (half evenly, half by bytes).
    assert pair_chunk_bytes((4, 400), (2, 400), 400, o, 4) == (1 << 20) * 5 // 16
    assert pair_chunk_bytes((1, 1), (1, 1), 1, Options(chunk_bytes=1024, staging_bytes=1 << 20), 4) == 1024
    with pytest.raises(ValueError, match=r"staging_bytes=64 .* 100 and 3 peers"):
        pair_chunk_bytes((100, 10), (3, 10), 1, Options(chunk_bytes=64, staging_bytes=64), 4)


@given(st.lists(st.integers(0, 1 << 40), min_size=1, max_size=40), st.integers(1, 1 << 34))
def test_one_ranks_pair_shares_add_up_to_half_its_staging_at_most(pair_bytes, staging):
    """Whatever its peers' bytes, the shares one rank gives them add up to at most staging / 2: so
    a round's sends (or receives) never need more staging than half of staging_bytes."""
    from jreshard.schedule.pairsched import _share

    total = sum(pair_bytes)
    shares = [_share(staging, len(pair_bytes), b, total) for b in pair_bytes]
    assert sum(shares) <= staging // 2
    assert min(shares) >= staging // (4 * len(pair_bytes)) - 1  # every peer keeps half an even share


@pytest.mark.mpi
@pytest.mark.parametrize("max_ops", [None, 2])
def test_pair_rounds_over_mpi(tmp_path, max_ops):
    """Four processes, one rank each, plan and schedule only their own ranks and deliver every byte
    (with max_group_ops=2, in rounds cut into groups)."""
    need_mpi()
    env = {} if max_ops is None else {"JRESHARD_MAX_GROUP_OPS": str(max_ops)}
    launch([program(4, "pair_rounds.py", env=env)], tmp_path, timeout_s=120)
    got = results(tmp_path, "pairs")
    assert sorted(got) == list(range(4))
    assert all("error" not in r for r in got.values()), got
    pairs = engine_groups_case(4)
    whole = plan_layouts(pairs, Topology.uniform(range(4), domain_size=4))
    s = whole.stats()
    assert sum(r["checked"] for r in got.values()) == s.destination_bytes
    assert sum(r["sent"]["FAST"] for r in got.values()) == s.fast_bytes
    assert sum(r["sent"]["NETWORK"] for r in got.values()) == s.network_bytes == s.network_bytes_lower_bound
    assert all(r["staging"] <= 4096 for r in got.values())
    if max_ops is not None:
        assert sum(r["cut_rounds"] for r in got.values()) > 0


def engine_groups_case(n):
    import importlib.util

    from mpi_launch import BODIES

    spec = importlib.util.spec_from_file_location("engine_groups", BODIES / "engine_groups.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.case(n)[1]
