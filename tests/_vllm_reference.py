"""vLLM's parameters, re-enacted for the tests without jax: a trainer's weights by Tunix's names, the same as
a Hugging Face checkpoint holds them, what vLLM's weight loaders put on each TP rank, and a tensor-parallel
PyTorch forward pass over the ranks' parameters (torch imported by the caller's first use)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jreshard.integrations import vllm
from jreshard.views.bounds import evaluate
from jreshard.views.casts import cast


def trainer(model: vllm.DecoderShape, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = vllm._trainer_shapes(model, vllm.TUNIX_NAMES)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def hf_names(model: vllm.DecoderShape, t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The trainer's weights under Hugging Face names and orientations (``[out, in]``), as a checkpoint has them."""
    n = vllm.TUNIX_NAMES
    out = {"model.embed_tokens.weight": t[n.embed], "model.norm.weight": t[n.final_norm]}
    if not model.tie_word_embeddings:
        out["lm_head.weight"] = t[n.lm_head].T
    for i in range(model.num_layers):
        f = {k: getattr(n, k).format(i=i) for k in vllm.TrainerNames.__dataclass_fields__}
        p = f"model.layers.{i}."
        for x in "qkv":
            w = t[f[x]]
            out[p + f"self_attn.{x}_proj.weight"] = w.transpose(1, 2, 0).reshape(-1, w.shape[0])
            if model.qkv_bias:
                out[p + f"self_attn.{x}_proj.bias"] = t[f[x + "_bias"]]
        o = t[f["o"]]
        out[p + "self_attn.o_proj.weight"] = o.reshape(-1, o.shape[2]).T
        out[p + "mlp.gate_proj.weight"] = t[f["gate"]].T
        out[p + "mlp.up_proj.weight"] = t[f["up"]].T
        out[p + "mlp.down_proj.weight"] = t[f["down"]].T
        out[p + "input_layernorm.weight"] = t[f["input_norm"]]
        out[p + "post_attention_layernorm.weight"] = t[f["post_norm"]]
        if model.qk_norm:
            out[p + "self_attn.q_norm.weight"] = t[f["q_norm"]]
            out[p + "self_attn.k_norm.weight"] = t[f["k_norm"]]
    return out


