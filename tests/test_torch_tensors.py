"""PyTorch tensors as destination memory (``jreshard.torch``), and vLLM's parameters as a PyTorch module
declares them: names and per-rank shapes from vLLM's layer formulas, against ``vllm_shards``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from jreshard.integrations import vllm
from jreshard.sharding.box import Box
from jreshard.torch import host_bytes, tensor_dtype, tensor_region

torch = pytest.importorskip("torch")  # installed by `make test` (the torch extra)


def test_importing_the_adapter_imports_neither_jax_nor_torch():
    code = "import sys, jreshard.torch; print(sorted(m for m in ('jax', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("float16", "float16"),
        ("int8", "int8"),
        ("bool", "bool"),
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e8m0fnu", "float8_e8m0fnu"),
        ("float8_e5m2fnuz", "float8_e5m2fnuz"),
        ("complex64", "complex64"),
        ("complex128", "complex128"),
        ("uint32", "uint32"),
        ("uint64", "uint64"),
    ],
)
def test_dtype_names(dtype, name):
    assert tensor_dtype(torch.zeros(2, dtype=getattr(torch, dtype))) == name


def test_a_dtype_without_a_counterpart_and_a_non_tensor_are_named():
    with pytest.raises(TypeError, match="int4 has no jreshard counterpart"):
        tensor_dtype(torch.zeros(2, dtype=torch.int4))
    with pytest.raises(TypeError, match="float4_e2m1fn_x2 has no jreshard counterpart"):
        tensor_dtype(torch.zeros(2, dtype=torch.float4_e2m1fn_x2))
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got ndarray"):
        tensor_dtype(np.zeros(2))


def test_regions_are_the_boxes_bytes_and_writes_land_in_the_tensor():
    t = torch.zeros(6, 4, dtype=torch.bfloat16)
    address, nbytes = tensor_region(t, Box((2, 0), (5, 4)))
    assert (address - t.data_ptr(), nbytes) == (2 * 4 * 2, 3 * 4 * 2)
    assert tensor_region(t, Box((3, 1), (4, 3))) == (t.data_ptr() + (3 * 4 + 1) * 2, 2 * 2)  # part of one row
    b = host_bytes(t, Box((2, 0), (5, 4)))
    b[:] = np.frombuffer(torch.full((12,), 1.5, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes(), np.uint8)
    assert t[:2].abs().sum() == 0 and t[5:].abs().sum() == 0 and bool((t[2:5] == 1.5).all())
    whole = host_bytes(t)
    assert whole.size == t.numel() * 2 and whole.ctypes.data == t.data_ptr()


@pytest.mark.parametrize(
    ("box", "match"),
    [
        (Box((0, 1), (2, 3)), "not one contiguous run"),
        (Box((0, 0), (7, 4)), r"not inside a tensor of shape \(6, 4\)"),
        (Box((0,), (2,)), "not inside"),
    ],
)
def test_a_box_that_is_not_one_run_or_not_inside_is_refused(box, match):
    with pytest.raises(ValueError, match=match):
        tensor_region(torch.zeros(6, 4), box, what="qkv_proj")


def test_a_non_contiguous_tensor_is_refused_by_name():
    with pytest.raises(ValueError, match=r"lm_head: a tensor of shape \(4, 6\) and strides \(1, 4\) is not contiguous"):
        tensor_region(torch.zeros(6, 4).T, what="lm_head")


class _VllmLike(torch.nn.Module):
    """The parameters a vLLM Llama / Qwen2 / Qwen3 model allocates on one TP rank, from vLLM's layer formulas:
    ``QKVParallelLinear`` output ``(heads/tp + 2 * max(kv/tp, 1)) * head_dim``, ``MergedColumnParallelLinear``
    ``2 * intermediate/tp``, ``RowParallelLinear`` input ``/tp``, ``VocabParallelEmbedding`` rows
    ``pad(vocab, 64) / tp``."""

    def __init__(self, m: vllm.DecoderShape, tp: int):
        super().__init__()
        kv = max(m.num_kv_heads // tp, 1)
        qkv = (m.num_heads // tp + 2 * kv) * m.head_dim
        d, e = m.hidden_size, torch.nn.Parameter
        rows = -(-m.vocab_size // 64) * 64 // tp
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Module()
        self.model.embed_tokens.weight = e(torch.zeros(rows, d))
        self.model.layers = torch.nn.ModuleList()
        for _ in range(m.num_layers):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            layer.self_attn.qkv_proj = torch.nn.Linear(d, qkv, bias=m.qkv_bias)
            layer.self_attn.o_proj = torch.nn.Linear(m.num_heads * m.head_dim // tp, d, bias=False)
            if m.qk_norm:
                layer.self_attn.q_norm = torch.nn.RMSNorm(m.head_dim)
                layer.self_attn.k_norm = torch.nn.RMSNorm(m.head_dim)
            layer.mlp = torch.nn.Module()
            layer.mlp.gate_up_proj = torch.nn.Linear(d, 2 * m.intermediate_size // tp, bias=False)
            layer.mlp.down_proj = torch.nn.Linear(m.intermediate_size // tp, d, bias=False)
            layer.input_layernorm = torch.nn.RMSNorm(d)
            layer.post_attention_layernorm = torch.nn.RMSNorm(d)
            self.model.layers.append(layer)
        self.model.norm = torch.nn.RMSNorm(d)
        if not m.tie_word_embeddings:
            self.lm_head = torch.nn.Module()
            self.lm_head.weight = e(torch.zeros(rows, d))


@pytest.mark.parametrize(
    ("cfg", "tp"),
    [
        (dict(model_type="llama", num_key_value_heads=8), 2),
        (dict(model_type="llama", num_key_value_heads=2), 8),
        (dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True), 4),
        (dict(model_type="qwen3", num_key_value_heads=4, head_dim=32), 2),
    ],
)
def test_a_vllm_like_module_declares_exactly_the_shards(cfg, tp):
    hf = dict(vocab_size=32003, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8)
    m = vllm.DecoderShape.from_hf_config({**hf, **cfg})
    params = dict(_VllmLike(m, tp).named_parameters())
    for r in range(tp):
        shards = vllm.vllm_shards(m, r, tp)
        assert set(shards) == set(params)
        for name, s in shards.items():
            assert tuple(params[name].shape) == s.tensor_shape, name
            address, nbytes = tensor_region(params[name], s.tensor_box, what=name)  # one run, even when padded
            assert nbytes == int(np.prod(s.box.shape)) * 4 and address == params[name].data_ptr()


def test_a_receiver_commits_staged_bytes_and_refuses_device_tensors_in_place():
    """The commit of the staged default copies each box into its tensor's region (the padding rows stay); a
    tensor off the host is refused with ``in_place=True`` by name, before any connection."""
    from jreshard.torch.receiver import Receiver, Shard

    class _NoEndpoint:
        version = None

        def pull(self, buffers, *, timeout_s=None):
            for i, buf in enumerate(buffers.values()):
                buf[:] = np.arange(buf.size, dtype=np.uint8) + i
            return 7

    t = torch.full((4, 2), -1.0)
    shard = Shard(t, (3, 2), Box((0, 0), (3, 2)), Box((0, 0), (3, 2)))  # 3 real rows, 1 padding row
    rx = Receiver(_NoEndpoint(), {"emb": shard})
    assert rx.pull() == 7
    want = torch.from_numpy(np.arange(24, dtype=np.uint8)).view(torch.float32).reshape(3, 2)
    assert torch.equal(t[:3], want) and bool((t[3] == -1.0).all())

    class _Elsewhere:  # what Receiver reads of a device tensor
        device, dtype, shape = "cuda:0", torch.float32, (2,)

        def is_contiguous(self):
            return True

        def element_size(self):
            return 4

        def data_ptr(self):
            return 4096

    with pytest.raises(ValueError, match="w: in_place=True writes host memory, but the tensor is on cuda:0"):
        Receiver(_NoEndpoint(), {"w": Shard(_Elsewhere(), (2,), Box((0,), (2,)))}, in_place=True)
