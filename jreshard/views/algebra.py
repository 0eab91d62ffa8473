"""Views: lazy, composable index maps from an inference-side tensor to trainer leaves.

A view never holds data. Asked for a box of its own coordinates
(:meth:`View.regions`), it answers with :class:`Mapped` regions: each is an affine
image of one box of one source leaf, a permutation of axes and shifts, with the
cast chain met on the way. Composition is recursion: each constructor turns the
regions of its operands into regions of its own coordinates. Nothing here imports
jax or touches an array.

An affine region reads: destination axis ``d`` (``box.lo[d] .. box.hi[d]``) runs
along source axis ``axes[d]`` from ``src_lo[axes[d]]``; ``axes[d] == -1`` is a new
axis of extent 1 (from ``stack``); source axes no destination axis runs along have
extent 1, at ``src_lo`` (from an integer index).
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

from jreshard.options import as_int
from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import dtype_name
from jreshard.types import Array, NumpyIndex, TreeLeaf
from jreshard.views.casts import check_cast_dtype

__all__ = ["Cast", "Concat", "Index", "Leaf", "Mapped", "Reshape", "Stack", "Transpose", "View", "as_view"]


@dataclasses.dataclass(frozen=True, slots=True)
class Mapped:
    """A region of a view: ``box`` (view coordinates) is an affine image of a box of ``leaf``.

    Attributes:
      box: the region, in the view's global coordinates.
      leaf: the source leaf.
      src_lo: per source axis, the source index of ``box.lo``.
      axes: per view axis, the source axis it runs along, or -1 (a new axis of extent 1).
      chain: the casts met from the leaf to the view, in order.
    """

    box: Box
    leaf: Leaf
    src_lo: tuple[int, ...]
    axes: tuple[int, ...]
    chain: tuple[str, ...]

    def src_box(self) -> Box:
        """The box of the leaf this region reads."""
        hi = [v + 1 for v in self.src_lo]
        for d, a in enumerate(self.axes):
            if a >= 0:
                hi[a] = self.src_lo[a] + self.box.hi[d] - self.box.lo[d]
        return Box(self.src_lo, tuple(hi))

    def restrict_src(self, sub: Box) -> Mapped:
        """The part of this region that reads ``sub`` (a box inside :meth:`src_box`)."""
        lo, hi = list(self.box.lo), list(self.box.hi)
        for d, a in enumerate(self.axes):
            if a >= 0:
                lo[d] = self.box.lo[d] + sub.lo[a] - self.src_lo[a]
                hi[d] = lo[d] + sub.hi[a] - sub.lo[a]
        return Mapped(Box(tuple(lo), tuple(hi)), self.leaf, sub.lo, self.axes, self.chain)

    def restrict(self, sub: Box) -> Mapped:
        """The part of this region inside ``sub`` (view coordinates, inside ``box``)."""
        src = list(self.src_lo)
        for d, a in enumerate(self.axes):
            if a >= 0:
                src[a] += sub.lo[d] - self.box.lo[d]
        return Mapped(sub, self.leaf, tuple(src), self.axes, self.chain)

    def moved(self, box: Box, axes: tuple[int, ...]) -> Mapped:
        return Mapped(box, self.leaf, self.src_lo, axes, self.chain)


class View(abc.ABC):
    """A lazy tensor: a shape, a dtype, and how each of its boxes maps onto source leaves (abstract).

    Final implementations: :class:`Leaf`, :class:`Cast`, :class:`Transpose`, :class:`Index`,
    :class:`Reshape`, :class:`Stack`, :class:`Concat`, and the two outputs of block quantisation.
    """

    shape: tuple[int, ...]
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @abc.abstractmethod
    def regions(self, box: Box) -> list[Mapped]:
        """``box`` (view coordinates) as disjoint affine regions of source leaves, covering it."""

    @abc.abstractmethod
    def operands(self) -> tuple[View, ...]:
        """The views this one is built from."""

    @abc.abstractmethod
    def signature(self, leaf_key: Callable[..., object]) -> tuple:
        """A hashable description of the composition, leaves replaced by ``leaf_key(leaf)``."""

    def leaves(self) -> list[Leaf]:
        """The source leaves, each source once (two leaves over one array are one), in first-use order."""
        out: dict[int, Leaf] = {}
        stack: list[View] = [self]
        while stack:
            v = stack.pop()
            if isinstance(v, Leaf):
                out.setdefault(id(v.source), v)
            stack.extend(reversed(v.operands()))
        return list(out.values())

    def __getitem__(self, index: NumpyIndex) -> View:
        return Index(self, index)

    def astype(self, dtype: object) -> View:
        return self if dtype_name(dtype) == self.dtype else Cast(self, dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"


class Leaf(View):
    """A source leaf: a ``jax.Array``, a ``jax.ShapeDtypeStruct`` with a sharding, or a
    :class:`~jreshard.Layout` (for planning without arrays). Leaves over the same object
    (by identity) are the same source."""

    __slots__ = ("dtype", "shape", "source")

    def __init__(self, source: Array):
        shape = getattr(source, "shape", None)
        dtype = getattr(source, "dtype", None)
        if shape is None or dtype is None:
            raise TypeError(f"a view leaf needs an array, a ShapeDtypeStruct or a Layout; got {type(source).__name__}")
        self.source, self.shape, self.dtype = source, tuple(int(n) for n in shape), dtype_name(dtype)

    def regions(self, box: Box) -> list[Mapped]:
        return [Mapped(box, self, box.lo, tuple(range(self.ndim)), ())]

    def operands(self) -> tuple[View, ...]:
        return ()

    def signature(self, leaf_key: Callable[..., object]) -> tuple:
        return ("leaf", leaf_key(self))


def as_view(x: TreeLeaf, what: str = "x") -> View:
    """``x`` itself when it is a view, else a :class:`Leaf` over it."""
    if isinstance(x, View):
        return x
    try:
        return Leaf(x)
    except TypeError as err:
        raise TypeError(f"{what}: {err}") from None


class Cast(View):
    """``x`` cast to ``dtype`` (``jnp.astype`` semantics, :mod:`jreshard.views.casts`)."""

    __slots__ = ("dtype", "shape", "x")

    def __init__(self, x: View, dtype: object):
        check_cast_dtype(x.dtype, "astype: the operand's dtype")
        self.x, self.shape, self.dtype = x, x.shape, check_cast_dtype(dtype, "astype(dtype=...)")

    def regions(self, box: Box) -> list[Mapped]:
        return [dataclasses.replace(m, chain=(*m.chain, self.dtype)) for m in self.x.regions(box)]

    def operands(self) -> tuple[View, ...]:
        return (self.x,)

    def signature(self, leaf_key: Callable[..., object]) -> tuple:
        return ("cast", self.dtype, self.x.signature(leaf_key))


def _int(value: object, what: str) -> int:
    """``value`` as a Python int where ``jax.numpy`` takes it as one (any integer type), or the TypeError it raises
    for a float or a string: a view never rounds an axis or an extent."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{what}={value!r}: expected an integer (as jax.numpy takes it), not a float or string"
        ) from None


