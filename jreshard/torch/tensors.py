"""PyTorch tensors as jreshard destination memory: dtype names, one-run regions of a box, host bytes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jreshard.sharding.box import Box
from jreshard.types import Target

__all__ = ["TORCH_DTYPES", "host_bytes", "tensor_dtype", "tensor_region"]

# torch dtype name (``str(torch.float32)`` without ``torch.``) -> jreshard's dtype name
TORCH_DTYPES = {
    "float32": "float32",
    "float64": "float64",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu",
    "complex64": "complex64",
    "complex128": "complex128",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "uint16": "uint16",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "bool": "bool",
}
# Not here: torch's sub-byte dtypes (int4, float4_e2m1fn_x2, ...) and quantised ones (qint8, ...), whose elements
# are not whole bytes of a plain type.


def tensor_dtype(t: Target) -> str:
    """``t``'s dtype by jreshard's name (``torch.bfloat16`` -> ``"bfloat16"``).

    Raises:
      TypeError: ``t`` is not a tensor, or its dtype has no counterpart here (sub-byte, quantised).
    """
    dtype = getattr(t, "dtype", None)
    name = str(dtype).removeprefix("torch.")
    if dtype is None or not hasattr(t, "data_ptr"):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if name not in TORCH_DTYPES:
        raise TypeError(f"tensor dtype {dtype} has no jreshard counterpart; supported: {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def _box(t: Target, box: Box | None) -> Box:
    shape = tuple(int(n) for n in t.shape)
    if box is None:
        return Box((0,) * len(shape), shape)
    if len(box.lo) != len(shape) or any(not 0 <= a <= b <= n for a, b, n in zip(box.lo, box.hi, shape, strict=True)):
        raise ValueError(f"box {box} is not inside a tensor of shape {shape}")
    return box


def tensor_region(t: Target, box: Box | None = None, *, what: str = "tensor") -> tuple[int, int]:
    """``(address, nbytes)`` of ``box`` of ``t`` (all of ``t`` when ``None``).

    The box must be one contiguous run of ``t``'s memory: ``t`` contiguous, the box of extent 1 on every
    axis before its first longer one and whole on every axis after it (rows ``[a, b)`` of a matrix, part
    of one row, a sub-tensor of whole trailing axes). A tensor that shares its memory with another (tied
    weights) is written through both: declare it once.

    Raises:
      TypeError: ``t`` is not a tensor of a supported dtype;
      ValueError: ``t`` is not contiguous, or ``box`` is outside it or not one contiguous run (the
        message names ``what``, the shape and the box).
    """
    tensor_dtype(t)
    shape = tuple(int(n) for n in t.shape)
    if not t.is_contiguous():
        raise ValueError(f"{what}: a tensor of shape {shape} and strides {tuple(t.stride())} is not contiguous")
    b = _box(t, box)
    sizes = b.shape
    # Row-major: one run iff every axis before the first of extent > 1 has extent 1 and every axis after it is whole.
    k = next((d for d, n in enumerate(sizes) if n != 1), len(sizes))
    if math.prod(sizes) and any(sizes[d] != shape[d] for d in range(k + 1, len(shape))):
        raise ValueError(f"{what}: box {b} of a tensor of shape {shape} is not one contiguous run of its memory")
    item = int(t.element_size())
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    offset = sum(lo * st for lo, st in zip(b.lo, strides, strict=True)) * item
    nbytes = math.prod(sizes) * item
    return int(t.data_ptr()) + offset, nbytes


def host_bytes(t: Target, box: Box | None = None, *, what: str = "tensor") -> np.ndarray:
    """The bytes of ``box`` of CPU tensor ``t`` as a writable numpy ``uint8`` array over ``t``'s memory.

    Raises:
      ValueError: ``t`` is not on the CPU, or what :func:`tensor_region` refuses.
    """
    if str(getattr(t, "device", "cpu")) != "cpu":
        raise ValueError(f"{what}: host_bytes needs a CPU tensor, got one on {t.device}")
    address, nbytes = tensor_region(t, box, what=what)
    base = t.detach().reshape(-1).view(_byte_dtype()).numpy()  # the tensor's own memory, as bytes
    start = address - int(t.data_ptr())
    return base[start : start + nbytes]


def _byte_dtype() -> Any:
    import torch

    return torch.uint8
