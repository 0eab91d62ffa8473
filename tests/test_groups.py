"""Bounded exchange groups (Options.max_group_ops): the same messages, bytes, order and results in
more, smaller groups, on the recording transport and over MPI (4 and 16 processes)."""

from __future__ import annotations

import collections
import importlib.util

import pytest
from mpi_launch import BODIES, launch, need_mpi, program, results
from schedule_oracle import build_schedule

from jreshard.engine.recording import RecordingComm
from jreshard.engine.rounds import execute
from jreshard.options import Options
from jreshard.schedule.groups import group_rounds, rank_op_counts

_spec = importlib.util.spec_from_file_location("engine_groups", BODIES / "engine_groups.py")
assert _spec is not None and _spec.loader is not None
engine_groups = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_groups)

OPTS = dict(chunk_bytes=64, staging_bytes=4096, timeout_s=60)


def _run_recording(n: int, max_ops: int):
    plan, pairs, globals_ = engine_groups.case(n)
    comm = RecordingComm(ranks=plan.topology.ranks, topology=plan.topology)
    shards = engine_groups.shards_for(pairs, globals_, set(plan.topology.ranks))
    opts = Options(max_group_ops=max_ops, **OPTS)
    stats = execute(build_schedule(plan, opts), comm, shards, options=opts)
    assert engine_groups.check(pairs, globals_, shards) > 0
    return plan, comm, stats


def test_the_split_keeps_messages_bytes_order_and_results():
    plan, base, base_stats = _run_recording(16, 2048)
    sched = build_schedule(plan, Options(**OPTS))
    per_round = max(len(st.sends) + len(st.recvs) for by_round in sched.steps.values() for st in by_round.values())
    assert per_round > 3  # the plan has more operations per rank in a round than the bounds below
    assert base.groups == sched.rounds  # default bound: one group per round
    for max_ops in (1, 2, 3):
        _, comm, stats = _run_recording(16, max_ops)
        assert comm.groups > base.groups  # cut into more groups
        per_group = collections.Counter()
        for r in comm.records:
            per_group[(r.group, r.sender)] += 1
            per_group[(r.group, r.receiver)] += 1
        assert max(per_group.values()) <= max_ops  # no rank over the bound in any group
        assert comm.bytes_by_link() == base.bytes_by_link() and stats.sent_bytes == base_stats.sent_bytes
        assert comm.bytes_by_pair() == base.bytes_by_pair()

        def per_pair(c):
            out = collections.defaultdict(list)
            for r in c.records:
                out[(r.sender, r.receiver)].append((r.tag, r.nbytes))
            return out

        assert per_pair(comm) == per_pair(base)  # the same chunks between each pair, in the same order
        assert len(comm.records) == len(base.records)


def test_group_counts_per_rank_match_what_the_engine_runs():
    plan, comm, _ = _run_recording(16, 2)
    sched = build_schedule(plan, Options(**OPTS))
    rg = group_rounds(sched, 2)
    ran = collections.defaultdict(set)
    for r in comm.records:
        ran[r.sender].add(r.group)
        ran[r.receiver].add(r.group)
    assert {rank: len(g) for rank, g in ran.items()} == {r: rg.rank_groups(sched, r) for r in ran}
    sends = collections.Counter(r.sender for r in comm.records)
    recvs = collections.Counter(r.receiver for r in comm.records)
    assert {r: (sends[r], recvs[r]) for r in ran} == {r: rank_op_counts(sched)[r] for r in ran}


def test_max_group_ops_is_validated():
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match=f"max_group_ops={bad!r}"):
            Options(max_group_ops=bad)


def _by_pair(sends: list) -> dict:
    """A process's sent chunks per (src, dst), in the order sent: the order the split must keep."""
    out = collections.defaultdict(list)
    for src, dst, tag, n in sends:
        out[(src, dst)].append((tag, n))
    return dict(out)


