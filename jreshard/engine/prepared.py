"""The checked value the front door hands down: one call's leaves, targets and cached shape.

:func:`jreshard.call.front.prepare` builds a :class:`Prepared` once per call; the registry and
the runners below it read it and never flatten the pytree again.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jreshard.sharding.layout import Layout
from jreshard.types import Sharding, Target, TreeDef

__all__ = ["Group", "Kind", "Mode", "Prepared", "Shape", "sharding_of"]


class Mode(enum.Enum):
    """What the call writes: new arrays (``transfer``) or the caller's ``into`` arrays."""

    TRANSFER = "transfer"
    INTO = "into"


class Kind(enum.IntEnum):
    """What happens to one leaf."""

    KEEP = 0  # returned as it is: a None target, or (transfer) the very same sharding
    MOVE = 1  # bytes move into new or donated destination shards


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Group:
    """Moved leaves that share a (source layout, destination layout) pair.

    Attributes:
      src, dst: the layouts.
      leaves: the leaf indices of the group, in tree order.
      src_order: per leaf of the group, for each of its source array's addressable
        shards (in ``addressable_data`` order), the source slot it fills.
      dst_order: per leaf, for each device of its target sharding (in the order jax
        assembles them), the destination slot it holds.
      devices: per leaf, the target sharding's devices in that order.
      common_dst: ``dst_order``'s one entry when every leaf has the same, else ``None`` (derived).
    """

    src: Layout
    dst: Layout
    leaves: tuple[int, ...]
    src_order: tuple[tuple[int, ...], ...]
    dst_order: tuple[tuple[int, ...], ...]
    devices: tuple[list[Any], ...]
    common_dst: tuple[int, ...] | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        # The one destination order every leaf shares (then its devices are the same too: a slot is a
        # device id of the layout), or None: the runners build a whole group's shards in one pass.
        if self.dst_order and len(set(self.dst_order)) == 1:
            object.__setattr__(self, "common_dst", self.dst_order[0])


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Shape:
    """Everything about a transfer that depends only on its cache key.

    Attributes:
      kinds: per leaf, kept or moved.
      groups: the moved leaves, grouped by layout pair.
      shardings: per leaf, the target sharding (``None`` for a kept leaf).
    """

    kinds: tuple[Kind, ...]
    groups: tuple[Group, ...]
    shardings: tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Prepared:
    """One call: its leaves, targets, tree structure and cached :class:`Shape`."""

    mode: Mode
    leaves: list[Any]
    targets: list[Any]
    treedef: TreeDef
    shape: Shape

    @property
    def on_gpus(self) -> bool:
        """Whether the leaves are on CUDA GPUs (the first leaf says: one call is on one platform)."""
        return any(d.platform in ("gpu", "cuda") for leaf in self.leaves[:1] for d in leaf.sharding.device_set)


def sharding_of(target: Target) -> Sharding:
    """The sharding object a checked target leaf names: itself, a ShapeDtypeStruct's or an array's
    (``None`` for ``None``). Results carry this very object, as ``jax.device_put``'s do."""
    if target is None:
        return None
    sharding = getattr(target, "sharding", None)
    return target if sharding is None else sharding
