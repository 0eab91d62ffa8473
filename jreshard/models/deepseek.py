"""DeepSeek-V3 and Kimi-K2: MLA attention and a DeepSeek-MoE feed-forward.

Shapes follow the public Hugging Face configurations (``config.json`` of
``deepseek-ai/DeepSeek-V3`` and ``moonshotai/Kimi-K2-Instruct``). The
multi-token-prediction layer of DeepSeek-V3 is not part of the refit (RL
trainers do not train it) and is left out. Matrices are ``[in, out]``; the
routed experts of a layer are stacked into one ``[experts, in, out]`` tensor.
"""

from __future__ import annotations

from jreshard.models.table import Model, Parallelism, Param, ParamRole

__all__ = [
    "deepseek_v3",
    "deepseek_v3_inference",
    "deepseek_v3_trainer",
    "kimi_k2",
    "kimi_k2_inference",
    "kimi_k2_trainer",
    "mla_moe",
]


def mla_moe(
    name: str,
    *,
    layers: int,
    dense_layers: int,
    hidden: int,
    vocab: int,
    heads: int,
    q_lora: int,
    kv_lora: int,
    qk_nope: int,
    qk_rope: int,
    v_head: int,
    dense_inter: int,
    experts: int,
    moe_inter: int,
    shared_experts: int,
) -> Model:
    """The parameter table of a DeepSeek-V3-style model (MLA + DeepSeek-MoE).

    Example:
      >>> m = mla_moe("tiny", layers=2, dense_layers=1, hidden=8, vocab=16, heads=2, q_lora=4, kv_lora=4,
      ...             qk_nope=2, qk_rope=2, v_head=2, dense_inter=16, experts=4, moe_inter=4, shared_experts=1)
      >>> [p.name for p in m.params if p.role == ParamRole.EXPERT_ROW]
      ['layers.1.mlp.experts.down_proj']
    """
    ps: list[Param] = [Param(name="embed_tokens", shape=(vocab, hidden), role=ParamRole.EMBEDDING)]
    for i in range(layers):
        a = f"layers.{i}.self_attn"
        ps += [
            Param(name=f"layers.{i}.input_layernorm", shape=(hidden,), layer=i),
            # The low-rank down-projections are small and replicated by inference engines.
            Param(name=f"{a}.q_a_proj", shape=(hidden, q_lora), layer=i),
            Param(name=f"{a}.q_a_layernorm", shape=(q_lora,), layer=i),
            Param(
                name=f"{a}.q_b_proj",
                shape=(q_lora, heads * (qk_nope + qk_rope)),
                role=ParamRole.COLUMN,
                layer=i,
                unit=qk_nope + qk_rope,
            ),
            Param(name=f"{a}.kv_a_proj_with_mqa", shape=(hidden, kv_lora + qk_rope), layer=i),
            Param(name=f"{a}.kv_a_layernorm", shape=(kv_lora,), layer=i),
            Param(
                name=f"{a}.kv_b_proj",
                shape=(kv_lora, heads * (qk_nope + v_head)),
                role=ParamRole.COLUMN,
                layer=i,
                unit=qk_nope + v_head,
            ),
            Param(name=f"{a}.o_proj", shape=(heads * v_head, hidden), role=ParamRole.ROW, layer=i, unit=v_head),
            Param(name=f"layers.{i}.post_attention_layernorm", shape=(hidden,), layer=i),
        ]
        m = f"layers.{i}.mlp"
        if i < dense_layers:
            ps += [
                Param(name=f"{m}.gate_proj", shape=(hidden, dense_inter), role=ParamRole.COLUMN, layer=i),
                Param(name=f"{m}.up_proj", shape=(hidden, dense_inter), role=ParamRole.COLUMN, layer=i),
                Param(name=f"{m}.down_proj", shape=(dense_inter, hidden), role=ParamRole.ROW, layer=i),
            ]
            continue
        shared = shared_experts * moe_inter
        ps += [
            Param(name=f"{m}.gate.weight", shape=(hidden, experts), layer=i),
            Param(name=f"{m}.gate.e_score_correction_bias", shape=(experts,), dtype="float32", layer=i),
            Param(
                name=f"{m}.experts.gate_proj", shape=(experts, hidden, moe_inter), role=ParamRole.EXPERT_COLUMN, layer=i
            ),
            Param(
                name=f"{m}.experts.up_proj", shape=(experts, hidden, moe_inter), role=ParamRole.EXPERT_COLUMN, layer=i
            ),
            Param(
                name=f"{m}.experts.down_proj", shape=(experts, moe_inter, hidden), role=ParamRole.EXPERT_ROW, layer=i
            ),
            Param(name=f"{m}.shared_experts.gate_proj", shape=(hidden, shared), role=ParamRole.COLUMN, layer=i),
            Param(name=f"{m}.shared_experts.up_proj", shape=(hidden, shared), role=ParamRole.COLUMN, layer=i),
            Param(name=f"{m}.shared_experts.down_proj", shape=(shared, hidden), role=ParamRole.ROW, layer=i),
        ]
    ps += [Param(name="norm", shape=(hidden,)), Param(name="lm_head", shape=(hidden, vocab), role=ParamRole.HEAD)]
    return Model(name=name, layers=layers, params=tuple(ps))


