"""jreshard: move JAX arrays and parameter pytrees between distributed layouts.

The public API; everything here is re-exported from private modules. The names
that need jax (``transfer``, ``transfer_into``, ``RefitGroup``) are loaded on
first use, so that planning and simulation at scale (``jreshard.plan`` on
layouts, ``jreshard.cost``) run with numpy alone.
"""

import importlib as _importlib
import typing as _typing

from jreshard import baselines as baselines
from jreshard import cost as cost
from jreshard.errors import AuthenticationError as AuthenticationError
from jreshard.errors import BackendUnavailableError as BackendUnavailableError
from jreshard.errors import IndivisibleError as IndivisibleError
from jreshard.errors import IntegrityError as IntegrityError
from jreshard.errors import LayoutError as LayoutError
from jreshard.errors import LayoutJSONError as LayoutJSONError
from jreshard.errors import LayoutMismatchError as LayoutMismatchError
from jreshard.errors import PeerError as PeerError
from jreshard.errors import RefitCancelledError as RefitCancelledError
from jreshard.errors import TopologyError as TopologyError
from jreshard.errors import TransferError as TransferError
from jreshard.errors import TransferTimeoutError as TransferTimeoutError
from jreshard.options import Backend as Backend
from jreshard.options import Delta as Delta
from jreshard.options import Options as Options
from jreshard.report import TransferReport as TransferReport
from jreshard.sharding.box import Box as Box
from jreshard.sharding.caches import clear_caches as clear_caches
from jreshard.sharding.layout import Layout as Layout
from jreshard.sharding.plan import Message as Message
from jreshard.sharding.plan import Plan as Plan
from jreshard.sharding.plan import PlanStats as PlanStats
from jreshard.sharding.plan import RankPlan as RankPlan
from jreshard.sharding.rows import Move as Move
from jreshard.sharding.rows import Phase as Phase
from jreshard.sharding.topology import Link as Link
from jreshard.sharding.topology import Links as Links
from jreshard.sharding.topology import Topology as Topology
from jreshard.sharding.trees import plan as plan

if _typing.TYPE_CHECKING:
    from jreshard.api import transfer as transfer
    from jreshard.api import transfer_into as transfer_into
    from jreshard.refit import RefitGroup as RefitGroup

_LAZY = {"transfer": "jreshard.api", "transfer_into": "jreshard.api", "RefitGroup": "jreshard.refit"}
_SUBPACKAGES = ("views", "elastic")  # loaded on first use: they import jax


def __getattr__(name: str) -> object:
    if name in _SUBPACKAGES:
        return _importlib.import_module(f"jreshard.{name}")
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jreshard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])


__version__ = "0.1.0"

# Every public name, in the order of the API reference (docs/api.md); a test checks that each one is there.
__all__ = [
    # moving arrays
    "transfer",
    "transfer_into",
    "TransferReport",
    "Options",
    "Backend",
    "Delta",
    "RefitGroup",
    "clear_caches",
    # layouts, topologies, plans
    "Layout",
    "Box",
    "Topology",
    "Links",
    "Link",
    "plan",
    "Plan",
    "PlanStats",
    "Phase",
    "RankPlan",
    "Message",
    "Move",
    "baselines",
    "cost",
    "views",
    "elastic",
    # errors
    "LayoutError",
    "LayoutMismatchError",
    "LayoutJSONError",
    "IndivisibleError",
    "TopologyError",
    "BackendUnavailableError",
    "TransferError",
    "TransferTimeoutError",
    "PeerError",
    "RefitCancelledError",
    "IntegrityError",
    "AuthenticationError",
]
