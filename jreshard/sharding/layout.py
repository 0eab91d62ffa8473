"""Layout: a tensor's global shape and dtype, and the box each rank holds.

The structured form (what every ``NamedSharding`` has) is a mesh of ranks, axis
names, and for each tensor dimension the tuple of mesh axes that split it, major
to minor. Dimension ``d`` of size ``n`` split by axes of sizes ``(a, b)`` has
``a*b`` blocks of ``n // (a*b)``; the rank at mesh coordinate ``(i, j)`` on those
axes holds block ``i*b + j``. Axes that split no dimension replicate. Ranks whose
boxes are equal form a replica group.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jreshard.errors import IndivisibleError, LayoutError, LayoutJSONError
from jreshard.sharding.box import Box
from jreshard.sharding.caches import cache
from jreshard.sharding.dtypes import dtype_name, numpy_dtype, packed_bits

__all__ = ["Layout", "normalize_spec"]


def normalize_spec(spec: Sequence[object], ndim: int, axis_names: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """One tuple of mesh axis names per tensor dimension (padded with ``()``).

    Raises:
      LayoutError: the spec is longer than the tensor rank, names an axis the
        mesh does not have, or uses an axis twice.
    """
    spec = tuple(spec)
    if len(spec) > ndim:
        raise LayoutError(f"spec={spec} has {len(spec)} entries but the tensor has rank {ndim}")
    out: list[tuple[str, ...]] = []
    seen: dict[str, int] = {}
    for d, entry in enumerate(spec + (None,) * (ndim - len(spec))):
        if entry is None:
            axes: tuple[str, ...] = ()
        elif isinstance(entry, str):
            axes = (entry,)
        elif isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
            axes = tuple(entry)
        else:
            raise LayoutError(
                f"spec={spec}: entry {d} is {entry!r}; expected None, an axis name or a tuple of axis names"
            )
        for a in axes:
            if a not in axis_names:
                raise LayoutError(f"spec={spec} names mesh axis {a!r}, but the mesh axes are {tuple(axis_names)}")
            if a in seen:
                raise LayoutError(
                    f"spec={spec} uses mesh axis {a!r} twice (dimensions {seen[a]} and {d}); "
                    "an axis may split one dimension"
                )
            seen[a] = d
        out.append(axes)
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True, eq=True)
class Layout:
    """A tensor's shape, dtype, and the box held by each rank.

    Args:
      shape: global shape.
      dtype: dtype name (anything numpy or ml_dtypes understands).
      ranks: the ranks holding part of the tensor, in a fixed order.
      boxes: ``boxes[i]`` is the box held by ``ranks[i]``.

    Example:
      >>> import numpy as np
      >>> lay = Layout.from_mesh(np.arange(4).reshape(2, 2), ("dp", "tp"), (None, "tp"), (8, 6), "float32")
      >>> lay.box_of(3)
      Box(lo=(0, 3), hi=(8, 6))
      >>> [ranks for _, ranks in lay.replica_groups()]
      [(0, 2), (1, 3)]
    """

    shape: tuple[int, ...]
    dtype: str
    ranks: tuple[int, ...]
    boxes: tuple[Box, ...]
    _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        shape = tuple(int(n) for n in self.shape)
        if any(n < 0 for n in shape):
            raise LayoutError(f"Layout: shape={shape} has a negative dimension")
        try:
            name = dtype_name(self.dtype)
        except TypeError as err:
            raise LayoutError(f"Layout: dtype={self.dtype!r} is not a known dtype") from err
        bits = packed_bits(numpy_dtype(name))
        if bits is not None:
            # A box of a packed shard can start or end inside a byte: byte ranges cannot describe it.
            raise LayoutError(
                f"Layout: dtype={name} packs {8 // bits} values a byte, and layouts "
                "address whole bytes; jreshard.transfer moves such arrays as one byte a value "
                "(jreshard.call.repack), and plans describe them as uint8"
            )
        ranks = tuple(int(r) for r in self.ranks)
        boxes = tuple(self.boxes)
        if len(ranks) != len(boxes):
            raise LayoutError(f"Layout: {len(ranks)} ranks but {len(boxes)} boxes")
        if not ranks:
            raise LayoutError("Layout: needs at least one rank")
        if len(set(ranks)) != len(ranks):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise LayoutError(f"Layout: ranks={ranks} lists ranks {dup} more than once")
        if any(r < 0 for r in ranks):
            raise LayoutError(f"Layout: ranks must be >= 0, got {ranks}")
        full = Box.full(shape)
        for r, b in zip(ranks, boxes, strict=True):
            if not isinstance(b, Box):
                raise LayoutError(f"Layout: box of rank {r} is {b!r}, not a Box")
            if b.ndim != len(shape) or not full.contains(b):
                raise LayoutError(f"Layout: box {b} of rank {r} does not fit in shape={shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", name)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "boxes", boxes)
        object.__setattr__(self, "_hash", hash((shape, name, ranks, boxes)))

    def __hash__(self) -> int:
        return self._hash

    # ----- constructors -------------------------------------------------
    @classmethod
    def from_boxes(cls, shape: Sequence[int], dtype: object, boxes: Mapping[int, Box]) -> Layout:
        """Explicit, possibly uneven, boxes (from a producer outside JAX).

        Ranks are kept in ascending order.
        """
        ranks = tuple(sorted(int(r) for r in boxes))
        return cls(tuple(shape), dtype, ranks, tuple(boxes[r] for r in ranks))  # type: ignore[arg-type]

    @classmethod
    def from_mesh(
        cls,
        mesh: np.ndarray | Sequence,
        axis_names: Sequence[str],
        spec: Sequence[object],
        shape: Sequence[int],
        dtype: object,
    ) -> Layout:
        """The structured form: a mesh of ranks, its axis names and a partition spec.

        Args:
          mesh: an integer array of ranks, one axis per name in ``axis_names``.
          axis_names: the mesh axis names.
          spec: per tensor dimension, ``None``, an axis name, or a tuple of axis
            names (major to minor); shorter than the tensor rank means trailing ``None``.
          shape: the global tensor shape.
          dtype: the element dtype.

        Raises:
          LayoutError: bad axes or ranks; IndivisibleError: a dimension is not
            divisible by the product of the axes that split it.
        """
        mesh = np.asarray(mesh)
        axis_names = tuple(axis_names)
        shape = tuple(int(n) for n in shape)
        if mesh.ndim != len(axis_names):
            raise LayoutError(f"mesh has {mesh.ndim} dimensions but axis_names={axis_names}")
        if len(set(axis_names)) != len(axis_names):
            raise LayoutError(f"axis_names={axis_names} repeats a name")
        axes = normalize_spec(spec, len(shape), axis_names)
        sizes = dict(zip(axis_names, mesh.shape, strict=True))
        coords = np.indices(mesh.shape).reshape(mesh.ndim, -1)  # (mesh.ndim, n_ranks)
        flat = mesh.reshape(-1)
        lo = np.zeros((flat.size, len(shape)), dtype=np.int64)
        hi = np.zeros((flat.size, len(shape)), dtype=np.int64)
        for d, (n, dim_axes) in enumerate(zip(shape, axes, strict=True)):
            nblocks = math.prod(sizes[a] for a in dim_axes)
            if n % nblocks:
                raise IndivisibleError(
                    f"dimension {d} of shape={shape} has size {n}, not divisible by the "
                    f"{nblocks} blocks of mesh axes {dim_axes} (sizes {[sizes[a] for a in dim_axes]}); "
                    f"the fix is to pad the dimension to a multiple of {nblocks} or shard it over fewer axes"
                )
            block = np.zeros(flat.size, dtype=np.int64)
            for a in dim_axes:  # major to minor: block = i*b + j
                block = block * sizes[a] + coords[axis_names.index(a)]
            step = n // nblocks
            lo[:, d] = block * step
            hi[:, d] = block * step + step
        ranks = tuple(int(r) for r in flat)
        boxes = tuple(Box(tuple(lo[i]), tuple(hi[i])) for i in range(flat.size))
        return cls(shape, dtype, ranks, boxes)  # type: ignore[arg-type]

    @classmethod
    def from_sharding(cls, sharding: object, shape: Sequence[int], dtype: object, rank_of: object = None) -> Layout:
        """The layout a ``jax.sharding.Sharding`` gives a tensor of ``shape`` and ``dtype``.

        A device's rank is ``device.id`` unless ``rank_of(device)`` says otherwise.
        Agrees with ``sharding.devices_indices_map(shape)`` for every device.

        Example:
          >>> import jax
          >>> from jax.sharding import NamedSharding, PartitionSpec as P
          >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices()[:8])
          >>> lay = Layout.from_sharding(NamedSharding(mesh, P(None, "tp")), (4, 8), "float32")
          >>> lay.box_of(5)
          Box(lo=(0, 2), hi=(4, 4))
        """
        shape = tuple(int(n) for n in shape)
        if rank_of is None:
            return _from_sharding(sharding, shape, dtype_name(dtype))
        return _build_from_sharding(sharding, shape, dtype_name(dtype), rank_of)

    @classmethod
    def replicated(cls, ranks: Sequence[int], shape: Sequence[int], dtype: object) -> Layout:
        """Every rank holds the whole tensor."""
        full = Box.full(shape)
        return cls(tuple(shape), dtype, tuple(ranks), (full,) * len(ranks))  # type: ignore[arg-type]

    # ----- queries ------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return numpy_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def np_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)

    def box_of(self, rank: int) -> Box:
        """The box ``rank`` holds; ``KeyError`` if it holds none."""
        return self._index()[rank]

    def _index(self) -> dict[int, Box]:
        return _rank_index(self)

    def replica_groups(self) -> tuple[tuple[Box, tuple[int, ...]], ...]:
        """Distinct boxes (sorted) and the ranks (ascending) that hold each."""
        return _replica_groups(self)

    # ----- JSON ---------------------------------------------------------
    def to_json(self) -> str:
        """Serialize; ``Layout.from_json(lay.to_json()) == lay``."""
        return json.dumps(
            {
                "shape": list(self.shape),
                "dtype": self.dtype,
                "ranks": list(self.ranks),
                "boxes": [b.to_json() for b in self.boxes],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        """Parse a layout written by :meth:`to_json`.

        Raises:
          LayoutJSONError: the text is not a serialized layout.
        """
        try:
            obj = json.loads(text)
            boxes = tuple(Box(tuple(lo), tuple(hi)) for lo, hi in obj["boxes"])
            return cls(tuple(obj["shape"]), obj["dtype"], tuple(obj["ranks"]), boxes)
        except LayoutError as err:
            raise LayoutJSONError(f"Layout.from_json: {err}") from err
        except (ValueError, KeyError, TypeError) as err:
            raw = text.decode("utf-8", "replace") if isinstance(text, (bytes, bytearray)) else str(text)
            shown = raw if len(raw) < 200 else raw[:200] + "..."
            raise LayoutJSONError(f"Layout.from_json: cannot parse {shown!r}: {err}") from err


@cache(max_size=4096)
def _rank_index(lay: Layout) -> dict[int, Box]:
    return dict(zip(lay.ranks, lay.boxes, strict=True))


@cache(max_size=4096)
def _replica_groups(lay: Layout) -> tuple[tuple[Box, tuple[int, ...]], ...]:
    # Keyed by the bounds (tuples hash and compare in C; boxes order like their (lo, hi)).
    by_box: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Box, list[int]]] = {}
    for r, b in zip(lay.ranks, lay.boxes, strict=True):
        got = by_box.get((b.lo, b.hi))
        if got is None:
            by_box[(b.lo, b.hi)] = (b, [r])
        else:
            got[1].append(r)
    return tuple((b, tuple(sorted(rs))) for _, (b, rs) in sorted(by_box.items(), key=lambda kv: kv[0]))


@cache(max_size=8192)
def _from_sharding(sharding: object, shape: tuple[int, ...], dtype: str) -> Layout:
    return _build_from_sharding(sharding, shape, dtype, None)


def _build_from_sharding(sharding: object, shape: tuple[int, ...], dtype: str, rank_of: object) -> Layout:
    from jreshard.sharding.jax import MeshForm, describe_sharding  # the one module that imports jax

    form = describe_sharding(sharding, shape, rank_of)  # type: ignore[arg-type]
    if isinstance(form, MeshForm):
        return Layout.from_mesh(form.ranks, form.axis_names, form.spec, shape, dtype)
    return Layout.from_boxes(shape, dtype, form)
