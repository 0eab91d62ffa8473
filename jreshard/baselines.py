"""Baseline plans, for honest comparison: ``gather_broadcast`` and ``flat_direct``."""

from jreshard.sharding.trees import flat_direct as flat_direct
from jreshard.sharding.trees import gather_broadcast as gather_broadcast

__all__ = ["flat_direct", "gather_broadcast"]
