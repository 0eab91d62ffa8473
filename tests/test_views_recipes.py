"""Fused refit recipes: every byte of Llama-3-70B and DeepSeek-V3 planned shard to shard, network bytes at the
lower bound in the wire dtype, beside the hybrid baseline (FFN resharded, the rest broadcast)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jreshard.cli import main
from jreshard.models import fused, refit_topology
from jreshard.models.fused import fused_stats, fused_views
from jreshard.sharding.topology import Topology
from jreshard.views.bounds import evaluate


def _row(out: str, label: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(label))
    return re.findall(r"[\d.]+ [TG]B|[\d.]+%|-", line[len(label) :])


def _printed_stats(monkeypatch) -> list:
    """The stats the CLI prints, as :func:`fused_stats` returned them (checked exactly, not as rounded on screen)."""
    seen: list = []

    def spy(*args, **kwargs):
        seen.append((args, fused_stats(*args, **kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(fused, "fused_stats", spy)
    return seen


def test_llama3_70b_plan_fused(capsys, monkeypatch):
    seen = _printed_stats(monkeypatch)
    assert main(["plan", "--model", "llama3-70b", "--fused"]) == 0
    out = capsys.readouterr().out
    fused_row, hybrid = _row(out, "jreshard fused views"), _row(out, "hybrid (FFN reshard + broadcast)")
    assert fused_row[0] == fused_row[1] and fused_row[-1] == "100%"  # network == lower bound; every byte shard to shard
    assert hybrid[-1] == "79.9%"
    ((args, s),) = seen
    assert args[:3] == ("llama3-70b", 128, 128) and args[3].domains == refit_topology(128, 128, 72).domains
    assert s.network_bytes == s.network_bound < s.hybrid_network_bytes
    assert s.max_nic_recv < s.hybrid_max_nic_recv


def test_llama3_70b_simulate_fused(capsys):
    assert main(["simulate", "--model", "llama3-70b", "--fused", "--train-gpus", "16", "--infer-gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"predicted: fused views [\d.]+ ms .* hybrid [\d.]+ ms", out)


@pytest.mark.parametrize("domain", [8, 12])
def test_leaves_equal_up_to_renumbering_ranks_share_one_lowering_and_change_no_number(monkeypatch, domain):
    # Qwen3-235B on 32 + 32: PP4 stages of 8 ranks. Lowered one leaf at a time for its own ranks, or once per
    # class of leaves equal up to renumbering: the same stats, to the byte and per rank (the busiest NICs).
    # Domains of 8: each stage a domain of its own. Domains of 12 over all 64 ranks: some stages across two
    # domains, and one domain holding trainer ranks 24-31 and inference ranks 32-35 (their bytes go over
    # the fast links, so that stage must not share the other stages' lowering).
    topo = refit_topology(32, 32, 8) if domain == 8 else Topology.from_domains({r: r // 12 for r in range(64)})
    calls: list[int] = []
    real = fused.lower
    monkeypatch.setattr(fused, "lower", lambda *a, **k: calls.append(1) or real(*a, **k))
    own = fused_stats("qwen3-235b", 32, 32, topo, _relabel=False)
    each = len(calls)
    shared = fused_stats("qwen3-235b", 32, 32, topo)
    assert shared == own
    assert len(calls) - each < each  # leaves of different stages shared a lowering


@pytest.mark.slow
def test_deepseek_v3_plan_fused(capsys):
    assert main(["plan", "--model", "deepseek-v3", "--fused"]) == 0
    out = capsys.readouterr().out
    fused, hybrid = _row(out, "jreshard fused views"), _row(out, "hybrid (FFN reshard + broadcast)")
    assert fused[0] == fused[1] and fused[-1] == "100%"
    assert "29696 of 29696 destination shards quantised at the sender" in out
    assert float(hybrid[0].split()[0]) > 4 * float(fused[0].split()[0])


def test_qwen3_qkv_repeats_each_kv_head_for_its_tp_ranks():
    # Qwen3-235B: 64 query heads, 4 KV heads of 128, TP8: TP rank i holds q heads 8i..8i+7 and KV head i // 2.
    items, _ = fused_views("qwen3-235b", 32, 32)
    _, view, dst = next(x for x in items if x[0] == "layers.0.self_attn.qkv_proj")
    assert view.shape == (4096, (64 + 2 * 8) * 128) and view.dtype == "bfloat16"
    leaves = view.leaves()
    assert [leaf.source.name for leaf in leaves] == [f"layers.0.self_attn.{p}_proj" for p in "qkv"]
    heads = {id(leaf.source): np.arange(leaf.shape[1] // 128) for leaf in leaves}
    tag = {id(leaf.source): 1000 * i for i, leaf in enumerate(leaves)}

    def row(leaf):  # one row of head ids per column: q head h -> h, k head h -> 1000 + h, v head h -> 2000 + h
        return (tag[id(leaf.source)] + np.repeat(heads[id(leaf.source)], 128))[None, :]

    from jreshard.views.algebra import Index

    got = evaluate(Index(view, (slice(0, 1),)), row, lambda x, d: x)[0].reshape(8, -1)[:, ::128]
    for i in range(8):
        assert got[i].tolist() == [*range(8 * i, 8 * i + 8), 1000 + i // 2, 2000 + i // 2]
    assert dst.box_of(dst.ranks[1]).shape == (4096, 10 * 128)