def _mpi(tmp_path, procs: int, max_ops: int | None, timeout_s: float):
    env = {} if max_ops is None else {"JRESHARD_MAX_GROUP_OPS": str(max_ops)}
    out = tmp_path / f"ops{max_ops}"
    out.mkdir()
    launch([program(procs, "engine_groups.py", env=env)], out, timeout_s=timeout_s)
    got = results(out, "groups")
    assert sorted(got) == list(range(procs))
    assert all("error" not in r for r in got.values()), got
    return got


@pytest.mark.mpi
def test_mpi_split_groups_same_bytes_and_results(tmp_path):
    need_mpi()
    whole, split = _mpi(tmp_path, 4, None, 120), _mpi(tmp_path, 4, 1, 120)
    assert sum(r["checked"] for r in whole.values()) > 0
    for rank in whole:
        assert whole[rank]["checked"] == split[rank]["checked"]
        assert whole[rank]["sent"] == split[rank]["sent"]
        assert _by_pair(whole[rank]["sends"]) == _by_pair(split[rank]["sends"])  # same chunks, same order
        assert split[rank]["max_ops"] <= 1
    assert sum(r["exchanges"] for r in split.values()) > sum(r["exchanges"] for r in whole.values())


@pytest.mark.mpi
@pytest.mark.slow
def test_engine_over_mpi_at_16_processes(tmp_path):
    need_mpi()
    whole, split = _mpi(tmp_path, 16, None, 110), _mpi(tmp_path, 16, 2, 110)
    plan, _, _ = engine_groups.case(16)
    s = plan.stats()
    assert sum(r["sent"]["NETWORK"] for r in whole.values()) == s.network_bytes == s.network_bytes_lower_bound
    assert sum(r["sent"]["FAST"] for r in whole.values()) == s.fast_bytes
    dest_bytes = sum(sum(b.volume for b in d.boxes) * d.itemsize for _, d in engine_groups.case(16)[1])
    assert sum(r["checked"] for r in whole.values()) == sum(r["checked"] for r in split.values()) == dest_bytes
    for rank in whole:
        assert whole[rank]["sent"] == split[rank]["sent"]
        assert _by_pair(whole[rank]["sends"]) == _by_pair(split[rank]["sends"])
        assert split[rank]["max_ops"] <= 2
    assert sum(r["exchanges"] for r in split.values()) > sum(r["exchanges"] for r in whole.values())


def test_op_counts_from_the_plan_equal_the_schedule():
    from jreshard.schedule.groups import plan_op_counts

    for n in (8, 16):
        plan, _, _ = engine_groups.case(n)
        for chunk in (64, 1000):
            sched = build_schedule(plan, Options(chunk_bytes=chunk, staging_bytes=4096))
            assert plan_op_counts(plan, chunk) == rank_op_counts(sched)


def test_a_message_a_rank_sends_itself_counts_as_two_operations():
    """A rank forwarding to itself (an element a fused view uses twice) posts a send and a receive: with
    max_ops=2 that message shares its group with nothing else of that rank; with max_ops=1 it is alone."""
    import numpy as np

    from jreshard.schedule.steps import STAGING, Schedule, Step, Wire
    from jreshard.sharding.topology import Link

    empty = np.zeros((0, 8), np.int64)

    def wire(peer, tag):
        return Wire(peer, tag, Link.FAST, 8, STAGING, 0)

    steps = {  # rank 1 sends rank 0 one message and itself one
        0: {0: Step(empty, empty, (), (wire(1, 3),))},
        1: {0: Step(empty, empty, (wire(0, 3), wire(1, 4)), (wire(1, 4),))},
    }
    sched = Schedule(rounds=1, steps=steps, copies={}, staging={0: 8, 1: 8}, ntensors=1)
    for max_ops in (1, 2):
        cut = group_rounds(sched, max_ops).group_of[0]
        load: collections.Counter = collections.Counter()
        for (src, dst, _), g in cut.items():
            load[(g, src)] += 1
            load[(g, dst)] += 1
        assert max(load.values()) <= max(max_ops, 2), (max_ops, cut)
        if max_ops <= 2:  # the self-message is alone in its group for rank 1
            assert load[(cut[(1, 1, 4)], 1)] == 2, (max_ops, cut)
