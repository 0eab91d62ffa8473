"""Model tables against their public configurations, and the layouts the recipes give them."""

from __future__ import annotations

import math

import pytest

from jreshard.errors import IndivisibleError, LayoutError, TopologyError
from jreshard.models import MODELS, Parallelism, Param, ParamRole, deepseek_v3, kimi_k2, refit, refit_topology
from jreshard.models.llama3 import llama3_70b
from jreshard.models.qwen3 import qwen3_235b
from jreshard.sharding.box import Box
from jreshard.sharding.planner import plan_layouts


@pytest.mark.parametrize(
    ("build", "billions", "tensors"),
    [(deepseek_v3, 671, 1025), (kimi_k2, 1026, 1035), (qwen3_235b, 235, 1131), (llama3_70b, 71, 723)],
)
def test_parameter_counts_match_the_published_sizes(build, billions, tensors):
    m = build()
    assert round(m.n_params / 1e9) == billions
    assert len(m.params) == tensors  # experts stacked per layer: hundreds to a few thousand tensors
    assert len({p.name for p in m.params}) == tensors


def test_deepseek_v3_shapes_follow_its_config():
    shapes = {p.name: p.shape for p in deepseek_v3().params}
    assert shapes["embed_tokens"] == (129280, 7168)
    assert shapes["lm_head"] == (7168, 129280)
    a = "layers.10.self_attn"
    assert shapes[f"{a}.q_a_proj"] == (7168, 1536)
    assert shapes[f"{a}.q_b_proj"] == (1536, 128 * (128 + 64))
    assert shapes[f"{a}.kv_a_proj_with_mqa"] == (7168, 512 + 64)
    assert shapes[f"{a}.kv_b_proj"] == (512, 128 * (128 + 128))
    assert shapes[f"{a}.o_proj"] == (128 * 128, 7168)
    assert shapes["layers.2.mlp.gate_proj"] == (7168, 18432)  # the first 3 layers are dense
    assert "layers.3.mlp.gate_proj" not in shapes
    assert shapes["layers.3.mlp.experts.gate_proj"] == (256, 7168, 2048)
    assert shapes["layers.60.mlp.experts.down_proj"] == (256, 2048, 7168)
    assert shapes["layers.3.mlp.shared_experts.down_proj"] == (2048, 7168)


@pytest.mark.parametrize(("name", "n_train", "n_infer"), [(k, 128, 128) for k in sorted(MODELS)])
def test_every_layout_covers_its_tensor_on_its_own_side(name, n_train, n_infer):
    r = refit(name, n_train, n_infer)
    for (src, dst), pname in zip(r.pairs, r.names, strict=True):
        assert src.shape == dst.shape and src.dtype == dst.dtype
        assert all(0 <= x < n_train for x in src.ranks), pname
        assert all(n_train <= x < n_train + n_infer for x in dst.ranks), pname
        for lay in (src, dst):
            # Distinct boxes of a NamedSharding-style layout tile the tensor exactly.
            assert sum(b.volume for b, _ in lay.replica_groups()) == math.prod(lay.shape), pname
    assert len(set().union(*(d.ranks for _, d in r.pairs))) == n_infer  # every inference GPU gets weights


def test_deepseek_v3_trainer_pipeline_and_expert_parallel():
    r = refit("deepseek-v3", 128, 128)
    lay = dict(zip(r.names, r.pairs, strict=True))
    src, dst = lay["layers.3.mlp.experts.gate_proj"]
    assert src.ranks == tuple(range(16))  # layer 3 is on pipeline stage 0 (ranks 0-15)
    assert src.box_of(5) == Box((80, 0, 0), (96, 7168, 2048))  # EP16: 16 experts per rank
    assert lay["layers.60.mlp.experts.gate_proj"][0].ranks == tuple(range(112, 128))  # last stage
    assert lay["embed_tokens"][0].ranks == tuple(range(16))
    assert lay["lm_head"][0].ranks == tuple(range(112, 128))
    # Inference TP16 x DP8: experts split on their intermediate dimension, replicated over DP.
    assert dst.box_of(128 + 17) == Box((0, 0, 128), (256, 7168, 256))
    assert len(dst.replica_groups()) == 16
    o_src, o_dst = lay["layers.0.self_attn.o_proj"]
    assert len(o_src.replica_groups()) == 1  # dense weights are data parallel in a stage
    assert o_dst.box_of(129) == Box((1024, 0), (2048, 7168))  # row parallel: 8 heads of 128 per rank


def test_kv_projections_are_replicated_when_tp_exceeds_kv_heads():
    r = refit("qwen3-235b", 128, 128)
    lay = dict(zip(r.names, r.pairs, strict=True))
    k_src, k_dst = lay["layers.0.self_attn.k_proj"]
    assert len(k_dst.replica_groups()) == 1  # 4 KV heads cannot be split 8 ways: replicated
    assert len(k_src.replica_groups()) == 4  # the trainer's TP4 holds one KV head per rank
    q_dst = lay["layers.0.self_attn.q_proj"][1]
    assert len(q_dst.replica_groups()) == 8


