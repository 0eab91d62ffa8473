"""Views: an inference engine's parameter tree described lazily from trainer arrays.

Casts, fused (grouped, concatenated) parameters, stacked or unstacked layers and
experts, static slices, transposes and block FP8 quantisation are composed index
maps from destination regions to boxes of source shards. ``transfer`` lowers them
to shard-to-shard copies: nothing is gathered, no global array is built.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  >>> from jreshard import views
  >>> devs = np.array(jax.devices())
  >>> fsdp = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
  >>> q, k, v = (jax.device_put(jnp.full((8, 16), i, jnp.float32), fsdp) for i in range(3))
  >>> qkv = views.astype(views.concat([q, k, v], axis=1, groups=2), jnp.bfloat16)  # TP2 fused layout
  >>> tp2 = NamedSharding(Mesh(devs[4:].reshape(2, 2), ("dp", "tp")), P(None, "tp"))
  >>> out = views.transfer({"qkv": qkv}, {"qkv": tp2})
  >>> out["qkv"].dtype, out["qkv"].shape, out["qkv"].addressable_shards[0].data[0, ::8].tolist()
  (dtype(bfloat16), (8, 48), [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import importlib as _importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jreshard.types import DType, TreeLeaf
from jreshard.views.algebra import Cast as Cast
from jreshard.views.algebra import Concat as Concat
from jreshard.views.algebra import Index as Index
from jreshard.views.algebra import Leaf as Leaf
from jreshard.views.algebra import Reshape as Reshape
from jreshard.views.algebra import Stack as Stack
from jreshard.views.algebra import Transpose as Transpose
from jreshard.views.algebra import View as View
from jreshard.views.algebra import as_view as as_view
from jreshard.views.bounds import brute_force_network_bound as brute_force_network_bound
from jreshard.views.lowering import LeafLowering as LeafLowering
from jreshard.views.lowering import ViewPiece as ViewPiece
from jreshard.views.lowering import lower_tree as lower_tree
from jreshard.views.named import param as param
from jreshard.views.quant import QuantScales as QuantScales
from jreshard.views.quant import QuantWeights as QuantWeights
from jreshard.views.quant import quantize_fp8_reference as quantize_fp8_reference

if TYPE_CHECKING:
    from jreshard.call.views import transfer as transfer
    from jreshard.call.views import transfer_into as transfer_into

__all__ = [
    "LeafLowering",
    "ViewPiece",
    "View",
    "brute_force_network_bound",
    "astype",
    "concat",
    "has_views",
    "lower_tree",
    "param",
    "quantize_fp8",
    "quantize_fp8_reference",
    "reshape",
    "stack",
    "transfer",
    "transfer_into",
    "transpose",
    "unstack",
]


def astype(x: TreeLeaf, dtype: DType) -> View:
    """``x`` (a view or an array) cast to ``dtype``, bit-exact with ``jnp.astype``.

    Between float32, bfloat16, float16, float8_e4m3fn, float8_e5m2 and int8. The cast runs
    where it saves wire bytes: at the sender when ``dtype`` is narrower, else at the receiver.
    ``dtype`` may be a ``jax.ShapeDtypeStruct`` (its dtype; its shape must match).

    Raises:
      TypeError: a dtype outside that set; ValueError: a ShapeDtypeStruct of another shape.
    """
    v = as_view(x, "astype(x)")
    if hasattr(dtype, "shape") and hasattr(dtype, "dtype"):
        if tuple(dtype.shape) != v.shape:
            raise ValueError(f"astype: target shape {tuple(dtype.shape)} differs from the view's {v.shape}")
        dtype = dtype.dtype
    return v.astype(dtype)


def concat(parts: Sequence[Any], axis: int = 0, groups: int = 1) -> View:
    """Concatenate ``parts`` along ``axis`` in ``groups`` interleaved groups.

    Group ``i`` holds the ``i``-th of ``groups`` equal slices of each part, in order:
    ``groups=tp`` gives the fused ``qkv`` / ``gate_up`` a TP engine's shard ``i`` expects.
    Parts may repeat (key/value heads replicated for GQA).

    Raises:
      ValueError: shapes that differ off ``axis``, or ``groups`` not dividing a part;
      TypeError: parts of different dtypes.
    """
    return Concat([as_view(p, "concat(parts)") for p in parts], axis, groups)


def stack(parts: Sequence[Any], axis: int = 0) -> View:
    """``jnp.stack(parts, axis)``, lazily (per-expert leaves into one ``[E, ...]`` array)."""
    return Stack([as_view(p, "stack(parts)") for p in parts], axis)


def unstack(x: TreeLeaf, axis: int = 0) -> list[View]:
    """The slices of ``x`` along ``axis``, each without that axis (scanned layers into per-layer leaves)."""
    v = as_view(x, "unstack(x)")
    if not -v.ndim <= axis < v.ndim:
        raise ValueError(f"unstack: axis={axis} is out of range for shape {v.shape}")
    axis %= v.ndim
    return [Index(v, (slice(None),) * axis + (i,)) for i in range(v.shape[axis])]


def reshape(x: TreeLeaf, shape: Sequence[int]) -> View:
    """``jnp.reshape(x, shape)``, lazily (row-major; one ``-1`` is inferred).

    Merges and splits axes without gathering: a trainer's ``[embed, heads, head_dim]`` kernel
    becomes an engine's ``[embed, heads * head_dim]`` one region per head.

    Raises:
      ValueError: ``shape`` holds another number of elements than ``x``.

    Example:
      >>> import numpy as np
      >>> from jreshard.views.bounds import evaluate
      >>> from jreshard.views.casts import cast
      >>> q = Leaf(np.arange(12).reshape(2, 3, 2))  # [embed, heads, head_dim]
      >>> evaluate(reshape(q, (2, -1)), lambda leaf: leaf.source, cast).tolist()
      [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    """
    return Reshape(as_view(x, "reshape(x)"), shape)


def transpose(x: TreeLeaf, perm: Sequence[int] | None = None) -> View:
    """``jnp.transpose(x, perm)``, lazily (``perm=None`` reverses the axes)."""
    v = as_view(x, "transpose(x)")
    return Transpose(v, tuple(reversed(range(v.ndim))) if perm is None else perm)


def quantize_fp8(x: TreeLeaf, block: tuple[int, int] = (128, 128)) -> tuple[View, View]:
    """``(weights float8_e4m3fn, scale_inv float32)``: block FP8 over the last two axes of ``x``.

    The DeepSeek-V3 / vLLM block format (:mod:`jreshard.views.quant`), bit-exact with
    :func:`quantize_fp8_reference`. Both outputs are destination leaves.
    """
    v = as_view(x, "quantize_fp8(x)")
    return QuantWeights(v, block), QuantScales(v, block)


def has_views(x: TreeLeaf) -> bool:
    """Whether the pytree ``x`` has a view among its leaves (then ``jreshard.views.transfer`` moves it).

    Example:
      >>> import numpy as np
      >>> has_views({"a": np.zeros(2)}), has_views({"a": astype(np.zeros(2, np.float32), "bfloat16")})
      (False, True)
    """
    import jax

    return any(isinstance(leaf, View) for leaf in jax.tree_util.tree_leaves(x, is_leaf=lambda v: isinstance(v, View)))


_LAZY = {"transfer": "jreshard.call.views", "transfer_into": "jreshard.call.views"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jreshard.views' has no attribute {name!r}")
