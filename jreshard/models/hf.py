"""A model's parameter table from a Hugging Face ``config.json`` (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3).

The parameter names, shapes and roles are those of the built-in tables
(:mod:`jreshard.models.llama3`, :mod:`jreshard.models.qwen3`,
:mod:`jreshard.models.deepseek`): matrices ``[in, out]``, a layer's routed
experts stacked into one ``[experts, in, out]`` tensor, bfloat16 weights. The
architecture is read from ``model_type`` (``llama``, ``qwen3``, ``qwen3_moe``,
``deepseek_v3``, and ``kimi_k2``, which is DeepSeek-V3's architecture).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from jreshard.models.deepseek import mla_moe
from jreshard.models.table import Model, Param, ParamRole, gqa_attention
from jreshard.types import Json

__all__ = ["model_from_hf_config", "read_hf_config"]

_KINDS = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2")


def read_hf_config(path: str | os.PathLike[str]) -> Model:
    """The parameter table of the model a ``config.json`` file describes.

    Raises:
      ValueError: the file is not JSON, or not one of the supported architectures
        (the message names the file and what is missing).
    """
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"read_hf_config: {os.fspath(path)!r} is not JSON: {err}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"read_hf_config: {os.fspath(path)!r} holds a {type(cfg).__name__}, not a JSON object")
    name = cfg.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path))) or "model"
    return model_from_hf_config(cfg, name=str(name), where=os.fspath(path))


def _get(cfg: Mapping[str, Any], key: str, where: str, default: Json = None) -> Json:
    v = cfg.get(key, default)
    if v is None:
        raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} needs the key {key!r}, which is missing")
    return v


def _int(cfg: Mapping[str, Any], key: str, where: str, default: Json = None) -> int:
    v = _get(cfg, key, where, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{where}: {key}={v!r} must be a non-negative int")
    return v


def model_from_hf_config(cfg: Mapping[str, Any], *, name: str = "model", where: str = "config") -> Model:
    """The parameter table from a parsed ``config.json`` (see :func:`read_hf_config`).

    Example:
      >>> cfg = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
      ...        "head_dim": 16, "intermediate_size": 128, "vocab_size": 100, "num_hidden_layers": 2,
      ...        "tie_word_embeddings": True}
      >>> m = model_from_hf_config(cfg, name="tiny")
      >>> len(m.params), m.params[-1].name, m.n_params
      (24, 'norm', 80512)
    """
    kind = cfg.get("model_type")
    if kind not in _KINDS:
        raise ValueError(f"{where}: model_type={kind!r} is not supported; supported: {list(_KINDS)}")
    g = lambda k, d=None: _int(cfg, k, where, d)  # noqa: E731
    hidden, vocab, layers = g("hidden_size"), g("vocab_size"), g("num_hidden_layers")
    if kind in ("deepseek_v3", "kimi_k2"):
        m = mla_moe(
            name,
            layers=layers,
            dense_layers=g("first_k_dense_replace", 0),
            hidden=hidden,
            vocab=vocab,
            heads=g("num_attention_heads"),
            q_lora=g("q_lora_rank"),
            kv_lora=g("kv_lora_rank"),
            qk_nope=g("qk_nope_head_dim"),
            qk_rope=g("qk_rope_head_dim"),
            v_head=g("v_head_dim"),
            dense_inter=g("intermediate_size"),
            experts=g("n_routed_experts"),
            moe_inter=g("moe_intermediate_size"),
            shared_experts=g("n_shared_experts", 0),
        )
        ps = list(m.params)
    else:
        heads = g("num_attention_heads")
        kv = g("num_key_value_heads", heads)
        hd = g("head_dim", hidden // max(heads, 1))
        ps = [Param(name="embed_tokens", shape=(vocab, hidden), role=ParamRole.EMBEDDING)]
        moe = kind == "qwen3_moe"
        dense_only = set(cfg.get("mlp_only_layers") or [])
        step = g("decoder_sparse_step", 1) if moe else 0
        for i in range(layers):
            ps += gqa_attention(i, hidden, heads, kv, hd, qk_norm=kind != "llama")
            mp = f"layers.{i}.mlp"
            if moe and i not in dense_only and step and (i + 1) % step == 0:
                e, inter = g("num_experts"), g("moe_intermediate_size")
                col, row = ParamRole.EXPERT_COLUMN, ParamRole.EXPERT_ROW
                ps += [
                    Param(name=f"{mp}.gate.weight", shape=(hidden, e), layer=i),
                    Param(name=f"{mp}.experts.gate_proj", shape=(e, hidden, inter), role=col, layer=i),
                    Param(name=f"{mp}.experts.up_proj", shape=(e, hidden, inter), role=col, layer=i),
                    Param(name=f"{mp}.experts.down_proj", shape=(e, inter, hidden), role=row, layer=i),
                ]
            else:
                inter = g("intermediate_size")
                ps += [
                    Param(name=f"{mp}.gate_proj", shape=(hidden, inter), role=ParamRole.COLUMN, layer=i),
                    Param(name=f"{mp}.up_proj", shape=(hidden, inter), role=ParamRole.COLUMN, layer=i),
                    Param(name=f"{mp}.down_proj", shape=(inter, hidden), role=ParamRole.ROW, layer=i),
                ]
        ps += [Param(name="norm", shape=(hidden,)), Param(name="lm_head", shape=(hidden, vocab), role=ParamRole.HEAD)]
    if cfg.get("tie_word_embeddings", False):
        ps = [p for p in ps if p.name != "lm_head"]
    return Model(name=name, layers=layers, params=tuple(ps))
