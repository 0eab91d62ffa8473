"""Megatron parallelism -> shardings: hand-built cases, JAX's NamedSharding as a cross-check, and
exact coverage of every parameter of the published configs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jreshard.errors import IndivisibleError
from jreshard.models import (
    MODELS,
    MegatronParallel,
    Param,
    ParamRole,
    megatron_placement,
    published_configs,
    system_config_from_dict,
    system_refit,
)
from jreshard.models.table import Model
from jreshard.sharding.box import Box

COL = Param(name="w", shape=(8, 16), role=ParamRole.COLUMN, layer=0)
ROW = Param(name="o", shape=(16, 8), role=ParamRole.ROW, layer=0)
EXP = Param(name="e", shape=(8, 4, 6), role=ParamRole.EXPERT_COLUMN, layer=0)
EXP_ROW = Param(name="d", shape=(8, 6, 4), role=ParamRole.EXPERT_ROW, layer=0)


def boxes(p: Param, side: MegatronParallel, first: int = 0, layers: int = 4) -> dict[int, Box]:
    lay = megatron_placement(p, side, layers, first).layout(p.shape, "float32")
    return {r: lay.box_of(r) for r in lay.ranks}


def test_tp_is_the_fastest_axis_and_cp_holds_replicas():
    side = MegatronParallel(num_gpus=8, tp=2, cp=2)  # dense DP 2
    b = boxes(COL, side)
    # tp varies fastest: ranks 0,1 hold the two column halves; cp (ranks +2) and dp (+4) replicate them.
    assert b[0] == Box((0, 0), (8, 8)) and b[1] == Box((0, 8), (8, 16))
    assert b[2] == b[4] == b[6] == b[0] and b[3] == b[5] == b[7] == b[1]
    assert boxes(ROW, side)[1] == Box((8, 0), (16, 8))  # row parallel splits the input dimension


def test_pp_stages_are_outermost_and_contiguous():
    side = MegatronParallel(num_gpus=8, tp=2, pp=4)
    stage_of = {
        i: sorted(boxes(Param(name="w", shape=(8, 16), role=ParamRole.COLUMN, layer=i), side)) for i in range(4)
    }
    assert stage_of == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}
    emb = Param(name="embed_tokens", shape=(10, 4), role=ParamRole.EMBEDDING)
    head = Param(name="lm_head", shape=(4, 10), role=ParamRole.HEAD)
    assert sorted(boxes(emb, side, first=100)) == [100, 101] and sorted(boxes(head, side, first=100)) == [106, 107]


def test_expert_mesh_folds_ep_over_the_stage():
    side = MegatronParallel(num_gpus=8, tp=2, ep=4)  # experts: EDP2 x EP4, ETP1
    b = boxes(EXP, side)
    assert [b[r].lo[0] for r in range(8)] == [0, 2, 4, 6, 0, 2, 4, 6]  # ep fastest after etp=1, edp replicates
    assert all(b[r].shape == (2, 4, 6) for r in range(8))
    etp = MegatronParallel(num_gpus=8, ep=2, etp=2)  # EDP2 x EP2 x ETP2: etp fastest
    b = boxes(EXP, etp)
    assert b[0] == Box((0, 0, 0), (4, 4, 3)) and b[1] == Box((0, 0, 3), (4, 4, 6)) and b[2].lo == (4, 0, 0)
    assert boxes(EXP_ROW, etp)[1] == Box((0, 3, 0), (4, 6, 4))  # expert row parallel: the input dimension


def test_fsdp_shards_the_other_dimension_inside_dp():
    side = MegatronParallel(num_gpus=8, tp=2, fsdp=2)  # dp=2 x fsdp=2 x tp=2
    b = boxes(COL, side)
    assert b[0] == Box((0, 0), (4, 8)) and b[1] == Box((0, 8), (4, 16)) and b[2] == Box((4, 0), (8, 8))
    assert b[4] == b[0]  # the outer dp axis replicates
    eb = boxes(EXP, side)  # experts: edp=4 / fsdp 2 -> (edp 2, efsdp 2, ep 1, etp 1)
    assert eb[0] == Box((0, 0, 0), (8, 2, 6)) and eb[1] == Box((0, 2, 0), (8, 4, 6)) and eb[2] == eb[0]


def test_heads_are_split_whole_or_replicated():
    kv = Param(name="k", shape=(16, 4 * 8), role=ParamRole.COLUMN, layer=0, unit=8)  # 4 heads of 8
    assert megatron_placement(kv, MegatronParallel(num_gpus=8, tp=8), 1, 0).spec == ((), ())
    assert megatron_placement(kv, MegatronParallel(num_gpus=8, tp=4), 1, 0).spec == ((), ("tp",))


def test_placement_agrees_with_jax_named_sharding():
    import jax

    from jreshard.sharding.layout import Layout

    devs = jax.devices()[:8]
    for side in (
        MegatronParallel(num_gpus=8, tp=2, cp=2),
        MegatronParallel(num_gpus=8, tp=2, pp=2, fsdp=2),
        MegatronParallel(num_gpus=8, ep=4, etp=2),
    ):
        for p in (COL, ROW, EXP, EXP_ROW):
            pl = megatron_placement(p, side, 4, 0)
            ours = pl.layout(p.shape, "float32")
            theirs = Layout.from_sharding(pl.named_sharding(devs), p.shape, np.float32)
            assert {r: ours.box_of(r) for r in ours.ranks} == {r: theirs.box_of(r) for r in theirs.ranks}


def test_bad_degrees_name_the_values():
    with pytest.raises(IndivisibleError, match="num_gpus=10 is not a multiple of pp=4"):
        MegatronParallel(num_gpus=10, pp=4)
    with pytest.raises(IndivisibleError, match=r"ep\*etp\*fsdp=3"):
        MegatronParallel(num_gpus=8, ep=3)
    with pytest.raises(ValueError, match="dp=3 matches neither"):
        MegatronParallel(num_gpus=8, tp=2, ep=2, dp=3)
    with pytest.raises(ValueError, match="tp=0"):
        MegatronParallel(num_gpus=8, tp=0)
    with pytest.raises(ValueError, match=r"train.ep_size='16' must be an int"):
        system_config_from_dict({"train": {"num_gpus": 8, "ep_size": "16"}, "generation": {"num_gpus": 8}})
    with pytest.raises(ValueError, match="unknown keys"):
        system_config_from_dict({"train": {"num_gpus": 8, "etp": 2}, "generation": {"num_gpus": 8}})


def _check_cover(lay, what: str) -> None:
    """Every element of the tensor in exactly one distinct box; every box held by the same number of ranks."""
    groups = lay.replica_groups()
    total = math.prod(lay.shape)
    assert sum(b.volume for b, _ in groups) == total, what
    lo = np.array([b.lo for b, _ in groups]).reshape(len(groups), -1)
    hi = np.array([b.hi for b, _ in groups]).reshape(len(groups), -1)
    if len(groups) > 1:  # pairwise disjoint: some dimension separates every pair
        overlap = np.all((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :]), axis=2)
        np.fill_diagonal(overlap, False)
        assert not overlap.any(), what
    assert len({len(rs) for _, rs in groups}) == 1, what  # one full copy per replica
    assert sum(len(rs) for _, rs in groups) == len(lay.ranks), what


@pytest.mark.parametrize("key", sorted(published_configs()))
def test_every_parameter_of_the_published_configs_is_covered_once_per_replica(key):
    cfg = published_configs()[key]
    model = MODELS[cfg.model].model()
    r = system_refit(model, cfg)
    n_train, n_gen = cfg.train.num_gpus, cfg.generation.num_gpus
    seen_src, seen_dst = set(), set()
    for (src, dst), name in zip(r.pairs, r.names, strict=True):
        _check_cover(src, f"{key} {name} trainer")
        _check_cover(dst, f"{key} {name} generator")
        assert all(0 <= x < n_train for x in src.ranks) and all(n_train <= x < n_train + n_gen for x in dst.ranks)
        assert len(src.ranks) == cfg.train.stage_size and len(dst.ranks) == cfg.generation.stage_size
        seen_src.update(src.ranks)
        seen_dst.update(dst.ranks)
    assert len(seen_src) == n_train and len(seen_dst) == n_gen  # every GPU of both sides holds weights


def test_the_two_deepseek_v3_trainers_differ_as_published():
    cfgs = published_configs()
    row, shipped = cfgs["m2n-dsv3-readme-row-gb200"].train, cfgs["m2n-dsv3-256gpus-gb200"].train
    assert (row.pp, row.ep, row.expert_dp, row.dense_dp) == (4, 16, 2, 32)
    assert (shipped.pp, shipped.ep, shipped.expert_dp, shipped.dense_dp) == (8, 16, 1, 16)
    qwen = cfgs["m2n-qwen235b-128gpus-gb200"]
    assert (qwen.train.tp, qwen.train.cp, qwen.train.dense_dp, qwen.generation.etp) == (2, 2, 4, 8)
    m = Model(
        name="x", layers=61, params=(Param(name="e", shape=(256, 16, 8), role=ParamRole.EXPERT_COLUMN, layer=30),)
    )
    src = system_refit(m, cfgs["m2n-dsv3-readme-row-gb200"]).pairs[0][0]
    assert src.ranks == tuple(range(32, 64))  # layer 30 of 61 on stage 1 of 4
    assert src.box_of(32) == src.box_of(48) and src.box_of(33).lo == (16, 0, 0)  # EP16 inside, EDP2 outside