def _ints(values: Any, what: str) -> tuple[int, ...]:
    """:func:`_int` of each of ``values``, naming them all."""
    try:
        return tuple(operator.index(v) for v in values)
    except TypeError:
        raise TypeError(
            f"{what}={values!r}: expected integers (as jax.numpy takes them), not floats or strings"
        ) from None


class Transpose(View):
    """Axis ``d`` of the result is axis ``perm[d]`` of ``x`` (``jnp.transpose``)."""

    __slots__ = ("dtype", "perm", "shape", "x")

    def __init__(self, x: View, perm: Sequence[int]):
        perm = _ints(perm, "transpose: perm")
        if sorted(perm) != list(range(x.ndim)):
            raise ValueError(f"transpose: perm={perm} is not a permutation of the {x.ndim} axes of shape {x.shape}")
        self.x, self.perm, self.dtype = x, perm, x.dtype
        self.shape = tuple(x.shape[p] for p in perm)

    def regions(self, box: Box) -> list[Mapped]:
        inner = [0] * self.ndim
        for d, p in enumerate(self.perm):
            inner[p] = d
        lo = tuple(box.lo[inner[p]] for p in range(self.ndim))
        hi = tuple(box.hi[inner[p]] for p in range(self.ndim))
        out = []
        for m in self.x.regions(Box(lo, hi)):
            b = Box(tuple(m.box.lo[p] for p in self.perm), tuple(m.box.hi[p] for p in self.perm))
            out.append(m.moved(b, tuple(m.axes[p] for p in self.perm)))
        return out

    def operands(self) -> tuple[View, ...]:
        return (self.x,)

    def signature(self, leaf_key: Callable[..., object]) -> tuple:
        return ("transpose", self.perm, self.x.signature(leaf_key))


