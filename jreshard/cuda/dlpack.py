"""The DLPack hand-over from CuPy to JAX on CUDA GPUs, for :class:`~jreshard.cuda.buffers.CupyBuffers`.
Not run on GPU.

:class:`Typed` hands JAX a CuPy destination buffer re-typed to its real DLPack type (bfloat16,
float8_*), exported with JAX's stream from inside ``with stream:``, so JAX's stream waits for the
kernels that filled it. The other way, :class:`~jreshard.engine.buffers.Capsule` hands CuPy a
re-typed capsule of a source shard.
"""

from __future__ import annotations

from typing import Any

from jreshard.engine.buffers import KDLCUDA, retype_capsule
from jreshard.types import CudaStream, CupyArray, CupyModule, DLPackCapsule

__all__ = ["Typed"]


class Typed:
    """A CuPy array re-typed for JAX: exports with the consumer's stream, after ``stream``'s work."""

    __slots__ = ("_array", "_bits", "_code", "_cuda", "_ordinal", "_stream")

    def __init__(self, array: CupyArray, code: int, bits: int, stream: CudaStream, ordinal: int, cuda: CupyModule):
        self._array, self._code, self._bits, self._stream, self._ordinal = array, code, bits, stream, ordinal
        self._cuda = cuda

    def __dlpack__(self, stream: CudaStream = None, **kwargs: Any) -> DLPackCapsule:
        # CuPy refuses to enter a stream of another device than the current one.
        with self._cuda.Device(self._ordinal), self._stream:  # the consumer's stream waits on this one
            capsule = self._array.__dlpack__(stream=stream)
        return retype_capsule(capsule, self._code, self._bits)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDLCUDA, self._ordinal)
