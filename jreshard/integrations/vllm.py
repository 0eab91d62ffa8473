"""vLLM's tensor-parallel parameter layouts, as views of a JAX trainer's parameters.

A vLLM worker of tensor-parallel rank ``r`` of ``tp`` holds, for a Llama-, Qwen2- or Qwen3-style
decoder, fused and transposed shards of the trainer's weights. This module says, per vLLM
parameter name, which part of which view of the trainer's tree that shard is, so a refit moves
each trainer shard straight into each worker's tensor (shard to shard, over the minimal plan) and
no side ever builds a global tensor:

- :func:`vllm_views`: per vLLM name, a :class:`~jreshard.views.View` of the trainer's parameters
  in vLLM's orientation (``[out, in]``), fused (``qkv_proj``, ``gate_up_proj``) in the interleaved
  order its TP ranks tile, cast to the server's dtype;
- :func:`vllm_shards`: per vLLM name, for one TP rank, the box of that view the rank holds, the
  shape of the rank's parameter, and where the box lands in it (vocabulary padding stays as vLLM
  left it).

The conventions, read from vLLM's source (``vllm/model_executor/layers/linear.py`` and
``vllm/model_executor/layers/vocab_parallel_embedding.py``, vLLM 0.8-0.11):

- ``QKVParallelLinear``: rank ``r`` holds ``[q_r; k_r; v_r]`` along the output dimension, with
  ``heads / tp`` query heads; when ``tp >= kv_heads`` each rank holds one key/value head, head
  ``r // (tp / kv_heads)`` (``num_kv_head_replicas``), else ``kv_heads / tp`` of them. A bias
  (Qwen2) is laid out the same way.
- ``MergedColumnParallelLinear`` (``gate_up_proj``): rank ``r`` holds ``[gate_r; up_r]``.
- ``RowParallelLinear`` (``o_proj``, ``down_proj``): split on the input dimension.
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of 64
  (``pad_vocab_size``), rank ``r`` holding rows ``[r * V_pad / tp, (r + 1) * V_pad / tp)`` of the
  padded range; rows past the real vocabulary are padding (vLLM fills them with zeros) and no
  refit writes them. With tied embeddings vLLM has no ``lm_head.weight`` parameter.
- Norms (``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, Qwen3's ``q_norm`` and
  ``k_norm``) are replicated on every rank.

The trainer's side defaults to Tunix's parameter names and orientations (``[in, out]`` kernels,
``q_proj`` as ``[embed, heads, head_dim]``, separate ``q``/``k``/``v`` and ``gate``/``up``); another
trainer passes its own :class:`TrainerNames`.

Example:
  >>> from jreshard.integrations import vllm
  >>> model = vllm.DecoderShape(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=1,
  ...                           num_heads=8, num_kv_heads=2, head_dim=8)
  >>> shards = vllm.vllm_shards(model, tp_rank=1, tp_size=4)
  >>> s = shards["model.layers.0.self_attn.qkv_proj.weight"]
  >>> s.tensor_shape, s.box  # 2 query heads, then the one key/value head this rank replicates
  ((32, 64), Box(lo=(32, 0), hi=(64, 64)))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import dtype_name
from jreshard.types import DType
from jreshard.views import View, astype, concat, param, reshape, transpose

__all__ = [
    "TUNIX_NAMES",
    "DecoderShape",
    "TrainerNames",
    "VllmShard",
    "flat_key",
    "pad_vocab",
    "receiver_shards",
    "trainer_params",
    "vllm_shards",
    "vllm_views",
]

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def pad_vocab(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """The vocabulary size vLLM allocates: ``vocab_size`` rounded up to a multiple of ``pad_to``."""
    return -(-vocab_size // pad_to) * pad_to


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """What fixes the parameter shapes of a Llama-, Qwen2- or Qwen3-style decoder.

    ``qkv_bias``: Qwen2's biases on q, k and v; ``qk_norm``: Qwen3's per-head RMS norms of q and k.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim"):  # fmt: skip
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DecoderShape: {f}={v!r}; expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderShape: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> DecoderShape:
        """From a Hugging Face ``config.json`` of a Llama, Qwen2 or Qwen3 model (``model_type`` picks
        the biases and norms)."""
        kind = str(config.get("model_type", "llama"))
        if kind not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ValueError(
                f"DecoderShape.from_hf_config: model_type={kind!r}; expected llama, mistral, qwen2 or qwen3"
            )
        heads = int(config["num_attention_heads"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2",
            qk_norm=kind == "qwen3",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerNames:
    """Where a trainer keeps each weight: name templates (``{i}`` is the layer) in Tunix's orientations.

    Kernels are ``[in, out]``; ``q``/``k``/``v`` are ``[embed, heads, head_dim]``, ``o`` is
    ``[heads, head_dim, embed]``; the embedding is ``[vocab, embed]`` and the LM head ``[embed, vocab]``.
    """

    embed: str = "embedder.input_embedding"
    q: str = "layers.{i}.attn.q_proj.w"
    k: str = "layers.{i}.attn.k_proj.w"
    v: str = "layers.{i}.attn.v_proj.w"
    o: str = "layers.{i}.attn.o_proj.w"
    q_bias: str = "layers.{i}.attn.q_bias"
    k_bias: str = "layers.{i}.attn.k_bias"
    v_bias: str = "layers.{i}.attn.v_bias"
    q_norm: str = "layers.{i}.attn.q_norm.w"
    k_norm: str = "layers.{i}.attn.k_norm.w"
    gate: str = "layers.{i}.mlp.gate_proj.kernel"
    up: str = "layers.{i}.mlp.up_proj.kernel"
    down: str = "layers.{i}.mlp.down_proj.kernel"
    input_norm: str = "layers.{i}.input_layernorm.w"
    post_norm: str = "layers.{i}.post_attention_layernorm.w"
    final_norm: str = "final_norm.w"
    lm_head: str = "lm_head.w"


TUNIX_NAMES = TrainerNames()


def _trainer_shapes(m: DecoderShape, n: TrainerNames) -> dict[str, tuple[int, ...]]:
    d, h, i_ = m.hidden_size, m.head_dim, m.intermediate_size
    out: dict[str, tuple[int, ...]] = {n.embed: (m.vocab_size, d), n.final_norm: (d,)}
    if not m.tie_word_embeddings:
        out[n.lm_head] = (d, m.vocab_size)
    for layer in range(m.num_layers):
        f = {k: getattr(n, k).format(i=layer) for k in dataclasses.asdict(n)}
        out |= {f["q"]: (d, m.num_heads, h), f["k"]: (d, m.num_kv_heads, h), f["v"]: (d, m.num_kv_heads, h),
                f["o"]: (m.num_heads, h, d), f["gate"]: (d, i_), f["up"]: (d, i_), f["down"]: (i_, d),
                f["input_norm"]: (d,), f["post_norm"]: (d,)}  # fmt: skip
        if m.qkv_bias:
            out |= {f["q_bias"]: (m.num_heads * h,), f["k_bias"]: (m.num_kv_heads * h,),
                    f["v_bias"]: (m.num_kv_heads * h,)}  # fmt: skip
        if m.qk_norm:
            out |= {f["q_norm"]: (h,), f["k_norm"]: (h,)}
    return out


def flat_key(name: str) -> str:
    """The name a trainer's flat dict ``{name: array}`` gives its leaf in a refit group (``['name']``)."""
    return f"[{name!r}]"


def trainer_params(
    model: DecoderShape,
    dtype: DType = "float32",
    names: TrainerNames = TUNIX_NAMES,
    key: Callable[[str], str] = lambda name: name,
) -> dict[str, View]:
    """The trainer's parameters as named leaves (:func:`jreshard.views.param`), for a program that
    declares views of another program's tree (a server): name -> leaf of the trainer's shape, named
    ``key(name)`` (the name the trainer's tree gives it in the group: :func:`flat_key` for a flat dict)."""
    return {name: param(key(name), shape, dtype) for name, shape in _trainer_shapes(model, names).items()}


def _kv_layout(m: DecoderShape, tp: int) -> tuple[int, int]:
    """(key/value heads per rank, replicas of each): vLLM's ``QKVParallelLinear`` split."""
    if tp >= m.num_kv_heads:
        if tp % m.num_kv_heads:
            raise ValueError(f"vllm: tp_size={tp} is not a multiple of num_kv_heads={m.num_kv_heads}")
        return 1, tp // m.num_kv_heads
    if m.num_kv_heads % tp:
        raise ValueError(f"vllm: num_kv_heads={m.num_kv_heads} is not a multiple of tp_size={tp}")
    return m.num_kv_heads // tp, 1


def _check_tp(m: DecoderShape, tp_rank: int, tp_size: int) -> None:
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"vllm: tp_size={tp_size!r}; expected a positive int")
    if not isinstance(tp_rank, int) or isinstance(tp_rank, bool) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"vllm: tp_rank={tp_rank!r}; expected an int in [0, {tp_size})")
    for what, n in (("num_heads", m.num_heads), ("intermediate_size", m.intermediate_size),
                    ("hidden_size", m.hidden_size)):  # fmt: skip
        if n % tp_size:
            raise ValueError(f"vllm: {what}={n} is not a multiple of tp_size={tp_size}")
    _kv_layout(m, tp_size)