class Index(View):
    """A static index of ``x``: integers (which drop their axis), unit-step slices and ``...``."""

    __slots__ = ("dtype", "keep", "shape", "spans", "x")

    def __init__(self, x: View, index: NumpyIndex):
        items = index if isinstance(index, tuple) else (index,)
        if sum(i is Ellipsis for i in items) > 1:
            raise IndexError(f"index {index!r}: at most one Ellipsis")
        if Ellipsis in items:
            at = items.index(Ellipsis)
            items = items[:at] + (slice(None),) * (x.ndim - len(items) + 1) + items[at + 1 :]
        if len(items) > x.ndim:
            raise IndexError(f"index {index!r} has {len(items)} entries but the view has shape {x.shape}")
        items = items + (slice(None),) * (x.ndim - len(items))
        spans, keep = [], []
        for d, (it, n) in enumerate(zip(items, x.shape, strict=True)):
            if isinstance(it, slice):
                start, stop, step = it.indices(n)
                if step != 1:
                    raise IndexError(f"index {index!r}: views take unit-step slices only, got step {step} on axis {d}")
                spans.append((start, max(start, stop)))
                keep.append(True)
            elif (k := as_int(it)) is not None:  # an integer of any type (numpy's too); a bool is a mask in jax
                if not -n <= k < n:
                    raise IndexError(f"index {index!r}: {k} is out of range for axis {d} of size {n}")
                spans.append((k % n, k % n + 1))
                keep.append(False)
            else:
                raise IndexError(f"index {index!r}: views take ints, unit-step slices and ..., not {it!r}")
        self.x, self.spans, self.keep, self.dtype = x, tuple(spans), tuple(keep), x.dtype
        self.shape = tuple(b - a for (a, b), k in zip(spans, keep, strict=True) if k)

    def regions(self, box: Box) -> list[Mapped]:
        lo, hi, j = [], [], 0
        for (a, _), k in zip(self.spans, self.keep, strict=True):
            if k:
                lo.append(a + box.lo[j])
                hi.append(a + box.hi[j])
                j += 1
            else:
                lo.append(a)
                hi.append(a + 1)
        out = []
        kept = [d for d, k in enumerate(self.keep) if k]
        for m in self.x.regions(Box(tuple(lo), tuple(hi))):
            b = Box(
                tuple(m.box.lo[d] - self.spans[d][0] for d in kept),
                tuple(m.box.hi[d] - self.spans[d][0] for d in kept),
            )
            out.append(m.moved(b, tuple(m.axes[d] for d in kept)))
        return out

    def operands(self) -> tuple[View, ...]:
        return (self.x,)

    def signature(self, leaf_key: Callable[..., object]) -> tuple:
        return ("index", self.spans, self.keep, self.x.signature(leaf_key))


def _same_dtype(parts: Sequence[View], what: str) -> str:
    dtypes = sorted({p.dtype for p in parts})
    if len(dtypes) != 1:
        raise TypeError(f"{what}: the parts have dtypes {dtypes}; cast them to one with astype first")
    return dtypes[0]


class Stack(View):
    """``jnp.stack(parts, axis)``: a new axis ``axis`` whose index ``i`` is part ``i``."""

    __slots__ = ("axis", "dtype", "parts", "shape")

    def __init__(self, parts: Sequence[View], axis: int = 0):
        parts = tuple(parts)
        if not parts:
            raise ValueError("stack: needs at least one part")
        shapes = sorted({p.shape for p in parts})
        if len(shapes) != 1:
            raise ValueError(f"stack: the parts have shapes {shapes}; they must be equal")
        nd = parts[0].ndim + 1
        axis = _int(axis, "stack: axis")
        if not -nd <= axis < nd:
            raise ValueError(f"stack: axis={axis} is out of range for {nd}-d results")
        self.parts, self.axis, self.dtype = parts, axis % nd, _same_dtype(parts, "stack")
        s = parts[0].shape
        self.shape = (*s[: self.axis], len(parts), *s[self.axis :])

    def regions(self, box: Box) -> list[Mapped]:
        a, out = self.axis, []
        inner = Box(box.lo[:a] + box.lo[a + 1 :], box.hi[:a] + box.hi[a + 1 :])
        for i in range(box.lo[a], box.hi[a]):
            for m in self.parts[i].regions(inner):
                b = Box((*m.box.lo[:a], i, *m.box.lo[a:]), (*m.box.hi[:a], i + 1, *m.box.hi[a:]))
                out.append(m.moved(b, (*m.axes[:a], -1, *m.axes[a:])))
        return out

    def operands(self) -> tuple[View, ...]:
        return self.parts

    def signature(self, leaf_key: Callable[..., object]) -> tuple:
        return ("stack", self.axis, tuple(p.signature(leaf_key) for p in self.parts))


