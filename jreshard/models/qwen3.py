"""Qwen3-235B-A22B: GQA attention with QK norms, 128 experts in every layer, no shared expert.

Shapes follow the public ``config.json`` of ``Qwen/Qwen3-235B-A22B``: 94 layers,
hidden 4096, 64 query heads and 4 KV heads of 128, 128 experts of intermediate
size 1536, vocabulary 151936, untied embeddings.
"""

from __future__ import annotations

from jreshard.models.table import Model, Parallelism, Param, ParamRole, gqa_attention

__all__ = ["qwen3_235b", "qwen3_235b_inference", "qwen3_235b_trainer"]


def qwen3_235b() -> Model:
    """Qwen3-235B-A22B.

    Example:
      >>> m = qwen3_235b()
      >>> round(m.n_params / 1e9), len(m.params)
      (235, 1131)
    """
    hidden, heads, kv, hd, experts, inter, vocab, layers = 4096, 64, 4, 128, 128, 1536, 151936, 94
    ps: list[Param] = [Param(name="embed_tokens", shape=(vocab, hidden), role=ParamRole.EMBEDDING)]
    for i in range(layers):
        m = f"layers.{i}.mlp"
        ps += gqa_attention(i, hidden, heads, kv, hd, qk_norm=True)
        ps += [
            Param(name=f"{m}.gate.weight", shape=(hidden, experts), layer=i),
            Param(name=f"{m}.experts.gate_proj", shape=(experts, hidden, inter), role=ParamRole.EXPERT_COLUMN, layer=i),
            Param(name=f"{m}.experts.up_proj", shape=(experts, hidden, inter), role=ParamRole.EXPERT_COLUMN, layer=i),
            Param(name=f"{m}.experts.down_proj", shape=(experts, inter, hidden), role=ParamRole.EXPERT_ROW, layer=i),
        ]
    ps += [Param(name="norm", shape=(hidden,)), Param(name="lm_head", shape=(hidden, vocab), role=ParamRole.HEAD)]
    return Model(name="Qwen3-235B-A22B", layers=layers, params=tuple(ps))


def qwen3_235b_trainer(n_gpus: int) -> Parallelism:
    """Megatron style with MoE parallel folding: PP4 stage sub-meshes of (dp, tp=4); attention TP4;
    experts EP over the whole stage (dp x tp)."""
    stage = n_gpus // 4
    return Parallelism(
        name=f"PP4 x DP{stage // 4} x TP4, EP{stage} (Megatron)",
        mesh=(("dp", stage // 4), ("tp", 4)),
        pp=4,
        ep=("dp", "tp"),
    )


def qwen3_235b_inference(n_gpus: int) -> Parallelism:
    """TP8 x DP(n/8), experts EP8 over the TP group (KV heads replicated: 4 < 8)."""
    return Parallelism(name=f"TP8 x DP{n_gpus // 8}, EP8", mesh=(("dp", n_gpus // 8), ("tp", 8)), ep=("tp",))