def test_fsdp_shards_the_other_dimension():
    r = refit("llama3-70b", 128, 128)
    lay = dict(zip(r.names, r.pairs, strict=True))
    down = lay["layers.0.mlp.down_proj"][0]  # row parallel [28672, 8192]: no tp, fsdp on dim 1
    groups = down.replica_groups()
    assert len(groups) == 8 and all(len(rs) == 16 for _, rs in groups)  # DP16 replicas of FSDP8 shards
    assert {b.shape for b, _ in groups} == {(28672, 8192 // 8)}
    up = lay["layers.0.mlp.up_proj"][0]  # column parallel [8192, 28672]: fsdp on dim 0
    assert {b.shape for b, _ in up.replica_groups()} == {(8192 // 8, 28672)}


def test_spec_drops_axes_that_do_not_divide():
    side = Parallelism(name="t", mesh=(("dp", 3), ("tp", 4)), fsdp=("dp",))
    p = Param(name="w", shape=(10, 12), role=ParamRole.COLUMN, layer=0, unit=6)
    # dim 0 (10) is not divisible by dp=3; dim 1 has 2 units of 6, not divisible by tp=4.
    assert side.spec(p) == ((), ())
    assert side.spec(Param(name="v", shape=(9, 24), role=ParamRole.COLUMN, layer=0, unit=6)) == (("dp",), ("tp",))


def test_bad_recipes_and_arguments_raise():
    with pytest.raises(ValueError, match="choose one of"):
        refit("gpt-5", 128, 128)
    with pytest.raises(IndivisibleError, match="n_train=100"):
        refit("deepseek-v3", 100, 128)
    with pytest.raises(LayoutError, match="not mesh axes"):
        Parallelism(name="bad", mesh=(("dp", 2),), tp="tp")
    with pytest.raises(TopologyError, match="domain_size=0"):
        refit_topology(4, 4, domain_size=0)


def test_each_side_starts_a_domain_of_its_own():
    t = refit_topology(100, 64, domain_size=64)
    assert [t.domain_of(r) for r in (0, 63, 64, 99, 100, 163)] == [0, 0, 1, 1, 2, 2]


def test_a_model_refit_moves_exactly_the_lower_bound():
    r = refit("llama3-70b", 64, 64)
    p = plan_layouts(r.pairs, refit_topology(64, 64, 8), names=r.names)
    s = p.stats()
    assert s.network_bytes == s.network_bytes_lower_bound
    # TP8 x DP8 inference in 8-GPU domains: every domain needs the whole model once.
    assert s.network_bytes == 8 * r.model.nbytes


DSV3_HF = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "vocab_size": 129280,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "n_routed_experts": 256,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "tie_word_embeddings": False,
}
QWEN3_MOE_HF = {
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "vocab_size": 151936,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 12288,
    "num_experts": 128,
    "moe_intermediate_size": 1536,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}
LLAMA_HF = {
    "model_type": "llama",
    "hidden_size": 8192,
    "vocab_size": 128256,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(("cfg", "build"), [(DSV3_HF, deepseek_v3), (QWEN3_MOE_HF, qwen3_235b), (LLAMA_HF, llama3_70b)])
def test_hf_config_gives_the_built_in_tables(tmp_path, cfg, build):
    import json

    from jreshard.models import read_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert read_hf_config(path).params == build().params


def test_hf_config_dense_qwen3_tied_and_sparse_steps():
    from jreshard.models import model_from_hf_config

    dense = {k: v for k, v in QWEN3_MOE_HF.items() if k not in ("num_experts", "decoder_sparse_step")}
    m = model_from_hf_config({**dense, "model_type": "qwen3", "tie_word_embeddings": True, "num_hidden_layers": 2})
    names = [p.name for p in m.params]
    assert "lm_head" not in names and "layers.1.self_attn.k_norm" in names and "layers.0.mlp.down_proj" in names
    moe = model_from_hf_config(
        {**QWEN3_MOE_HF, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    kinds = [
        "experts" if f"layers.{i}.mlp.experts.up_proj" in {p.name for p in moe.params} else "dense" for i in range(4)
    ]
    assert kinds == ["dense", "experts", "dense", "dense"]  # every 2nd layer sparse, except layer 3


def test_hf_config_errors_name_the_field(tmp_path):
    from jreshard.models import model_from_hf_config, read_hf_config

    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        model_from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="needs the key 'q_lora_rank'"):
        model_from_hf_config({k: v for k, v in DSV3_HF.items() if k != "q_lora_rank"})
    with pytest.raises(ValueError, match="hidden_size=-1"):
        model_from_hf_config({**LLAMA_HF, "hidden_size": -1})
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        read_hf_config(bad)