def deepseek_v3() -> Model:
    """DeepSeek-V3 (671B): 61 layers, the first 3 dense; 256 routed experts + 1 shared.

    Example:
      >>> m = deepseek_v3()
      >>> round(m.n_params / 1e9), len(m.params)
      (671, 1025)
    """
    return mla_moe(
        "DeepSeek-V3",
        layers=61,
        dense_layers=3,
        hidden=7168,
        vocab=129280,
        heads=128,
        q_lora=1536,
        kv_lora=512,
        qk_nope=128,
        qk_rope=64,
        v_head=128,
        dense_inter=18432,
        experts=256,
        moe_inter=2048,
        shared_experts=1,
    )


def kimi_k2() -> Model:
    """Kimi-K2 (1T): the DeepSeek-V3 architecture with 384 experts, 64 heads, 1 dense layer.

    Example:
      >>> round(kimi_k2().n_params / 1e9)
      1026
    """
    return mla_moe(
        "Kimi-K2",
        layers=61,
        dense_layers=1,
        hidden=7168,
        vocab=163840,
        heads=64,
        q_lora=1536,
        kv_lora=512,
        qk_nope=128,
        qk_rope=64,
        v_head=128,
        dense_inter=18432,
        experts=384,
        moe_inter=2048,
        shared_experts=1,
    )


def deepseek_v3_trainer(n_gpus: int) -> Parallelism:
    """Megatron style: PP8 (PP16 above 128 GPUs) stage sub-meshes, EP over each stage, TP1; the dense
    parameters are data parallel (replicated) inside a stage. 128 GPUs: TP1/PP8/EP16."""
    pp = 8 if n_gpus <= 128 else 16
    stage = n_gpus // pp
    return Parallelism(name=f"PP{pp} x EP{stage} x TP1 (Megatron)", mesh=(("ep", stage),), pp=pp, tp=None, ep=("ep",))


def deepseek_v3_inference(n_gpus: int) -> Parallelism:
    """TP16 x DP(n/16); experts tensor-parallel on their intermediate dimension."""
    return Parallelism(name=f"TP16 x DP{n_gpus // 16}", mesh=(("dp", n_gpus // 16), ("tp", 16)), expert_tp=True)


def kimi_k2_trainer(n_gpus: int) -> Parallelism:
    """Megatron style (Moonshot trains Kimi-K2 with a Megatron-based pipeline): PP8 (PP16 above 128
    GPUs) stage sub-meshes, EP over each stage, TP1, dense parameters data parallel inside a stage."""
    pp = 8 if n_gpus <= 128 else 16
    stage = n_gpus // pp
    return Parallelism(name=f"PP{pp} x EP{stage} x TP1 (Megatron)", mesh=(("ep", stage),), pp=pp, tp=None, ep=("ep",))


def kimi_k2_inference(n_gpus: int) -> Parallelism:
    """Attention TP8 x DP; experts EP64 over each group of 64 GPUs, replicated across groups."""
    groups = n_gpus // 64
    return Parallelism(
        name=f"TP8 x DP{n_gpus // 8}, EP64 x {groups}", mesh=(("rep", groups), ("dp", 8), ("tp", 8)), ep=("dp", "tp")
    )
