"""Baseline plans, for honest comparison: ``gather_broadcast`` and ``flat_direct``."""

from jreshard.planning import flat_direct as flat_direct
from jreshard.planning import gather_broadcast as gather_broadcast

__all__ = ["flat_direct", "gather_broadcast"]
