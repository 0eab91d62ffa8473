"""vLLM's layouts compute the trainer's model: a tensor-parallel PyTorch forward pass over each rank's shards
(as vLLM's layers compute it: vocabulary-parallel embedding, per-rank heads, all-reduced row-parallel outputs,
gathered vocabulary-parallel logits) gives the logits of the trainer's JAX forward pass over its own tree."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from _vllm_reference import jax_forward, rank_params, torch_forward

from jreshard.integrations import vllm

torch = pytest.importorskip("torch")  # installed by `make test` (the torch extra)

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
    want = jax_forward({k: jnp.asarray(v) for k, v in params.items()}, m, tokens)
    views32 = vllm.vllm_views(params, m, tp, dtype="float32")
    got = torch_forward([rank_params(views32, m, r, tp, torch.float32) for r in range(tp)], m, tokens)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    views16 = vllm.vllm_views(params, m, tp, dtype="bfloat16")
    got16 = torch_forward([rank_params(views16, m, r, tp, torch.bfloat16) for r in range(tp)], m, tokens)
    assert np.abs(got16 - want).max() < 0.1 * np.abs(want).max()  # bfloat16 weights and activations