def _heads_rows(w: View, shape: tuple[int, ...]) -> View:
    """``[embed, heads, head_dim]`` -> ``[heads * head_dim, embed]``."""
    return reshape(transpose(w, (1, 2, 0)), (shape[1] * shape[2], shape[0]))


def _replicated_kv(rows: View, m: DecoderShape, tp: int) -> View:
    """Key or value rows (``[kv_heads * head_dim, ...]``) as the ``tp`` ranks hold them, in rank order."""
    _, reps = _kv_layout(m, tp)
    if reps == 1:
        return rows
    h = m.head_dim
    return concat([rows[(r // reps) * h : (r // reps + 1) * h] for r in range(tp)], axis=0)


def vllm_views(
    trainer: Mapping[str, Any] | Callable[[str], Any],
    model: DecoderShape,
    tp_size: int,
    dtype: DType = "bfloat16",
    names: TrainerNames = TUNIX_NAMES,
) -> dict[str, View]:
    """Per vLLM parameter name, the view of the trainer's parameters all ``tp_size`` ranks tile.

    Args:
      trainer: the trainer's parameters by name (a flat mapping, or a function of the name): jax
        arrays in the trainer's program, or :func:`trainer_params` leaves in a server's.
      model: the decoder's shapes.
      tp_size: vLLM's tensor-parallel size.
      dtype: the server's parameter dtype (the cast runs where it saves wire bytes).
      names: where the trainer keeps each weight.

    Raises:
      ValueError: a TP size that does not divide the heads, key/value heads, MLP or hidden size;
      KeyError: a weight ``names`` points to that ``trainer`` lacks.
    """
    _check_tp(model, 0, tp_size)
    get = trainer if callable(trainer) else trainer.__getitem__
    shapes = _trainer_shapes(model, names)
    dt = dtype_name(dtype)

    def leaf(name: str) -> View:
        x = get(name)
        if tuple(x.shape) != shapes[name]:
            raise ValueError(f"vllm_views: trainer parameter {name!r} has shape {tuple(x.shape)}; "
                             f"the model's shapes give {shapes[name]}")  # fmt: skip
        return x

    out: dict[str, View] = {"model.embed_tokens.weight": astype(leaf(names.embed), dt)}
    for i in range(model.num_layers):
        f = {k: getattr(names, k).format(i=i) for k in dataclasses.asdict(names)}
        pre = f"model.layers.{i}."
        q, k, v = (_heads_rows(leaf(f[n]), shapes[f[n]]) for n in ("q", "k", "v"))
        qkv = [q, _replicated_kv(k, model, tp_size), _replicated_kv(v, model, tp_size)]
        out[pre + "self_attn.qkv_proj.weight"] = astype(concat(qkv, axis=0, groups=tp_size), dt)
        if model.qkv_bias:
            b = [leaf(f["q_bias"])] + [_replicated_kv(leaf(f[n]), model, tp_size) for n in ("k_bias", "v_bias")]
            out[pre + "self_attn.qkv_proj.bias"] = astype(concat(b, axis=0, groups=tp_size), dt)
        o = leaf(f["o"])
        out[pre + "self_attn.o_proj.weight"] = astype(reshape(transpose(o, (2, 0, 1)), (o.shape[2], -1)), dt)
        if model.qk_norm:
            out[pre + "self_attn.q_norm.weight"] = astype(leaf(f["q_norm"]), dt)
            out[pre + "self_attn.k_norm.weight"] = astype(leaf(f["k_norm"]), dt)
        gate_up = [transpose(leaf(f["gate"])), transpose(leaf(f["up"]))]
        out[pre + "mlp.gate_up_proj.weight"] = astype(concat(gate_up, axis=0, groups=tp_size), dt)
        out[pre + "mlp.down_proj.weight"] = astype(transpose(leaf(f["down"])), dt)
        out[pre + "input_layernorm.weight"] = astype(leaf(f["input_norm"]), dt)
        out[pre + "post_attention_layernorm.weight"] = astype(leaf(f["post_norm"]), dt)
    out["model.norm.weight"] = astype(leaf(names.final_norm), dt)
    if not model.tie_word_embeddings:
        out["lm_head.weight"] = astype(transpose(leaf(names.lm_head)), dt)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class VllmShard:
    """One vLLM parameter on one TP rank.

    Attributes:
      name: vLLM's parameter name (``model.layers.0.self_attn.qkv_proj.weight``).
      view_shape: the shape of the view all ranks tile (:func:`vllm_views`).
      box: the part of that view this rank holds (empty on a rank that holds only vocabulary padding).
      tensor_shape: the shape of the rank's parameter tensor.
      tensor_box: where ``box`` lands in that tensor (all of it, but for the vocabulary's padding rows).
    """

    name: str
    view_shape: tuple[int, ...]
    box: Box
    tensor_shape: tuple[int, ...]
    tensor_box: Box


def _split(name: str, shape: tuple[int, ...], axis: int, r: int, tp: int) -> VllmShard:
    n = shape[axis] // tp
    lo = tuple(r * n if d == axis else 0 for d in range(len(shape)))
    hi = tuple((r + 1) * n if d == axis else s for d, s in enumerate(shape))
    own = tuple(n if d == axis else s for d, s in enumerate(shape))
    return VllmShard(name, shape, Box(lo, hi), own, Box((0,) * len(shape), own))


def _whole(name: str, shape: tuple[int, ...]) -> VllmShard:
    box = Box((0,) * len(shape), shape)
    return VllmShard(name, shape, box, shape, box)


def _vocab(name: str, m: DecoderShape, r: int, tp: int) -> VllmShard:
    per = pad_vocab(m.vocab_size) // tp
    lo, hi = min(r * per, m.vocab_size), min((r + 1) * per, m.vocab_size)
    d = m.hidden_size
    return VllmShard(name, (m.vocab_size, d), Box((lo, 0), (hi, d)), (per, d), Box((0, 0), (hi - lo, d)))


def vllm_shards(model: DecoderShape, tp_rank: int, tp_size: int) -> dict[str, VllmShard]:
    """Per vLLM parameter name, what TP rank ``tp_rank`` of ``tp_size`` holds (see :class:`VllmShard`).

    Raises:
      ValueError: a rank outside ``[0, tp_size)``, or a TP size vLLM itself would refuse for ``model``.
    """
    _check_tp(model, tp_rank, tp_size)
    r, tp, m = tp_rank, tp_size, model
    per_kv, _ = _kv_layout(m, tp)
    h, d = m.head_dim, m.hidden_size
    qkv_rows = tp * (m.num_heads // tp + 2 * per_kv) * h
    out = {"model.embed_tokens.weight": _vocab("model.embed_tokens.weight", m, r, tp)}
    for i in range(m.num_layers):
        pre = f"model.layers.{i}."
        names = {
            "self_attn.qkv_proj.weight": _split(pre + "self_attn.qkv_proj.weight", (qkv_rows, d), 0, r, tp),
            "self_attn.o_proj.weight": _split(pre + "self_attn.o_proj.weight", (d, m.num_heads * h), 1, r, tp),
            "mlp.gate_up_proj.weight": _split(pre + "mlp.gate_up_proj.weight", (2 * m.intermediate_size, d), 0, r, tp),
            "mlp.down_proj.weight": _split(pre + "mlp.down_proj.weight", (d, m.intermediate_size), 1, r, tp),
            "input_layernorm.weight": _whole(pre + "input_layernorm.weight", (d,)),
            "post_attention_layernorm.weight": _whole(pre + "post_attention_layernorm.weight", (d,)),
        }
        if m.qkv_bias:
            names["self_attn.qkv_proj.bias"] = _split(pre + "self_attn.qkv_proj.bias", (qkv_rows,), 0, r, tp)
        if m.qk_norm:
            names["self_attn.q_norm.weight"] = _whole(pre + "self_attn.q_norm.weight", (h,))
            names["self_attn.k_norm.weight"] = _whole(pre + "self_attn.k_norm.weight", (h,))
        out |= {pre + k: v for k, v in names.items()}
    out["model.norm.weight"] = _whole("model.norm.weight", (d,))
    if not m.tie_word_embeddings:
        out["lm_head.weight"] = _vocab("lm_head.weight", m, r, tp)
    assert all(math.prod(s.tensor_box.shape) == math.prod(s.box.shape) for s in out.values())
    return out


def receiver_shards(
    tensors: Mapping[str, Any],
    model: DecoderShape,
    tp_rank: int,
    tp_size: int,
    *,
    source_dtype: Any = "float32",
    names: TrainerNames = TUNIX_NAMES,
    key: Callable[[str], str] = flat_key,
) -> tuple[dict[str, Any], dict[str, View]]:
    """``(shards, recipe)`` for :class:`jreshard.torch.Receiver` on vLLM's TP rank ``tp_rank``.

    Args:
      tensors: the rank's parameters by vLLM name (``dict(model.named_parameters())``), each
        contiguous, of the shape vLLM allocates; their dtype is the server's.
      model, tp_rank, tp_size: the decoder and the rank.
      source_dtype: the trainer's parameter dtype; names, key: where and under what names the
        trainer keeps each weight (:func:`trainer_params`).

    Raises:
      LayoutError: a parameter the layout needs is missing, or has another shape than vLLM allocates
        (names the parameter and both shapes); parameters of more than one dtype.
    """
    from jreshard.errors import LayoutError
    from jreshard.torch import tensor_dtype
    from jreshard.torch.receiver import Shard

    layout = vllm_shards(model, tp_rank, tp_size)
    missing = sorted(set(layout) - set(tensors))
    if missing:
        raise LayoutError(f"receiver_shards: the rank's parameters lack {missing}")
    dtypes = sorted({tensor_dtype(tensors[n]) for n in layout})
    if len(dtypes) != 1:
        raise LayoutError(f"receiver_shards: the parameters have dtypes {dtypes}; vLLM's weights take one")
    shards = {}
    for name, s in layout.items():
        shape = tuple(int(n) for n in tensors[name].shape)
        if shape != s.tensor_shape:
            raise LayoutError(f"receiver_shards: {name} has shape {shape}; vLLM allocates {s.tensor_shape} on rank "
                              f"{tp_rank} of {tp_size}")  # fmt: skip
        shards[name] = Shard(tensors[name], s.view_shape, s.box, s.tensor_box)
    views = vllm_views(trainer_params(model, source_dtype, names, key), model, tp_size, dtypes[0], names)
    return shards, views
