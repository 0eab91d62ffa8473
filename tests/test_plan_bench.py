"""benchmarks/plan_bench.py (plan_bench_local.py): the peers' mail answered from their rank plans equals what the whole
plan's messages say (each peer's sorted distinct receivers and senders)."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from jreshard.models import refit, refit_topology
from jreshard.sharding.layout import Layout
from jreshard.sharding.planner import plan_layouts
from jreshard.sharding.topology import Topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plan_bench
import plan_bench_local


def _whole_plan_mail(plan) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Each rank's sorted distinct receivers and senders, from the whole plan's message keys."""
    outs: dict[int, list[int]] = {}
    ins: dict[int, list[int]] = {}
    for src, dst in sorted({(int(a), int(b)) for a, b in plan.message_keys()[:, 1:3]}):
        outs.setdefault(src, []).append(dst)
        ins.setdefault(dst, []).append(src)
    return outs, ins


def _same_bytes(plan, sent, received, peers) -> None:
    """The bytes each peer sends and receives in all, as the whole plan's messages of that peer carry."""
    for p in peers:
        rp = plan.rank_plan(p)
        assert sent[p] == sum(m.nbytes for m in rp.sends) and received[p] == sum(m.nbytes for m in rp.recvs), p


@pytest.mark.parametrize(
    ("model", "n", "domain"),
    [("llama3-70b", 16, 8), ("qwen3-235b", 32, 8), ("deepseek-v3", 128, plan_bench.DOMAIN)],
)
def test_peer_mail_equals_the_whole_plan(model, n, domain):
    r = refit(model, n, n)
    topo = refit_topology(n, n, domain, network_bw=plan_bench.NIC, fast_bw=plan_bench.NVLINK)
    plan = plan_layouts(r.pairs, topo, names=r.names)
    outs, ins = _whole_plan_mail(plan)
    forwards = set(outs) & set(ins)  # ranks that receive and send: the relays
    ranks = [n + n // 2 + 3, n // 2 + 3, 0, 2 * n - 1, *sorted(forwards)[:2]]
    for rank in ranks:
        peers = sorted(set(outs.get(rank, [])) | set(ins.get(rank, [])))
        got_outs, got_ins, sent, received = plan_bench_local.peer_mail(r, topo, rank)
        assert sorted(got_outs) == sorted(got_ins) == sorted(sent) == sorted(received) == peers, rank
        assert got_outs == {p: outs.get(p, []) for p in peers}, rank
        assert got_ins == {p: ins.get(p, []) for p in peers}, rank
        _same_bytes(plan, sent, received, peers[:: max(1, len(peers) // 8)])
    # The answers are not trivial: some peer of the benchmark's rank talks to several ranks.
    got_outs, got_ins, _, _ = plan_bench_local.peer_mail(r, topo, n + n // 2 + 3)
    assert max(len(v) for v in (*got_outs.values(), *got_ins.values())) > 1


def test_peer_mail_skips_local_landings():
    """Source and destination on the same ranks: a rank's same-device landings are no messages."""
    shape = (64, 48)
    src = Layout.from_mesh(np.arange(8), ("fsdp",), ("fsdp",), shape, "float32")
    dst = Layout.from_mesh(np.arange(8).reshape(2, 4), ("dp", "tp"), (None, "tp"), shape, "float32")
    r = types.SimpleNamespace(pairs=((src, dst), (dst, src)), names=("a", "b"))
    topo = Topology.uniform(range(8), 4, network_bw=plan_bench.NIC, fast_bw=plan_bench.NVLINK)
    plan = plan_layouts(r.pairs, topo, names=r.names)
    assert any(int(p.table.cuts[0]) for p in (plan.rank_plan(k) for k in range(8)))  # there are same-device landings
    outs, ins = _whole_plan_mail(plan)
    for rank in range(8):
        peers = sorted(set(outs.get(rank, [])) | set(ins.get(rank, [])))
        got_outs, got_ins, sent, received = plan_bench_local.peer_mail(r, topo, rank)
        assert got_outs == {p: outs.get(p, []) for p in peers}, rank
        assert got_ins == {p: ins.get(p, []) for p in peers}, rank
        _same_bytes(plan, sent, received, peers)


def test_engine_bench_runs_every_round_of_the_schedule(capsys):
    """benchmarks/engine_bench.py at a small scale: the null transport sees every round of the rank's
    schedule as one exchange and every chunk the schedule names, and the printout says so."""
    import engine_bench

    sched, _, _, _ = engine_bench.schedule_of("llama3-70b", 16, 16 + 8 + 3)
    steps = sched.steps[16 + 8 + 3]
    want_ops = sum(len(steps[k].sends) + len(steps[k].recvs) for k in range(sched.rounds) if k in steps)
    engine_bench.main(["--model", "llama3-70b", "--ranks", "16", "--repeat", "1", "--launches", "2"])
    out = capsys.readouterr().out
    assert f"operations {want_ops}," in out and "us per round" in out and "predicted refit" in out
    assert "host us per round in each of 2 launches" in out and out.rstrip().splitlines()[-1].startswith("engine host:")
    floor = re.search(r"MPI's own floor .* us per round in each of 2 launches: ([\d.]+), ([\d.]+); median", out)
    assert floor and all(float(x) > 0 for x in floor.groups()), out[-2000:]  # mpi_floor.c built and run twice
    if importlib.util.find_spec("nixl_cu12") is not None:  # the NIXL columns, run as RefitGroup runs NIXL
        assert "NIXL prepared: " in out and "box MACs " in out and "NIXL prepared, tags: " in out, out[-2000:]


def test_shard_read_bench_times_jax_as_shipped_and_restores_it(capsys):
    """benchmarks/shard_read_bench.py at a small scale: it prints its three rows and puts jax's function back."""
    import shard_read_bench
    from jax._src import sharding_impls

    before = sharding_impls.make_single_device_sharding
    shard_read_bench.main(["--leaves", "8", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "8 leaves, 32 shards" in out and "faster with shared shardings" in out, out
    assert sharding_impls.make_single_device_sharding is before
