"""jreshard: move JAX arrays and parameter pytrees between distributed layouts.

The public API; everything here is re-exported from private modules.
"""

from jreshard import baselines as baselines
from jreshard.errors import BackendUnavailableError as BackendUnavailableError
from jreshard.errors import IndivisibleError as IndivisibleError
from jreshard.errors import LayoutError as LayoutError
from jreshard.errors import LayoutJSONError as LayoutJSONError
from jreshard.errors import LayoutMismatchError as LayoutMismatchError
from jreshard.errors import PeerError as PeerError
from jreshard.errors import TopologyError as TopologyError
from jreshard.errors import TransferError as TransferError
from jreshard.errors import TransferTimeoutError as TransferTimeoutError
from jreshard.options import Backend as Backend
from jreshard.options import Options as Options
from jreshard.planning import plan as plan
from jreshard.sharding.box import Box as Box
from jreshard.sharding.layout import Layout as Layout
from jreshard.sharding.plan import Phase as Phase
from jreshard.sharding.program import Message as Message
from jreshard.sharding.program import Plan as Plan
from jreshard.sharding.program import PlanStats as PlanStats
from jreshard.sharding.program import RankProgram as RankProgram
from jreshard.sharding.program import Transfer as Transfer
from jreshard.sharding.topology import Link as Link
from jreshard.sharding.topology import Links as Links
from jreshard.sharding.topology import Topology as Topology

__version__ = "0.1.0"