def vllm_rank(model: vllm.DecoderShape, hf: dict[str, np.ndarray], r: int, tp: int) -> dict[str, np.ndarray]:
    """What vLLM's weight loaders put in TP rank ``r``'s parameters, re-enacted step by step."""
    m, h = model, model.head_dim
    heads = m.num_heads // tp
    if tp >= m.num_kv_heads:
        kv, replicas = 1, tp // m.num_kv_heads
    else:
        kv, replicas = m.num_kv_heads // tp, 1
    out = {}

    def vocab(w):  # VocabParallelEmbedding.weight_loader: the real rows, zeros after them
        per = -(-m.vocab_size // 64) * 64 // tp
        start, end = min(r * per, m.vocab_size), min((r + 1) * per, m.vocab_size)
        p = np.zeros((per, w.shape[1]), w.dtype)
        p[: end - start] = w[start:end]
        return p

    out["model.embed_tokens.weight"] = vocab(hf["model.embed_tokens.weight"])
    if not m.tie_word_embeddings:
        out["lm_head.weight"] = vocab(hf["lm_head.weight"])
    out["model.norm.weight"] = hf["model.norm.weight"]
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias") if m.qkv_bias else ("weight",):
            q, k, v = (hf[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            qs, ks = heads * h, kv * h
            dst = np.zeros((qs + 2 * ks, *q.shape[1:]), q.dtype)
            dst[:qs] = q[r * qs : (r + 1) * qs]  # shard_id "q": this rank's query heads
            shard = r // replicas  # shard_id "k"/"v": the rank's key/value shard, replicated
            dst[qs : qs + ks] = k[shard * ks : (shard + 1) * ks]
            dst[qs + ks :] = v[shard * ks : (shard + 1) * ks]
            out[p + f"self_attn.qkv_proj.{kind}"] = dst
        o = hf[p + "self_attn.o_proj.weight"]
        n = o.shape[1] // tp
        out[p + "self_attn.o_proj.weight"] = o[:, r * n : (r + 1) * n]
        gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
        n = gate.shape[0] // tp
        out[p + "mlp.gate_up_proj.weight"] = np.concatenate([gate[r * n : (r + 1) * n], up[r * n : (r + 1) * n]])
        down = hf[p + "mlp.down_proj.weight"]
        n = down.shape[1] // tp
        out[p + "mlp.down_proj.weight"] = down[:, r * n : (r + 1) * n]
        for nm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + nm] = hf[p + nm]
        if m.qk_norm:
            for nm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                out[p + nm] = hf[p + nm]
    return out


EPS = 1e-6
THETA = 10000.0


def rope_tables(t: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / THETA ** (np.arange(0, h, 2, dtype=np.float64) / h)
    ang = np.arange(t)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=-1)  # rotate-half (neox) order, as vLLM's Llama uses
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# ---- the server's forward pass: torch, vLLM's names, each TP rank's own shards ----


def rank_params(views: dict, m: vllm.DecoderShape, r: int, tp: int, dtype: Any) -> dict:
    import torch

    """Rank ``r``'s parameters as vLLM allocates them (zeros), filled where the refit writes."""
    out = {}
    for name, s in vllm.vllm_shards(m, r, tp).items():
        full = evaluate(views[name], lambda leaf: leaf.source, cast)
        t = torch.zeros(s.tensor_shape, dtype=dtype)
        t[s.tensor_box.slices()] = torch.from_numpy(np.asarray(full[s.box.slices()], np.float32)).to(dtype)
        out[name] = t
    return out


def torch_forward(ranks: list[dict], m: vllm.DecoderShape, tokens: np.ndarray) -> np.ndarray:
    import torch

    tp = len(ranks)
    tok = torch.from_numpy(tokens.astype(np.int64))
    cos, sin = (torch.from_numpy(a) for a in rope_tables(len(tokens), m.head_dim))
    dt = ranks[0]["model.norm.weight"].dtype

    def norm(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(dt) * w

    def rope(x):
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos[:, None, :] + rot.float() * sin[:, None, :]).to(dt)

    per_vocab = vllm.pad_vocab(m.vocab_size) // tp
    x = torch.zeros(len(tokens), m.hidden_size, dtype=dt)
    for r, p in enumerate(ranks):  # VocabParallelEmbedding: each rank its rows, then all-reduce
        local = tok - r * per_vocab
        hit = (local >= 0) & (local < per_vocab)
        x = x + torch.where(hit[:, None], p["model.embed_tokens.weight"][local.clamp(0, per_vocab - 1)], 0)
    t = len(tokens)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    heads, h = m.num_heads // tp, m.head_dim
    kv = max(m.num_kv_heads // tp, 1)
    for i in range(m.num_layers):
        pre = f"model.layers.{i}."
        hid = norm(x, ranks[0][pre + "input_layernorm.weight"])
        attn = torch.zeros_like(x)
        for p in ranks:  # QKVParallelLinear per rank, attention on its heads, RowParallelLinear all-reduced
            qkv = hid @ p[pre + "self_attn.qkv_proj.weight"].T
            if m.qkv_bias:
                qkv = qkv + p[pre + "self_attn.qkv_proj.bias"]
            q, k, v = qkv.split([heads * h, kv * h, kv * h], dim=-1)
            q, k, v = q.view(t, heads, h), k.view(t, kv, h), v.view(t, kv, h)
            if m.qk_norm:
                q, k = norm(q, p[pre + "self_attn.q_norm.weight"]), norm(k, p[pre + "self_attn.k_norm.weight"])
            q, k = rope(q), rope(k)
            k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
            s = torch.einsum("tnh,snh->nts", q.float(), k.float()) / math.sqrt(h)
            a = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
            o = torch.einsum("nts,snh->tnh", a, v.float()).to(dt).reshape(t, heads * h)
            attn = attn + o @ p[pre + "self_attn.o_proj.weight"].T
        x = x + attn
        hid = norm(x, ranks[0][pre + "post_attention_layernorm.weight"])
        mlp = torch.zeros_like(x)
        for p in ranks:  # MergedColumnParallelLinear, then RowParallelLinear all-reduced
            gate, up = (hid @ p[pre + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
            mlp = mlp + (torch.nn.functional.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
        x = x + mlp
    x = norm(x, ranks[0]["model.norm.weight"])
    head = "model.embed_tokens.weight" if m.tie_word_embeddings else "lm_head.weight"
    parts = [x @ p[head].T for p in ranks]  # ParallelLMHead: each rank its vocabulary rows, gathered
    logits = torch.cat(parts, dim=-1)[:, : m.vocab_size]  # padding only after the real rows (one base vocab)
    return logits.float().numpy()


# ---- the trainer's forward pass: jax, Tunix's parameter names and orientations ----


def jax_forward(p: dict, m: vllm.DecoderShape, tokens: np.ndarray) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    n = vllm.TUNIX_NAMES
    cos, sin = (jnp.asarray(a) for a in rope_tables(len(tokens), m.head_dim))

    def norm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * w

    def rope(x):  # [t, heads, h]
        half = x.shape[-1] // 2
        rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos[:, None, :] + rot * sin[:, None, :]

    x = p[n.embed][tokens]
    t = len(tokens)
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(m.num_layers):
        f = {k: getattr(n, k).format(i=i) for k in vllm.TrainerNames.__dataclass_fields__}
        h = norm(x, p[f["input_norm"]])
        q = jnp.einsum("td,dnh->tnh", h, p[f["q"]])
        k = jnp.einsum("td,dkh->tkh", h, p[f["k"]])
        v = jnp.einsum("td,dkh->tkh", h, p[f["v"]])
        if m.qkv_bias:
            q = q + p[f["q_bias"]].reshape(q.shape[1:])
            k = k + p[f["k_bias"]].reshape(k.shape[1:])
            v = v + p[f["v_bias"]].reshape(v.shape[1:])
        if m.qk_norm:
            q, k = norm(q, p[f["q_norm"]]), norm(k, p[f["k_norm"]])
        q, k = rope(q), rope(k)
        group = m.num_heads // m.num_kv_heads
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        s = jnp.einsum("tnh,snh->nts", q, k) / math.sqrt(m.head_dim)
        a = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        o = jnp.einsum("nts,snh->tnh", a, v)
        x = x + jnp.einsum("tnh,nhd->td", o, p[f["o"]])
        h = norm(x, p[f["post_norm"]])
        x = x + (jax.nn.silu(h @ p[f["gate"]]) * (h @ p[f["up"]])) @ p[f["down"]]
    x = norm(x, p[n.final_norm])
    return np.asarray(x @ (p[n.embed].T if m.tie_word_embeddings else p[n.lm_head]))