class Concat(View):
    """``parts`` concatenated along ``axis`` in ``groups`` interleaved groups.

    Group ``i`` holds the ``i``-th of ``groups`` equal slices of each part, in part
    order; ``groups=1`` is ``jnp.concatenate``. A part may appear more than once.
    """

    __slots__ = ("axis", "dtype", "groups", "parts", "segments", "shape", "starts")

    def __init__(self, parts: Sequence[View], axis: int = 0, groups: int = 1):
        parts = tuple(parts)
        if not parts:
            raise ValueError("concat: needs at least one part")
        axis = _int(axis, "concat: axis")
        nd = parts[0].ndim
        if nd == 0 or not -nd <= axis < nd:
            raise ValueError(f"concat: axis={axis} is out of range for parts of shape {parts[0].shape}")
        axis %= nd
        rest = sorted({p.shape[:axis] + p.shape[axis + 1 :] for p in parts})
        if len(rest) != 1 or any(p.ndim != nd for p in parts):
            raise ValueError(f"concat: parts {[p.shape for p in parts]} differ outside axis {axis}")
        n = as_int(groups)
        if n is None or n < 1 or any(p.shape[axis] % n for p in parts):
            raise ValueError(
                f"concat: groups={groups!r} must be a positive integer dividing every part's axis {axis} "
                f"(sizes {[p.shape[axis] for p in parts]})"
            )
        groups = n
        self.parts, self.axis, self.groups, self.dtype = parts, axis, groups, _same_dtype(parts, "concat")
        segs, start = [], 0  # (start in the result, length, part, start in the part)
        for g in range(groups):
            for i, p in enumerate(parts):
                n = p.shape[axis] // groups
                if n:
                    segs.append((start, n, i, g * n))
                start += n
        self.segments, self.starts = tuple(segs), [s[0] for s in segs]
        self.shape = (*parts[0].shape[:axis], start, *parts[0].shape[axis + 1 :])

    def regions(self, box: Box) -> list[Mapped]:
        a, out = self.axis, []
        lo, hi = box.lo[a], box.hi[a]
        k = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while k < len(self.segments) and self.segments[k][0] < hi:
            start, n, i, off = self.segments[k]
            k += 1
            s_lo, s_hi = max(lo, start), min(hi, start + n)
            if s_lo >= s_hi:
                continue
            shift = off - start
            inner = Box((*box.lo[:a], s_lo + shift, *box.lo[a + 1 :]), (*box.hi[:a], s_hi + shift, *box.hi[a + 1 :]))
            for m in self.parts[i].regions(inner):
                b = Box(
                    (*m.box.lo[:a], m.box.lo[a] - shift, *m.box.lo[a + 1 :]),
                    (*m.box.hi[:a], m.box.hi[a] - shift, *m.box.hi[a + 1 :]),
                )
                out.append(m.moved(b, m.axes))
        return out

    def operands(self) -> tuple[View, ...]:
        return self.parts

    def signature(self, leaf_key: Callable[..., object]) -> tuple:
        return ("concat", self.axis, self.groups, tuple(p.signature(leaf_key) for p in self.parts))


def _reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """The axes of ``src`` and ``dst`` cut into consecutive groups of equal element counts.

    A row-major reshape maps each group's flat range onto itself: group ``(ins, outs)`` holds
    source axes ``ins`` and result axes ``outs``. Axes of extent 1 join the next group (or
    form the last one), so a side may be empty where all its axes have extent 1.
    """
    if math.prod(src) == 0:
        return ((tuple(range(len(src))), tuple(range(len(dst)))),)
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        ins, outs, pi, pj = [], [], 1, 1
        while i < len(src) and src[i] == 1:
            ins.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1:
            outs.append(j)
            j += 1
        if i < len(src) and j < len(dst):
            ins.append(i)
            outs.append(j)
            pi, pj, i, j = src[i], dst[j], i + 1, j + 1
            while pi != pj:
                if pi < pj:
                    ins.append(i)
                    pi, i = pi * src[i], i + 1
                else:
                    outs.append(j)
                    pj, j = pj * dst[j], j + 1
        groups.append((tuple(ins), tuple(outs)))
    return tuple(groups)


