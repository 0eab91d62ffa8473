"""PyTorch tensors as jreshard destination memory, in a process that has PyTorch and no jax.

Importing this package imports neither jax nor torch; :func:`tensor_dtype` and :func:`tensor_region`
take a ``torch.Tensor`` and read only its dtype, shape, strides, device and ``data_ptr()``.

- :func:`tensor_dtype`: a tensor's dtype by jreshard's (numpy / ml_dtypes) name.
- :func:`tensor_region`: the address and byte length of one box of a tensor, refused unless the box is
  one contiguous run of the tensor's own memory (sizes come from the tensor, never from a dtype's claim).
- :func:`host_bytes`: a CPU tensor's memory as a writable numpy ``uint8`` array over the same bytes (no
  copy), the buffer form jreshard's CPU engine writes into.
- :class:`~jreshard.torch.receiver.Receiver` (``jreshard.torch.Receiver``, loaded on first use): a process of
  a refit group's receiving side whose parameters are PyTorch tensors.

CUDA tensors give their device address the same way; that path is not run on GPU.
"""

from typing import Any

from jreshard.torch.tensors import TORCH_DTYPES as TORCH_DTYPES
from jreshard.torch.tensors import host_bytes as host_bytes
from jreshard.torch.tensors import tensor_dtype as tensor_dtype
from jreshard.torch.tensors import tensor_region as tensor_region

__all__ = ["TORCH_DTYPES", "Receiver", "Shard", "host_bytes", "tensor_dtype", "tensor_region"]


def __getattr__(name: str) -> Any:
    if name in ("Receiver", "Shard"):
        import importlib

        return getattr(importlib.import_module("jreshard.torch.receiver"), name)
    raise AttributeError(f"module 'jreshard.torch' has no attribute {name!r}")
