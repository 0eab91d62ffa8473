"""vLLM's layouts compute the trainer's model: a tensor-parallel PyTorch forward pass over each rank's shards
(as vLLM's layers compute it: vocabulary-parallel embedding, per-rank heads, all-reduced row-parallel outputs,
gathered vocabulary-parallel logits) gives the logits of the trainer's JAX forward pass over its own tree."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jreshard.integrations import vllm
from jreshard.views.bounds import evaluate
from jreshard.views.casts import cast

torch = pytest.importorskip("torch")  # installed by `make test` (the torch extra)

EPS = 1e-6
THETA = 10000.0


def _rope_tables(t: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / THETA ** (np.arange(0, h, 2, dtype=np.float64) / h)
    ang = np.arange(t)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=-1)  # rotate-half (neox) order, as vLLM's Llama uses
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# ---- the trainer's forward pass: jax, Tunix's parameter names and orientations ----


def _jax_forward(p: dict, m: vllm.DecoderShape, tokens: np.ndarray) -> np.ndarray:
    n = vllm.TUNIX_NAMES
    cos, sin = (jnp.asarray(a) for a in _rope_tables(len(tokens), m.head_dim))

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


# ---- the server's forward pass: torch, vLLM's names, each TP rank's own shards ----


def _rank_params(views: dict, m: vllm.DecoderShape, r: int, tp: int, dtype) -> dict:
    """Rank ``r``'s parameters as vLLM allocates them (zeros), filled where the refit writes."""
    out = {}
    for name, s in vllm.vllm_shards(m, r, tp).items():
        full = evaluate(views[name], lambda leaf: leaf.source, cast)
        t = torch.zeros(s.local_shape, dtype=dtype)
        t[s.local_box.slices()] = torch.from_numpy(np.asarray(full[s.box.slices()], np.float32)).to(dtype)
        out[name] = t
    return out


def _torch_forward(ranks: list[dict], m: vllm.DecoderShape, tokens: np.ndarray) -> np.ndarray:
    tp = len(ranks)
    tok = torch.from_numpy(tokens.astype(np.int64))
    cos, sin = (torch.from_numpy(a) for a in _rope_tables(len(tokens), m.head_dim))
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


BASE = dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8)  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "tp"),
    [
        (BASE, 2),
        (BASE, 4),  # key/value heads replicated on two ranks each; vocabulary padded 200 -> 256
        (dict(BASE, qkv_bias=True, tie_word_embeddings=True), 2),  # Qwen2-style
        (dict(BASE, qk_norm=True, num_kv_heads=1), 4),  # Qwen3-style, one kv head on every rank
    ],
)
def test_tp_ranks_compute_the_trainers_logits(cfg, tp):
    m = vllm.DecoderShape(**cfg)
    rng = np.random.default_rng(7)
    shapes = vllm._trainer_shapes(m, vllm.TUNIX_NAMES)
    params = {k: (rng.standard_normal(s) / math.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
    for k in params:
        if k.endswith(("norm.w", "layernorm.w")):
            params[k] = 1.0 + 0.1 * params[k]
    tokens = rng.integers(0, m.vocab_size, size=12)
    want = _jax_forward({k: jnp.asarray(v) for k, v in params.items()}, m, tokens)
    views32 = vllm.vllm_views(params, m, tp, dtype="float32")
    got = _torch_forward([_rank_params(views32, m, r, tp, torch.float32) for r in range(tp)], m, tokens)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    views16 = vllm.vllm_views(params, m, tp, dtype="bfloat16")
    got16 = _torch_forward([_rank_params(views16, m, r, tp, torch.bfloat16) for r in range(tp)], m, tokens)
    assert np.abs(got16 - want).max() < 0.1 * np.abs(want).max()  # bfloat16 weights and activations
