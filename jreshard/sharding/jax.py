"""jax shardings described in numpy terms: the only module of ``jreshard.sharding`` that imports jax.

A ``NamedSharding`` takes the structured fast path (its mesh of ranks, axis names
and ``PartitionSpec``, from which :meth:`Layout.from_mesh` computes every box
with numpy arithmetic); any other ``jax.sharding.Sharding`` goes through
``devices_indices_map``. A device's rank is ``device.id`` unless ``rank_of``
says otherwise. This module does not import :mod:`jreshard.sharding.layout`:
``Layout.from_sharding`` builds the layout from what :func:`describe_sharding`
returns, so the two modules import in one direction only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jreshard.errors import LayoutError
from jreshard.sharding.box import Box
from jreshard.types import Sharding

__all__ = ["MeshForm", "addressable_order", "describe_sharding"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class MeshForm:
    """The structured form of a ``NamedSharding``: a mesh of ranks, its axis names and the spec."""

    ranks: np.ndarray
    axis_names: tuple[str, ...]
    spec: tuple[object, ...]


def _device_rank(d: jax.Device) -> int:
    return int(d.id)


def describe_sharding(
    sharding: object, shape: tuple[int, ...], rank_of: Callable[[jax.Device], int] | None = None
) -> MeshForm | dict[int, Box]:
    """A sharding as a :class:`MeshForm`, or as every rank's box (the general path).

    Args:
      sharding: any ``jax.sharding.Sharding``.
      shape: the global shape.
      rank_of: maps a device to its rank; default ``device.id``.

    Raises:
      LayoutError: ``sharding`` is not a jax sharding, or cannot hold ``shape``.
    """
    rank_of = rank_of or _device_rank
    if not isinstance(sharding, jax.sharding.Sharding):
        raise LayoutError(f"sharding={sharding!r} is not a jax.sharding.Sharding")
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        pspec = sharding.spec
        if getattr(pspec, "unreduced", None):
            # Unreduced axes hold partial sums, not copies: no box of the array lives anywhere
            # (jax.device_put refuses them too).
            raise LayoutError(
                f"sharding {sharding} has unreduced axes {sorted(pspec.unreduced)}: its shards hold partial sums, "
                "not parts of the array; the fix is to reduce them (jax.lax.psum) before moving the array"
            )
        manual = _manual_axes(mesh)
        if manual:
            raise LayoutError(
                f"sharding {sharding} is on a mesh whose axes {manual} are Manual: a manual axis exists only inside "
                "shard_map, and no array outside it lives on one (jax.device_put fails on it too); the fix is the "
                "same mesh with those axes Auto or Explicit (jax.make_mesh(..., axis_types=...))"
            )
        # Reduced axes hold full copies (as replication does for the bytes); the partitions say the boxes.
        spec = tuple(getattr(pspec, "partitions", pspec))
        if mesh.devices.size and all(e is None or isinstance(e, (str, tuple)) for e in spec):
            ranks = np.vectorize(rank_of, otypes=[np.int64])(np.asarray(mesh.devices))
            return MeshForm(ranks, tuple(mesh.axis_names), spec)
    try:
        index_map = sharding.devices_indices_map(shape)
    except ValueError as err:
        raise LayoutError(f"sharding {sharding} cannot hold a tensor of shape={shape}: {err}") from err
    return {rank_of(d): Box.from_slices(idx, shape) for d, idx in index_map.items()}


def _manual_axes(mesh: Any) -> list[str]:
    """The names of ``mesh``'s axes of type ``Manual`` (none where this jax has no axis types)."""
    manual = getattr(getattr(jax.sharding, "AxisType", None), "Manual", None)
    types = getattr(mesh, "axis_types", None) or ()
    return [str(n) for n, t in zip(mesh.axis_names, types, strict=False) if manual is not None and t == manual]


def addressable_order(sharding: Sharding) -> tuple[Any, ...]:
    """The devices of a sharding in the order jax lists an array's shards (``addressable_data``)."""
    try:
        return tuple(sharding._internal_device_list.addressable_device_list)
    except AttributeError:  # pragma: no cover - another jax: the same order under its older name
        return tuple(sharding._addressable_device_assignment)