class Reshape(View):
    """``jnp.reshape(x, shape)``: the same elements in row-major order, regrouped into other axes.

    Each region of the result is a run along the innermost source axis of its group (the
    other axes of the group fixed), so a box of the result reads at most one region per row
    of the group's innermost axes: merging ``(heads, head_dim)`` into one axis costs one
    region per head, never a gathered copy.
    """

    __slots__ = ("dtype", "groups", "shape", "x")

    def __init__(self, x: View, shape: Sequence[int]):
        dims = list(_ints(shape, "reshape: shape"))
        if dims.count(-1) > 1 or any(n < -1 for n in dims):
            raise ValueError(f"reshape: shape={tuple(shape)} has a negative extent (at most one -1 is inferred)")
        if -1 in dims:
            known = math.prod(n for n in dims if n != -1)
            if known == 0 or x.size % known:
                raise ValueError(f"reshape: cannot infer the -1 of shape={tuple(shape)} from {x.size} elements")
            dims[dims.index(-1)] = x.size // known
        if math.prod(dims) != x.size:
            raise ValueError(f"reshape: a view of shape {x.shape} ({x.size} elements) cannot have shape {tuple(dims)}")
        self.x, self.dtype, self.shape = x, x.dtype, tuple(dims)
        self.groups = _reshape_groups(x.shape, self.shape)

    def _runs(self, ins: tuple[int, ...], outs: tuple[int, ...], box: Box) -> list[tuple]:
        """One group's runs: ``(source lo, source hi, result index of the outer axes, result start)``."""
        src, dst = [self.x.shape[a] for a in ins], [self.shape[o] for o in outs]
        if not outs:
            return [((0,) * len(ins), (1,) * len(ins), (), 0)]
        if not ins:
            return [((), (), tuple(box.lo[o] for o in outs[:-1]), box.lo[outs[-1]])]
        strides = [math.prod(dst[k + 1 :]) for k in range(len(dst))]
        inner = src[-1]
        lo, hi = box.lo[outs[-1]], box.hi[outs[-1]]
        runs = []
        for idx in itertools.product(*(range(box.lo[o], box.hi[o]) for o in outs[:-1])):
            base = sum(i * st for i, st in zip(idx, strides, strict=False))
            p, end = base + lo, base + hi
            while p < end:
                q0 = p % inner
                n = min(end - p, inner - q0)
                outer = []
                rest = p // inner
                for size in reversed(src[:-1]):
                    rest, r = divmod(rest, size)
                    outer.append(r)
                outer.reverse()
                runs.append(((*outer, q0), (*(v + 1 for v in outer), q0 + n), idx, p - base))
                p += n
        return runs

    def regions(self, box: Box) -> list[Mapped]:
        if any(a >= b for a, b in zip(box.lo, box.hi, strict=True)):
            return []
        out = []
        per_group = [self._runs(ins, outs, box) for ins, outs in self.groups]
        for combo in itertools.product(*per_group):
            lo, hi = [0] * self.x.ndim, [0] * self.x.ndim
            for (ins, _), (r_lo, r_hi, _, _) in zip(self.groups, combo, strict=True):
                for a, v, w in zip(ins, r_lo, r_hi, strict=True):
                    lo[a], hi[a] = v, w
            for m in self.x.regions(Box(tuple(lo), tuple(hi))):
                b_lo, b_hi, axes = [0] * self.ndim, [1] * self.ndim, [-1] * self.ndim
                for (ins, outs), (r_lo, _, idx, start) in zip(self.groups, combo, strict=True):
                    for o, i in zip(outs, idx, strict=False):
                        b_lo[o], b_hi[o] = i, i + 1
                    if outs and ins:
                        a, o = ins[-1], outs[-1]
                        b_lo[o] = start + m.box.lo[a] - r_lo[-1]
                        b_hi[o] = start + m.box.hi[a] - r_lo[-1]
                        axes[o] = m.axes[a]
                    elif outs:
                        b_lo[outs[-1]], b_hi[outs[-1]] = start, start + 1
                out.append(m.moved(Box(tuple(b_lo), tuple(b_hi)), tuple(axes)))
        return out

    def operands(self) -> tuple[View, ...]:
        return (self.x,)

    def signature(self, leaf_key: Callable[..., object]) -> tuple:
        return ("reshape", self.shape, self.x.signature(leaf_key))
