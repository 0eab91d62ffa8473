"""Versioned refits between a source program (trainer) and a destination program (server).

- :mod:`jreshard.refit.group`: :class:`RefitGroup`, forming a group over MPI or NIXL and its refits;
- :mod:`jreshard.refit.endpoint`: :class:`Endpoint`, a receiving process without jax (its own buffers);
- :mod:`jreshard.refit.decl`: the declarations every process exchanges, and their checks;
- :mod:`jreshard.refit.views`: a refit through a view (casts, fused parameters) of the source's tree.

Importing this package needs no jax: ``RefitGroup`` loads it when a group is formed from jax arrays.
"""

from jreshard.refit.endpoint import Declaration as Declaration
from jreshard.refit.endpoint import Endpoint as Endpoint
from jreshard.refit.endpoint import RawMemory as RawMemory
from jreshard.refit.endpoint import Tensor as Tensor
from jreshard.refit.group import RefitGroup as RefitGroup
from jreshard.refit.group import Role as Role

__all__ = ["Declaration", "Endpoint", "RawMemory", "RefitGroup", "Role", "Tensor"]
