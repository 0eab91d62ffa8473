"""jax shardings to layouts: the only module of ``jreshard.sharding`` that imports jax.

A ``NamedSharding`` takes the structured fast path (its mesh, axis names and
``PartitionSpec`` give every box with numpy arithmetic); any other
``jax.sharding.Sharding`` goes through ``devices_indices_map``. A device's rank
is ``device.id`` unless ``rank_of`` says otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jreshard.errors import LayoutError
from jreshard.sharding.box import Box
from jreshard.sharding.dtypes import dtype_name
from jreshard.sharding.layout import Layout

__all__ = ["layout_from_sharding"]


def _device_rank(d: jax.Device) -> int:
    return int(d.id)


@functools.lru_cache(maxsize=8192)
def _cached(sharding: jax.sharding.Sharding, shape: tuple[int, ...], dtype: str) -> Layout:
    return _build(sharding, shape, dtype, _device_rank)


def layout_from_sharding(
    sharding: jax.sharding.Sharding,
    shape: Sequence[int],
    dtype: object,
    rank_of: Callable[[jax.Device], int] | None = None,
) -> Layout:
    """The layout a jax sharding gives a tensor of ``shape`` and ``dtype``.

    Args:
      sharding: any ``jax.sharding.Sharding``.
      shape: the global shape.
      dtype: the dtype.
      rank_of: maps a device to its rank; default ``device.id``.

    Raises:
      LayoutError: the spec names unknown axes or uses one twice;
      IndivisibleError: a dimension is not divisible by its mesh axes.
    """
    shape = tuple(int(n) for n in shape)
    name = dtype_name(dtype)
    if rank_of is None:
        return _cached(sharding, shape, name)
    return _build(sharding, shape, name, rank_of)


def _build(sharding: jax.sharding.Sharding, shape: tuple[int, ...], dtype: str, rank_of: Callable) -> Layout:
    if not isinstance(sharding, jax.sharding.Sharding):
        raise LayoutError(f"sharding={sharding!r} is not a jax.sharding.Sharding")
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        ranks = np.vectorize(rank_of, otypes=[np.int64])(np.asarray(mesh.devices)) if mesh.devices.size else None
        spec = tuple(sharding.spec)
        if ranks is not None and all(e is None or isinstance(e, (str, tuple)) for e in spec):
            return Layout.from_mesh(ranks, tuple(mesh.axis_names), spec, shape, dtype)
    # The general path: ask jax for every device's index.
    try:
        index_map = sharding.devices_indices_map(shape)
    except ValueError as err:
        raise LayoutError(f"sharding {sharding} cannot hold a tensor of shape={shape}: {err}") from err
    boxes = {rank_of(d): Box.from_slices(idx, shape) for d, idx in index_map.items()}
    return Layout.from_boxes(shape, dtype, boxes)
