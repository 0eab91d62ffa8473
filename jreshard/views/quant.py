"""Block FP8 quantisation (DeepSeek-V3 and vLLM block-FP8 format), and its numpy reference.

A matrix ``x`` of ``[..., m, n]`` is cut into blocks of ``block = (bm, bn)``
elements over its last two axes (the last row and column of blocks may be
partial). Each block ``b`` has ``scale_inv[b] = max(amax(b), EPS) / 448`` in
float32 (448 is the largest ``float8_e4m3fn``), and its weights are
``float8_e4m3fn(clip(x / scale_inv[b], -448, 448))``: the division in float32,
then round to nearest even. ``x ~= weights * scale_inv`` blockwise is how the
inference engine reads them back. ``x`` is first cast to float32 like
``jnp.astype``. ``EPS`` keeps an all-zero block finite (its weights are zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from jreshard.options import as_int
from jreshard.sharding.box import Box
from jreshard.views.algebra import Mapped, View
from jreshard.views.casts import cast

__all__ = ["EPS", "FP8_MAX", "QuantScales", "QuantView", "QuantWeights", "quantize_fp8_reference", "scale_shape"]

FP8_MAX = 448.0
EPS = 1e-12


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of ``scale_inv`` for weights of ``shape``."""
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def quantize_fp8_reference(x: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """``(weights float8_e4m3fn, scale_inv float32)`` of ``x`` (module docstring), in numpy.

    Example:
      >>> w, s = quantize_fp8_reference(np.array([[1.0, -2.0], [0.5, 448.0]], np.float32), (1, 2))
      >>> s.tolist(), w.astype(np.float32).tolist()
      ([[0.004464285913854837], [1.0]], [[224.0, -448.0], [0.5, 448.0]])
    """
    xf = cast(np.asarray(x), "float32")
    m, n = xf.shape[-2:]
    bm, bn = block
    pm, pn = -(-m // bm) * bm, -(-n // bn) * bn
    padded = np.zeros((*xf.shape[:-2], pm, pn), np.float32)
    padded[..., :m, :n] = np.abs(xf)
    blocks = padded.reshape((*xf.shape[:-2], pm // bm, bm, pn // bn, bn))
    amax = blocks.max(axis=(-3, -1))
    scale = (np.maximum(amax, np.float32(EPS)) / np.float32(FP8_MAX)).astype(np.float32)
    full = np.repeat(np.repeat(scale, bm, axis=-2), bn, axis=-1)[..., :m, :n]
    with np.errstate(all="ignore"):
        q = np.clip(xf / full, -FP8_MAX, FP8_MAX)
    return cast(q.astype(np.float32), "float8_e4m3fn"), scale


class QuantView(View):
    """One output of ``quantize_fp8(x, block)`` (abstract): not composable further, a destination leaf."""

    __slots__ = ("block", "dtype", "shape", "x")
    part: str

    def __init__(self, x: View, block: tuple[int, int]):
        if x.ndim < 2:
            raise ValueError(f"quantize_fp8: x must have at least 2 axes, got shape {x.shape}")
        sizes = [as_int(b) for b in block] if len(block) == 2 else []
        if len(sizes) != 2 or any(b is None or b < 1 for b in sizes):
            raise ValueError(f"quantize_fp8: block={block} must be two positive integers")
        self.x, self.block = x, (int(sizes[0] or 0), int(sizes[1] or 0))

    def regions(self, box: Box) -> list[Mapped]:
        raise TypeError(
            "quantize_fp8's outputs are destination leaves: transfer them, do not compose them with other views"
        )

    def operands(self) -> tuple[View, ...]:
        return (self.x,)

    def signature(self, leaf_key: Callable[..., object]) -> tuple:
        return ("fp8", self.part, self.block, self.x.signature(leaf_key))

    def hull(self, box: Box) -> Box:
        """The box of ``x`` whose blocks this output's ``box`` needs: whole blocks, clipped to ``x``."""
        raise NotImplementedError

    def compute(self, tile: np.ndarray, hull: Box, box: Box) -> np.ndarray:
        """This output over ``box``, from ``tile``, the values of ``x`` over ``hull``."""
        w, s = quantize_fp8_reference(tile, self.block)
        out = w if self.part == "weights" else s
        first = self._first(hull)
        return out[tuple(slice(a - f, b - f) for a, b, f in zip(box.lo, box.hi, first, strict=True))]

    def _first(self, hull: Box) -> tuple[int, ...]:
        raise NotImplementedError


class QuantWeights(QuantView):
    """The ``float8_e4m3fn`` weights of ``quantize_fp8(x, block)`` (final)."""

    part = "weights"

    def __init__(self, x: View, block: tuple[int, int]):
        super().__init__(x, block)
        self.shape, self.dtype = x.shape, "float8_e4m3fn"

    def hull(self, box: Box) -> Box:
        lo, hi = list(box.lo), list(box.hi)
        for k, b in zip((-2, -1), self.block, strict=True):
            lo[k] = lo[k] // b * b
            hi[k] = min(-(-hi[k] // b) * b, self.shape[k]) if hi[k] > lo[k] else lo[k]
        return Box(tuple(lo), tuple(hi))

    def _first(self, hull: Box) -> tuple[int, ...]:
        return hull.lo


class QuantScales(QuantView):
    """The float32 ``scale_inv`` of ``quantize_fp8(x, block)``: one per block (final)."""

    part = "scales"

    def __init__(self, x: View, block: tuple[int, int]):
        super().__init__(x, block)
        self.shape, self.dtype = scale_shape(x.shape, self.block), "float32"

    def hull(self, box: Box) -> Box:
        lo, hi = list(box.lo), list(box.hi)
        for k, b in zip((-2, -1), self.block, strict=True):
            lo[k], hi[k] = box.lo[k] * b, min(box.hi[k] * b, self.x.shape[k])
        return Box(tuple(lo), tuple(hi))

    def _first(self, hull: Box) -> tuple[int, ...]:
        return (*hull.lo[:-2], hull.lo[-2] // self.block[0], hull.lo[-1] // self.block[1])


def blocks_in(box: Box, block: tuple[int, int]) -> int:
    """How many blocks of ``block`` the box covers (it is block-aligned or clipped at the edge)."""
    return math.prod(box.shape[:-2]) * -(-box.shape[-2] // block[0]) * -(-box.shape[-1] // block[1])
