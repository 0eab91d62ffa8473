"""Fused refit recipes: every byte of Llama-3-70B and DeepSeek-V3 planned shard to shard, network bytes at the
lower bound in the wire dtype, beside the hybrid baseline (FFN resharded, the rest broadcast)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jreshard.cli import main
from jreshard.models import refit_topology
from jreshard.models.fused import fused_stats, fused_views
from jreshard.views.bounds import evaluate


def _row(out: str, label: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(label))
    return re.findall(r"[\d.]+ [TG]B|[\d.]+%|-", line[len(label) :])


def test_llama3_70b_plan_fused(capsys):
    assert main(["plan", "--model", "llama3-70b", "--fused"]) == 0
    out = capsys.readouterr().out
    fused, hybrid = _row(out, "jreshard fused views"), _row(out, "hybrid (FFN reshard + broadcast)")
    assert fused[0] == fused[1] and fused[-1] == "100%"  # network == lower bound; every byte shard to shard
    assert hybrid[-1] == "79.9%"
    s = fused_stats("llama3-70b", 128, 128, refit_topology(128, 128, 72))
    assert s.network_bytes == s.network_bound < s.hybrid_network_bytes
    assert s.max_nic_recv < s.hybrid_max_nic_recv


def test_llama3_70b_simulate_fused(capsys):
    assert main(["simulate", "--model", "llama3-70b", "--fused", "--train-gpus", "16", "--infer-gpus", "16"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"predicted: fused views [\d.]+ ms .* hybrid [\d.]+ ms", out)


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
