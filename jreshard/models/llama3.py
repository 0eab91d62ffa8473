"""Llama-3-70B: a dense GQA transformer.

Shapes follow the public ``config.json`` of ``meta-llama/Meta-Llama-3-70B``: 80
layers, hidden 8192, 64 query heads and 8 KV heads of 128, intermediate 28672,
vocabulary 128256, untied embeddings.
"""

from __future__ import annotations

from jreshard.models.table import Model, Parallelism, Param, ParamRole, gqa_attention

__all__ = ["llama3_70b", "llama3_70b_inference", "llama3_70b_trainer"]


def llama3_70b() -> Model:
    """Llama-3-70B.

    Example:
      >>> m = llama3_70b()
      >>> round(m.n_params / 1e9), len(m.params)
      (71, 723)
    """
    hidden, heads, kv, hd, inter, vocab, layers = 8192, 64, 8, 128, 28672, 128256, 80
    ps: list[Param] = [Param(name="embed_tokens", shape=(vocab, hidden), role=ParamRole.EMBEDDING)]
    for i in range(layers):
        m = f"layers.{i}.mlp"
        ps += gqa_attention(i, hidden, heads, kv, hd)
        ps += [
            Param(name=f"{m}.gate_proj", shape=(hidden, inter), role=ParamRole.COLUMN, layer=i),
            Param(name=f"{m}.up_proj", shape=(hidden, inter), role=ParamRole.COLUMN, layer=i),
            Param(name=f"{m}.down_proj", shape=(inter, hidden), role=ParamRole.ROW, layer=i),
        ]
    ps += [Param(name="norm", shape=(hidden,)), Param(name="lm_head", shape=(hidden, vocab), role=ParamRole.HEAD)]
    return Model(name="Llama-3-70B", layers=layers, params=tuple(ps))


def llama3_70b_trainer(n_gpus: int) -> Parallelism:
    """JAX style (MaxText on GPUs), hybrid-sharded: mesh (dp, fsdp=8); FSDP over the 8 GPUs of a node,
    data parallel (replicated) across nodes; no tensor parallelism."""
    return Parallelism(
        name=f"DP{n_gpus // 8} x FSDP8 (JAX)", mesh=(("dp", n_gpus // 8), ("fsdp", 8)), tp=None, fsdp=("fsdp",)
    )


def llama3_70b_inference(n_gpus: int) -> Parallelism:
    """TP8 x DP(n/8)."""
    return Parallelism(name=f"TP8 x DP{n_gpus // 8}", mesh=(("dp", n_gpus // 8), ("tp", 8)))
