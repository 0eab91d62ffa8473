"""vLLM's tensor-parallel layouts as views of a trainer's tree, against a numpy re-enactment of vLLM's own
weight loaders (``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``): every rank's every parameter, element for element."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _vllm_reference import hf_names, trainer, vllm_rank

from jreshard.integrations import vllm
from jreshard.views.bounds import evaluate
from jreshard.views.casts import cast

LLAMA = dict(vocab_size=1000, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8, num_kv_heads=2,
             head_dim=4)  # fmt: skip


CASES = [
    (dict(LLAMA), 1),
    (dict(LLAMA), 2),
    (dict(LLAMA), 4),  # tp > kv heads: each kv head on two ranks
    (dict(LLAMA), 8),  # each kv head on four ranks; vocabulary padded 1000 -> 1024
    (dict(LLAMA, tie_word_embeddings=True), 2),
    (dict(LLAMA, vocab_size=130), 4),  # padded to 192: rank 3 holds padding only
    (dict(LLAMA, qkv_bias=True), 4),  # Qwen2
    (dict(LLAMA, qk_norm=True, num_kv_heads=8), 2),  # Qwen3, MHA
]


@pytest.mark.parametrize(("cfg", "tp"), CASES)
def test_every_rank_holds_what_vllms_loaders_put_there(cfg, tp):
    model = vllm.DecoderShape(**cfg)
    t = trainer(model)
    hf = hf_names(model, t)
    views = vllm.vllm_views(t, model, tp, dtype="float32")
    full = {name: evaluate(v, lambda leaf: leaf.source, cast) for name, v in views.items()}
    for r in range(tp):
        want = vllm_rank(model, hf, r, tp)
        shards = vllm.vllm_shards(model, r, tp)
        assert set(shards) == set(want) == set(views)
        for name, s in shards.items():
            assert full[name].shape == s.view_shape, name
            got = np.zeros(s.tensor_shape, np.float32)
            got[s.tensor_box.slices()] = full[name][s.box.slices()]
            np.testing.assert_array_equal(got, want[name], err_msg=f"{name} on rank {r} of {tp}")


def test_the_ranks_tile_every_view_once_and_padding_is_never_written():
    model = vllm.DecoderShape(**LLAMA)
    for tp in (1, 2, 4, 8):
        shards = [vllm.vllm_shards(model, r, tp) for r in range(tp)]
        for name, s in shards[0].items():
            vol = sum(math.prod(sh[name].box.shape) for sh in shards)
            replicated = s.box.shape == s.view_shape and s.tensor_shape == s.view_shape
            assert vol == math.prod(s.view_shape) * (tp if replicated else 1), name
    per = vllm.pad_vocab(1000) // 8
    last = vllm.vllm_shards(model, 7, 8)["model.embed_tokens.weight"]
    assert last.tensor_shape == (per, 32) and last.tensor_box.hi[0] == 1000 - 7 * per < per


def test_a_cast_view_is_what_the_server_dtype_gives():
    model = vllm.DecoderShape(**LLAMA)
    t = trainer(model)
    v = vllm.vllm_views(t, model, 2)["model.layers.0.mlp.down_proj.weight"]
    assert v.dtype == "bfloat16"
    got = evaluate(v, lambda leaf: leaf.source, cast)
    np.testing.assert_array_equal(got, cast(t["layers.0.mlp.down_proj.kernel"].T, "bfloat16"))


def test_a_server_declares_the_same_views_over_named_trainer_parameters():
    from jreshard.views.named import encode

    model = vllm.DecoderShape(**LLAMA, qkv_bias=True)
    named = vllm.vllm_views(vllm.trainer_params(model), model, 4)
    real = vllm.vllm_views(trainer(model), model, 4)
    assert {k: v.shape for k, v in named.items()} == {k: v.shape for k, v in real.items()}
    assert all(encode(v) for v in named.values())  # every view travels in the named form


def test_from_a_hugging_face_config():
    cfg = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
           "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "tie_word_embeddings": True}  # fmt: skip
    m = vllm.DecoderShape.from_hf_config(cfg)
    assert (m.head_dim, m.qkv_bias, m.qk_norm, m.tie_word_embeddings) == (64, True, False, True)
    s = vllm.vllm_shards(m, 1, 2)["model.layers.0.self_attn.qkv_proj.weight"]
    assert s.tensor_shape == ((7 + 2 * 1) * 64, 896)


@pytest.mark.parametrize(
    ("cfg", "rank", "tp", "match"),
    [
        (LLAMA, 0, 3, "num_heads=8 is not a multiple of tp_size=3"),
        (
            dict(LLAMA, num_kv_heads=4, num_heads=12, hidden_size=48, intermediate_size=96),
            0,
            3,
            "num_kv_heads=4 is not a multiple of tp_size=3",
        ),
        (LLAMA, 2, 2, r"tp_rank=2; expected an int in \[0, 2\)"),
        (LLAMA, 0, 0, "tp_size=0"),
    ],
)
def test_a_layout_vllm_would_refuse_is_refused_by_name(cfg, rank, tp, match):
    with pytest.raises(ValueError, match=match):
        vllm.vllm_shards(vllm.DecoderShape(**cfg), rank, tp)


def test_a_trainer_parameter_of_another_shape_is_named():
    model = vllm.DecoderShape(**LLAMA)
    t = trainer(model)
    t["layers.1.mlp.up_proj.kernel"] = t["layers.1.mlp.up_proj.kernel"][:, :32]
    with pytest.raises(ValueError, match=r"'layers.1.mlp.up_proj.kernel' has shape \(32, 32\)"):
        vllm.vllm_views(t, model, 2)


def test_a_jax_trainer_moves_into_vllms_tp_layout_shard_to_shard():
    """The real engine in one process: an FSDP trainer on 4 devices, vLLM's TP4 on 4 others; each
    destination shard is rank r's parameter, bit for bit (vocabulary of a multiple of 64 * 4)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreshard import views as jviews

    devs = np.array(jax.devices())
    if len(devs) < 8:
        pytest.skip("needs 8 devices")
    model = vllm.DecoderShape(**dict(LLAMA, vocab_size=1024, num_layers=1))
    t = trainer(model, seed=3)
    fsdp = Mesh(devs[:4], ("fsdp",))
    arrays = {
        k: jax.device_put(v, NamedSharding(fsdp, P("fsdp" if v.shape[0] % 4 == 0 else None))) for k, v in t.items()
    }
    tp = Mesh(devs[4:], ("tp",))
    views = vllm.vllm_views(arrays, model, 4, dtype="float32")
    shards = vllm.vllm_shards(model, 0, 4)
    spec = {}
    for name, s in shards.items():
        split = [d for d in range(len(s.view_shape)) if s.box.shape[d] != s.view_shape[d]]
        spec[name] = NamedSharding(tp, P(*("tp" if d in split else None for d in range(len(s.view_shape)))))
    out = jviews.transfer(views, spec)
    hf = hf_names(model, t)
    for r in range(4):
        want = vllm_rank(model, hf, r, 4)
        for name, arr in out.items():
            (shard,) = [x for x in arr.addressable_shards if x.device == devs[4 + r]]
            np.testing.assert_array_equal(np.asarray(shard.data), want[name], err_msg=f"{name} rank {r}")


def test_the_layouts_import_and_run_without_jax():
    """A PyTorch server has no jax: the layouts and views it declares need numpy alone."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['jax'] = None; sys.modules['jaxlib'] = None\n"
        "from jreshard.integrations import vllm\n"
        "m = vllm.DecoderShape(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=4,"
        " num_kv_heads=1, head_dim=4)\n"
        "print(len(vllm.vllm_views(vllm.trainer_params(m), m, 2)), len(vllm.vllm_shards(m, 1, 2)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["9", "9"]
